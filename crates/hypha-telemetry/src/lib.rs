//! Telemetry shared by every Hypha node: console logs, OpenTelemetry traces, metrics and logs.
//!
//! [`init`] installs a `tracing` subscriber that prints to stderr (filtered by `RUST_LOG`) and,
//! when an OTLP endpoint is configured, exports spans, metrics and log records over OTLP (gRPC
//! or HTTP/protobuf). [`propagation`] carries trace context inside requests between nodes, and
//! [`metrics`] holds the instruments the network records into (bytes per protocol).
//!
//! This crate knows nothing of config files: callers hand it [`Settings`], which
//! [`Settings::resolve`] builds from the `telemetry_*` keys with standard `OTEL_*` variables
//! taking precedence.

mod init;
pub mod metrics;
pub mod propagation;
mod settings;
#[cfg(feature = "testing")]
pub mod testing;

pub use init::{Error, Guard, init};
pub use settings::{Protocol, Sampler, Settings, TelemetryKeys};
