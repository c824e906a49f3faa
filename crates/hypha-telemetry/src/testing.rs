//! A minimal OTLP/HTTP collector for tests (feature `testing`): it accepts POSTs on 127.0.0.1,
//! records them and answers 200, so a test can check what a real node exported.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::{
    collector::metrics::v1::ExportMetricsServiceRequest, common::v1::any_value, metrics::v1,
};
use prost::Message;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// One POST the collector received.
#[derive(Debug, Clone)]
pub struct Export {
    pub path: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// One data point of a metric, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub metric: String,
    /// String-valued attributes.
    pub attributes: Vec<(String, String)>,
    pub value: f64,
}

/// A running collector; it serves until the runtime it was started on stops.
#[derive(Debug, Clone)]
pub struct Collector {
    pub port: u16,
    received: Arc<Mutex<Vec<Export>>>,
}

impl Collector {
    /// Starts listening on an ephemeral port of 127.0.0.1.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = received.clone();
        // Serves until the runtime it was started on stops: the collector is cloned freely,
        // so no one handle owns it; its connections are the loop's.
        tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((socket, _)) = listener.accept().await {
                while connections.try_join_next().is_some() {}
                connections.spawn(serve(socket, sink.clone()));
            }
        });
        Ok(Self { port, received })
    }

    /// `http://127.0.0.1:{port}`, for `telemetry_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Everything received so far.
    pub fn exports(&self) -> Vec<Export> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Every sum and gauge data point of every metrics export received so far.
    pub fn metric_points(&self) -> Vec<Point> {
        let mut points = Vec::new();
        for export in self.exports().iter().filter(|e| e.path == "/v1/metrics") {
            let Ok(request) = ExportMetricsServiceRequest::decode(export.body.as_slice()) else {
                continue;
            };
            for metric in request
                .resource_metrics
                .iter()
                .flat_map(|r| &r.scope_metrics)
                .flat_map(|s| &s.metrics)
            {
                let data_points = match &metric.data {
                    Some(v1::metric::Data::Sum(sum)) => &sum.data_points,
                    Some(v1::metric::Data::Gauge(gauge)) => &gauge.data_points,
                    _ => continue,
                };
                for point in data_points {
                    let value = match point.value {
                        Some(v1::number_data_point::Value::AsInt(v)) => v as f64,
                        Some(v1::number_data_point::Value::AsDouble(v)) => v,
                        None => continue,
                    };
                    let attributes = point
                        .attributes
                        .iter()
                        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                            any_value::Value::StringValue(s) => Some((kv.key.clone(), s.clone())),
                            _ => None,
                        })
                        .collect();
                    points.push(Point {
                        metric: metric.name.clone(),
                        attributes,
                        value,
                    });
                }
            }
        }
        points
    }
}

async fn serve(socket: tokio::net::TcpStream, sink: Arc<Mutex<Vec<Export>>>) {
    let mut reader = BufReader::new(socket);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).await.unwrap_or(0) == 0 {
            return;
        }
        let path = request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .to_string();
        let mut headers = Vec::new();
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
                if k == "content-length" {
                    length = v.parse().unwrap_or(0);
                }
                headers.push((k, v));
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        if let Ok(mut received) = sink.lock() {
            received.push(Export {
                path,
                headers,
                body,
            });
        }
        if reader
            .get_mut()
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
    }
}
