//! W3C trace context across nodes.
//!
//! The sender injects the context of its current span into the request it sends; the receiver
//! makes that context the parent of the span that handles it. Without an exporter installed the
//! context is empty and nothing travels.

use std::collections::BTreeMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Trace context as carried in messages (`traceparent`, `tracestate`).
pub type TraceContext = BTreeMap<String, String>;

/// The context of `span`, ready to put in a message.
pub fn inject(span: &tracing::Span) -> TraceContext {
    let mut carrier = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.into_iter().collect()
}

/// Makes the sender's context (from a received message) the parent of `span`.
pub fn set_parent(span: &tracing::Span, carrier: &TraceContext) {
    if carrier.is_empty() {
        return;
    }
    let carrier: std::collections::HashMap<String, String> = carrier
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let parent = TraceContextPropagator::new().extract(&carrier);
    // Fails only when the span is disabled (no OpenTelemetry layer); nothing to link then.
    let _ = span.set_parent(parent);
}
