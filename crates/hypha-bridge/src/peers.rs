//! `POST /resources/send` and `POST /resources/receive`: files between the jobs of a task.
//!
//! Strategies, for sending: `All` sends to every listed peer at once and succeeds only when
//! all took the file; `One` tries the peers in the order given until one takes it; `Random`
//! does the same in a random order. For receiving, `All` streams every file from the listed
//! peers (from anyone when the list is empty) until the client hangs up or the job ends, while
//! `One` and `Random` end the stream after the first file.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, de::Error as _};

use crate::{ErrorBody, FileEntry, dialect};

/// Where received files go when the request names no directory (the upstream client's
/// default).
pub const DEFAULT_RECEIVE_DIR: &str = "incoming";

/// How a resource is spread over, or gathered from, several peers. Written `"All"` or, as the
/// upstream client writes it, `{"type": "All"}`; lower case is read too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub enum Strategy {
    #[default]
    All,
    One,
    Random,
}

impl<'de> Deserialize<'de> for Strategy {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        let name = match &value {
            serde_json::Value::String(name) => Some(name.as_str()),
            serde_json::Value::Object(object) => {
                object.get("type").and_then(serde_json::Value::as_str)
            }
            _ => None,
        };
        match name {
            Some("All" | "all") => Ok(Strategy::All),
            Some("One" | "one") => Ok(Strategy::One),
            Some("Random" | "random") => Ok(Strategy::Random),
            _ => Err(D::Error::custom(format!(
                "{value} is not a strategy: write \"All\", \"One\" or \"Random\" (or {{\"type\": \"All\"}})"
            ))),
        }
    }
}

impl JsonSchema for Strategy {
    fn schema_name() -> Cow<'static, str> {
        "Strategy".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let names = ["All", "One", "Random", "all", "one", "random"];
        json_schema!({
            "description": "How a resource is spread over, or gathered from, several peers: `All`, `One` or `Random` (lower case is read too); the upstream client writes it as an object `{\"type\": \"All\"}`.",
            "default": "All",
            "oneOf": [
                { "type": "string", "enum": names },
                {
                    "type": "object",
                    "properties": { "type": { "type": "string", "enum": names } },
                    "required": ["type"]
                }
            ]
        })
    }
}

/// Jobs of this job's task on other workers, by their workers' peer ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Peers {
    /// Peer ids (`12D3KooW…`).
    #[serde(default)]
    pub peers: Vec<String>,
    #[serde(default)]
    pub strategy: Strategy,
}

impl Peers {
    /// `peers` with the strategy `strategy`.
    pub fn new(peers: impl IntoIterator<Item = impl Into<String>>, strategy: Strategy) -> Self {
        Peers {
            peers: peers.into_iter().map(Into::into).collect(),
            strategy,
        }
    }
}

/// The peers of a send or a receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type")]
#[schemars(transform = dialect::lower_case_tags)]
pub enum Target {
    #[serde(alias = "peers")]
    Peers(Peers),
}

/// `POST /resources/send`. The upstream client names `send` `resource`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(transform = send_dialects)]
pub struct SendRequest {
    #[serde(alias = "resource")]
    pub send: Target,
    /// The file to send, relative to the job's directory.
    pub path: String,
    /// How long to keep trying a peer that cannot be reached or refuses for now, in
    /// milliseconds; default 30 000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience_ms: Option<u64>,
}

fn send_dialects(schema: &mut Schema) {
    dialect::alias(schema, "send", "resource");
}

/// `POST /resources/receive`. The upstream client names `receive` `resource` and `out_dir`
/// `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(transform = receive_dialects)]
pub struct ReceiveRequest {
    #[serde(alias = "resource")]
    pub receive: Target,
    /// Where received files go, relative to the job's directory; created when missing.
    /// Default `incoming`.
    #[serde(alias = "path", default = "default_receive_dir")]
    pub out_dir: String,
}

fn receive_dialects(schema: &mut Schema) {
    dialect::alias(schema, "receive", "resource");
    dialect::alias(schema, "out_dir", "path");
}

fn default_receive_dir() -> String {
    DEFAULT_RECEIVE_DIR.to_string()
}

/// One file of a receive stream: `id: <sequence>`, `data: <this, as JSON>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReceiveEvent {
    #[serde(flatten)]
    pub entry: FileEntry,
    pub from_peer: String,
    /// Per job, from 0, in order of arrival; the file is `{out_dir}/{sequence}-{name}`.
    pub sequence: u64,
}

/// An error in a receive stream: `event: error`, `data: <this, as JSON>`. It has no `path`
/// and an `error`, so that a client that reads only `data:` lines tells it from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StreamError {
    pub error: ErrorBody,
}

/// What a `data:` line of a receive stream holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum StreamData {
    Error(StreamError),
    File(ReceiveEvent),
}
