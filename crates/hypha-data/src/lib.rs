//! Hypha data nodes and their clients.
//!
//! - [`Catalog`]: the datasets under `dataset_path`, kept in step with the disk.
//! - [`protocol`]: the slice protocol (`/hypha/slice/1.0.0`), its framing and limits.
//! - [`server`]: serves slices to many clients with per-peer and global limits; a malformed
//!   request costs its own stream only.
//! - [`DataClient`]: finds providers in the DHT, fetches manifests, and downloads slices with
//!   verification, resumption and fallback.
//! - [`iteration`]: exactly-once iteration over a ledger, for schedulers (`cluster_sync =
//!   true`) and for a data node's own clients (`cluster_sync = false`).
//! - [`commands`]: `inspect`, `verify` and `fetch` for humans.
//! - [`node`]: the `hypha-data run` node: announces every dataset as a Kademlia provider record,
//!   answers manifest requests, serves slices, follows changes on disk.

mod catalog;
mod client;
pub mod commands;
pub mod iteration;
pub mod node;
pub mod protocol;
pub mod server;

pub use catalog::{Catalog, Changes};
pub use client::{DataClient, FetchError, FetchReport, SliceId};
