//! Real parts for tests and benchmarks, kept out of the product's crates so that no product
//! crate has a feature that a test or `hypha-bench` turns on (which would rebuild it and every
//! crate above it after `cargo build --release`).
//!
//! - [`cluster`]: the workspace's programs as real processes with real certificates in a
//!   temporary directory (gateway, data nodes, workers, schedulers), and what they leave
//!   behind (ledger audits, events files).
//! - [`network`]: real swarms in this process, connected on 127.0.0.1.
//! - [`s3`]: a real S3 server in-process that counts and can throttle the bytes it serves.
//! - [`netns`]: network namespaces behind rate-limited links (`tc … tbf`), for nodes on slow
//!   links on one machine.
//! - [`sites`]: a public network with the gateway and sites that are private LANs behind NAT
//!   routers (cone or symmetric) with rate-limited uplinks.
//!
//! Everything here panics on failure: it is for tests and benchmark harnesses, which should
//! fail loudly at the step that went wrong. It knows the programs by their command lines and
//! files, not by their internals.

#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

pub mod cluster;
pub mod netns;
pub mod network;
pub mod s3;
pub mod sites;
