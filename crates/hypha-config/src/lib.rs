//! Layered configuration for Hypha nodes.
//!
//! A node's settings come from, lowest to highest precedence:
//!
//! 1. the defaults in the node's [`Schema`],
//! 2. its TOML file (`--config FILE`),
//! 3. `HYPHA_*` environment variables (`HYPHA_WORK_DIR`, nested keys with `__`:
//!    `HYPHA_RESOURCES__CPU`); one that names no key of the node is ignored and listed in
//!    [`Loaded::ignored_variables`] (the variables of one shell reach every program),
//! 4. command-line flags.
//!
//! The schema lists every key a node accepts with its type, default and documentation; it is the
//! single source for defaults, for rejecting unknown keys, for parsing environment values and for
//! the commented file that `init` writes ([`Schema::template`]). Every error is a [`ConfigError`]
//! that names the key, where its value came from (file, line and column; variable; flag) and how
//! to fix it.
//!
//! The keys every network node shares are in [`network`]; telemetry keys in [`telemetry`].
//! This crate knows nothing of what nodes do with their settings.
//!
//! ```
//! use hypha_config::{Layers, Schema, network};
//!
//! let schema = Schema::new("hypha-example", vec![network::keys(), hypha_config::telemetry::keys()].concat());
//! let toml = r#"
//! cert_pem = "node-cert.pem"
//! key_pem = "node-key.pem"
//! trust_pem = "root.pem"
//! listen_addresses = ["/ip4/127.0.0.1/tcp/4001"]
//! "#;
//! let loaded = Layers::new(&schema)
//!     .file_text("example.toml", toml)
//!     .unwrap()
//!     .load()
//!     .unwrap();
//! let net: network::NetworkConfig = loaded.section().unwrap();
//! assert_eq!(net.listen_addresses.len(), 1);
//! ```

mod error;
mod layers;
pub mod network;
mod schema;
pub mod telemetry;

pub use error::{ConfigError, Origin};
pub use layers::{IgnoredVariable, Layers, Loaded};
pub use schema::{DefaultValue, Key, Kind, Schema};
