use std::collections::HashMap;

use opentelemetry::{KeyValue, trace::TracerProvider as _};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::{
    Resource, logs::SdkLoggerProvider, metrics::SdkMeterProvider, trace::SdkTracerProvider,
};
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

use crate::{Protocol, Sampler, Settings};

/// Telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot create the OTLP {signal} exporter for {endpoint}: {message}")]
    Exporter {
        signal: &'static str,
        endpoint: String,
        message: String,
    },
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// Keeps exporters running; dropping it flushes what is buffered and shuts them down.
#[must_use = "telemetry stops when the guard is dropped"]
#[derive(Debug, Default)]
pub struct Guard {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
    logger: Option<SdkLoggerProvider>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Errors here mean the collector went away; there is nowhere left to report them.
        if let Some(t) = self.tracer.take() {
            let _ = t.shutdown();
        }
        if let Some(m) = self.meter.take() {
            let _ = m.shutdown();
        }
        if let Some(l) = self.logger.take() {
            let _ = l.shutdown();
        }
    }
}

/// Targets whose logs never go to the OTLP log exporter: the exporter's own stack, which would
/// otherwise feed on itself.
const EXPORTER_TARGETS: [&str; 6] = ["opentelemetry", "hyper", "h2", "tonic", "reqwest", "tower"];

/// Installs the global subscriber: console output filtered by `RUST_LOG` (default `info`) and,
/// when `settings` has an endpoint, OTLP export of traces, metrics and logs.
///
/// Call from within a Tokio runtime (the gRPC exporter needs one).
pub fn init(settings: &Settings) -> Result<Guard, Error> {
    use std::io::IsTerminal;
    let console = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(env_filter());

    let Some(_) = settings.endpoint else {
        tracing_subscriber::registry()
            .with(console)
            .try_init()
            .map_err(|_| Error::AlreadyInstalled)?;
        return Ok(Guard::default());
    };

    let resource = Resource::builder_empty()
        .with_service_name(settings.service_name.clone())
        .with_attributes(
            settings
                .attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .build();

    let tracer = SdkTracerProvider::builder()
        .with_batch_exporter(span_exporter(settings)?)
        .with_sampler(sampler(settings.sampler))
        .with_resource(resource.clone())
        .build();
    let meter = SdkMeterProvider::builder()
        .with_periodic_exporter(metric_exporter(settings)?)
        .with_resource(resource.clone())
        .build();
    let logger = SdkLoggerProvider::builder()
        .with_batch_exporter(log_exporter(settings)?)
        .with_resource(resource)
        .build();

    opentelemetry::global::set_tracer_provider(tracer.clone());
    opentelemetry::global::set_meter_provider(meter.clone());
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );

    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer.tracer("hypha"))
        .with_filter(env_filter());
    let mut log_filter = env_filter();
    for target in EXPORTER_TARGETS {
        if let Ok(directive) = format!("{target}=off").parse() {
            log_filter = log_filter.add_directive(directive);
        }
    }
    let logs = opentelemetry_appender_tracing::layer::OpenTelemetryTracingBridge::new(&logger)
        .with_filter(log_filter);

    tracing_subscriber::registry()
        .with(console)
        .with(spans)
        .with(logs)
        .try_init()
        .map_err(|_| Error::AlreadyInstalled)?;

    Ok(Guard {
        tracer: Some(tracer),
        meter: Some(meter),
        logger: Some(logger),
    })
}

/// `RUST_LOG`, or by default `info` without two warnings an operator cannot act on: Kademlia's
/// "Failed to trigger bootstrap: No known peers" whenever a listener comes up before any peer is
/// connected (every gateway's normal start), and yamux's "Failure while closing connection"
/// when the other side has already closed it (every normal shutdown).
fn env_filter() -> EnvFilter {
    EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,libp2p_kad=error,yamux::connection=error"))
}

fn sampler(sampler: Sampler) -> opentelemetry_sdk::trace::Sampler {
    use opentelemetry_sdk::trace::Sampler as S;
    match sampler {
        Sampler::AlwaysOn => S::AlwaysOn,
        Sampler::AlwaysOff => S::AlwaysOff,
        Sampler::TraceIdRatio(r) => S::TraceIdRatioBased(r),
        Sampler::ParentBasedAlwaysOn => S::ParentBased(Box::new(S::AlwaysOn)),
        Sampler::ParentBasedAlwaysOff => S::ParentBased(Box::new(S::AlwaysOff)),
        Sampler::ParentBasedTraceIdRatio(r) => S::ParentBased(Box::new(S::TraceIdRatioBased(r))),
    }
}

/// Builds the OTLP exporter of one signal for the configured protocol, endpoint and headers.
macro_rules! exporter {
    ($name:ident, $exporter:ty, $signal:literal) => {
        fn $name(settings: &Settings) -> Result<$exporter, Error> {
            let endpoint = settings.signal_endpoint($signal).unwrap_or_default();
            let headers: HashMap<String, String> = settings.headers.iter().cloned().collect();
            let built = match settings.protocol {
                Protocol::HttpProtobuf => <$exporter>::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint.clone())
                    .with_headers(headers)
                    .build(),
                Protocol::Grpc => <$exporter>::builder()
                    .with_tonic()
                    .with_endpoint(endpoint.clone())
                    .with_metadata(metadata(&headers))
                    .build(),
            };
            built.map_err(|e| Error::Exporter {
                signal: $signal,
                endpoint,
                message: e.to_string(),
            })
        }
    };
}

exporter!(span_exporter, opentelemetry_otlp::SpanExporter, "traces");
exporter!(
    metric_exporter,
    opentelemetry_otlp::MetricExporter,
    "metrics"
);
exporter!(log_exporter, opentelemetry_otlp::LogExporter, "logs");

fn metadata(headers: &HashMap<String, String>) -> tonic::metadata::MetadataMap {
    let mut map = tonic::metadata::MetadataMap::new();
    for (key, value) in headers {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.to_ascii_lowercase().as_bytes()),
            value.parse(),
        ) {
            map.insert(key, value);
        }
    }
    map
}
