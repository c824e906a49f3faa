//! The `telemetry_*` keys (seed format). Standard `OTEL_*` variables override them; that
//! precedence is applied by `hypha-telemetry`.

use serde::Deserialize;

use crate::{DefaultValue, Key, Kind};

pub fn keys() -> Vec<Key> {
    vec![
        Key {
            name: "telemetry_endpoint",
            kind: Kind::String,
            default: DefaultValue::Unset {
                example: r#""http://127.0.0.1:4318""#,
            },
            doc: "OTLP endpoint to export traces, metrics and logs to. Unset: console logs only. OTEL_EXPORTER_OTLP_ENDPOINT overrides it.",
        },
        Key {
            name: "telemetry_headers",
            kind: Kind::String,
            default: DefaultValue::Unset {
                example: r#""Authorization=Basic <api key>""#,
            },
            doc: "Headers sent with every export, as key=value pairs separated by commas.",
        },
        Key {
            name: "telemetry_protocol",
            kind: Kind::String,
            default: DefaultValue::Value(r#""http/protobuf""#),
            doc: "OTLP transport: \"http/protobuf\" or \"grpc\".",
        },
        Key {
            name: "telemetry_attributes",
            kind: Kind::String,
            default: DefaultValue::Unset {
                example: r#""service.name=node-01,deployment.environment=prod""#,
            },
            doc: "Resource attributes as key=value pairs separated by commas.",
        },
        Key {
            name: "telemetry_sampler",
            kind: Kind::String,
            default: DefaultValue::Value(r#""parentbased_always_on""#),
            doc: "Trace sampler: always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio.",
        },
        Key {
            name: "telemetry_sample_ratio",
            kind: Kind::Float,
            default: DefaultValue::Value("1.0"),
            doc: "Share of traces kept by the traceidratio samplers, 0.0 to 1.0.",
        },
    ]
}

/// The telemetry settings as written in the config.
#[derive(Debug, Clone, Deserialize)]
pub struct TelemetryConfig {
    pub telemetry_endpoint: Option<String>,
    pub telemetry_headers: Option<String>,
    pub telemetry_protocol: Option<String>,
    pub telemetry_attributes: Option<String>,
    pub telemetry_sampler: Option<String>,
    pub telemetry_sample_ratio: Option<f64>,
}
