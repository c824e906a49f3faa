//! Exports to a real OTLP/HTTP receiver started by the test, the way a node does at start-up.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use hypha_telemetry::{
    Settings, TelemetryKeys, metrics, propagation,
    testing::{Collector, Export},
};
use opentelemetry_proto::tonic::collector::{
    logs::v1::ExportLogsServiceRequest, metrics::v1::ExportMetricsServiceRequest,
    trace::v1::ExportTraceServiceRequest,
};
use prost::Message;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_metrics_and_logs_reach_an_otlp_http_collector() {
    let collector = Collector::start().await.unwrap();
    let port = collector.port;
    let keys = TelemetryKeys {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        headers: Some("x-hypha-test=yes".into()),
        protocol: Some("http/protobuf".into()),
        attributes: Some("service.name=otlp-test,deployment.environment=ci".into()),
        sampler: Some("always_on".into()),
        sample_ratio: None,
    };
    let settings = Settings::resolve(&keys, "unused", |_| None).unwrap();
    let guard = hypha_telemetry::init(&settings).unwrap();

    let (trace_id, parent_span_id) = {
        let parent = tracing::info_span!("send-request");
        let _entered = parent.enter();
        tracing::info!(answer = 42, "hello collector");
        metrics::record_bytes("/test/proto/1", metrics::Direction::In, 42);

        // What a receiving node does with the context it finds in a request.
        let carrier = propagation::inject(&parent);
        assert!(carrier.contains_key("traceparent"), "{carrier:?}");
        let child = tracing::info_span!(parent: None, "handle-request");
        propagation::set_parent(&child, &carrier);
        drop(child.enter());
        drop(child);

        let traceparent = carrier["traceparent"].clone();
        let parts: Vec<&str> = traceparent.split('-').collect();
        (parts[1].to_string(), parts[2].to_string())
    };
    // Dropping the guard flushes every exporter.
    tokio::task::spawn_blocking(move || drop(guard))
        .await
        .unwrap();

    let exports = collector.exports();
    let find = |path: &str| -> Vec<Export> {
        exports.iter().filter(|e| e.path == path).cloned().collect()
    };

    let traces = find("/v1/traces");
    assert!(
        !traces.is_empty(),
        "no traces exported; got {:?}",
        exports.iter().map(|e| &e.path).collect::<Vec<_>>()
    );
    assert!(
        traces[0]
            .headers
            .iter()
            .any(|(k, v)| k == "x-hypha-test" && v == "yes"),
        "configured headers are sent"
    );
    let mut spans = Vec::new();
    let mut service_names = Vec::new();
    for export in &traces {
        let request = ExportTraceServiceRequest::decode(export.body.as_slice()).unwrap();
        for resource_spans in request.resource_spans {
            if let Some(resource) = resource_spans.resource {
                for attribute in resource.attributes {
                    if attribute.key == "service.name" {
                        service_names.push(format!("{:?}", attribute.value));
                    }
                }
            }
            for scope in resource_spans.scope_spans {
                spans.extend(scope.spans);
            }
        }
    }
    assert!(
        service_names.iter().all(|s| s.contains("otlp-test")),
        "{service_names:?}"
    );
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let sent = spans
        .iter()
        .find(|s| s.name == "send-request")
        .expect("the sender's span");
    let handled = spans
        .iter()
        .find(|s| s.name == "handle-request")
        .expect("the receiver's span");
    assert_eq!(hex(&sent.trace_id), trace_id);
    assert_eq!(
        hex(&handled.trace_id),
        trace_id,
        "the trace continues across the request"
    );
    assert_eq!(hex(&handled.parent_span_id), parent_span_id);

    let logs: Vec<String> = find("/v1/logs")
        .iter()
        .flat_map(|e| {
            ExportLogsServiceRequest::decode(e.body.as_slice())
                .unwrap()
                .resource_logs
        })
        .flat_map(|r| r.scope_logs)
        .flat_map(|s| s.log_records)
        .map(|r| format!("{:?}", r.body))
        .collect();
    assert!(
        logs.iter().any(|l| l.contains("hello collector")),
        "{logs:?}"
    );

    let metric_names: Vec<String> = find("/v1/metrics")
        .iter()
        .flat_map(|e| {
            ExportMetricsServiceRequest::decode(e.body.as_slice())
                .unwrap()
                .resource_metrics
        })
        .flat_map(|r| r.scope_metrics)
        .flat_map(|s| s.metrics)
        .map(|m| format!("{} {:?}", m.name, m.data))
        .collect();
    let bytes = metric_names
        .iter()
        .find(|m| m.starts_with("hypha.network.bytes"))
        .expect("the bytes counter");
    assert!(
        bytes.contains("/test/proto/1") && bytes.contains("AsInt(42)"),
        "{bytes}"
    );
}
