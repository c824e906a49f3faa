//! The job bridge's interface: what an executor and its worker say to each other over the
//! job's Unix socket (HTTP/1.1, JSON), as Rust types both ends share.
//!
//! The worker's bridge (`hypha-worker`) reads the requests and writes the answers defined
//! here; our reference executor (`hypha-executor`) writes and reads the same types through
//! [`client::Client`]; `openapi.json` is generated from them ([`openapi`]) and a test fails
//! when the committed file differs. A change to the bridge's shapes is one change here, seen
//! by every side at compile time.
//!
//! **Two dialects.** Requests are read in seed 003's shapes and in those of the upstream
//! Hypha project's Python client (`Session` of its accelerate executor): a bare reference as
//! a fetch body, `resource`/`path` for `send`/`receive`/`out_dir`, strategies as `"All"` or
//! `{"type": "All"}`, lower-case reference types. Status answers carry the upstream `type`
//! beside our fields ([`status`]); the job's JSON carries `job_id` and `executor.config`
//! beside `id` and `config` ([`job`]); error events of a receive stream are told from files
//! by their `error` field alone ([`peers::StreamError`]).
//!
//! This crate owns shapes and their documentation only: it knows nothing of networks,
//! ledgers, models or files on disk.

pub mod client;
mod dialect;
pub mod error;
pub mod fetch;
pub mod job;
pub mod openapi;
pub mod peers;
pub mod status;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use error::ErrorBody;
pub use fetch::{ConsumedAnswer, ConsumedRequest, FetchRequest, Reference, SchedulerReference};
pub use job::{ExecutorDescription, JobDescription};
pub use peers::{Peers, ReceiveEvent, ReceiveRequest, SendRequest, Strategy, StreamError, Target};

/// The largest request body the bridge reads.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// A file the bridge wrote or read for the executor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileEntry {
    /// Relative to the job's directory.
    pub path: String,
    /// In bytes.
    pub size: u64,
    /// `sha256:<hex>`.
    pub checksum: String,
    /// What the bridge knows of the file: `epoch`, `slice` and `samples` of a slice,
    /// `from_peer` and `sequence` of a file a peer sent, `peers` a file was sent to, …
    #[serde(default)]
    pub metadata: BTreeMap<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;
    use crate::fetch::FetchBody;

    fn read<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn both_dialects_read_as_the_same_requests() {
        let ours: FetchBody =
            read(json!({"fetch": {"type": "Uri", "value": "https://x/y"}, "out_dir": "artifacts"}));
        let upstream: FetchBody = read(json!({"type": "uri", "value": "https://x/y"}));
        assert_eq!(FetchRequest::from(ours), FetchRequest::from(upstream));

        let ours: SendRequest = read(
            json!({"send": {"type": "Peers", "peers": ["p"], "strategy": "All"}, "path": "f"}),
        );
        let upstream: SendRequest = read(
            json!({"resource": {"type": "peers", "peers": ["p"], "strategy": {"type": "All"}}, "path": "f"}),
        );
        assert_eq!(ours, upstream);

        let ours: ReceiveRequest =
            read(json!({"receive": {"type": "Peers", "peers": ["p"]}, "out_dir": "incoming"}));
        let upstream: ReceiveRequest =
            read(json!({"resource": {"type": "peers", "peers": ["p"]}, "path": "incoming"}));
        let defaulted: ReceiveRequest =
            read(json!({"resource": {"type": "peers", "peers": ["p"]}}));
        assert_eq!(ours, upstream);
        assert_eq!(ours, defaulted);
    }

    #[test]
    fn a_mistake_is_reported_in_the_shape_it_was_made_in() {
        let error = |value: serde_json::Value| {
            serde_json::from_value::<FetchBody>(value)
                .unwrap_err()
                .to_string()
        };
        assert!(error(json!({"fetch": {"type": "Uri"}})).contains("missing field `value`"));
        assert!(error(json!({"type": "Nowhere"})).contains("unknown variant `Nowhere`"));
        assert!(error(json!({"out_dir": "x"})).contains("a bare reference"));
        assert!(error(json!({"type": "peers", "wait_ms": 100})).contains("\"wait_ms\" beside"));
        let strategy = serde_json::from_value::<Strategy>(json!({"type": "Most"}))
            .unwrap_err()
            .to_string();
        assert!(
            strategy.contains("\"All\", \"One\" or \"Random\""),
            "{strategy}"
        );
    }
}
