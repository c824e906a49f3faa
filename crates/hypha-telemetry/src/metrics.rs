//! Instruments shared by every node.
//!
//! Instruments are created from the global meter provider, which [`init`](crate::init) sets when
//! metrics are exported; before that (and in tests) they are no-ops and cost next to nothing.

use std::sync::OnceLock;

use opentelemetry::{KeyValue, metrics::Counter};

/// Which way bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    In,
    Out,
}

impl Direction {
    fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

fn bytes_counter() -> &'static Counter<u64> {
    static COUNTER: OnceLock<Counter<u64>> = OnceLock::new();
    COUNTER.get_or_init(|| {
        opentelemetry::global::meter("hypha")
            .u64_counter("hypha.network.bytes")
            .with_unit("By")
            .with_description("Bytes sent and received, per protocol")
            .build()
    })
}

/// Records `bytes` moved over `protocol` in `direction`.
pub fn record_bytes(protocol: &'static str, direction: Direction, bytes: u64) {
    if bytes == 0 {
        return;
    }
    bytes_counter().add(
        bytes,
        &[
            KeyValue::new("protocol", protocol),
            KeyValue::new("direction", direction.as_str()),
        ],
    );
}
