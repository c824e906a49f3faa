//! Where telemetry goes, from the `telemetry_*` config keys and the standard `OTEL_*` variables.

/// The `telemetry_*` keys of a node's config, as written (seed format).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetryKeys {
    /// OTLP endpoint; for HTTP the base URL to which `/v1/traces` etc. are appended.
    pub endpoint: Option<String>,
    /// `key=value,key=value` headers sent with every export (for example authorisation).
    pub headers: Option<String>,
    /// `grpc` or `http/protobuf`.
    pub protocol: Option<String>,
    /// `key=value,…` resource attributes, such as `service.name=worker-01`.
    pub attributes: Option<String>,
    /// An OpenTelemetry sampler name: `always_on`, `always_off`, `traceidratio`,
    /// `parentbased_always_on`, `parentbased_always_off`, `parentbased_traceidratio`.
    pub sampler: Option<String>,
    /// The ratio for the `traceidratio` samplers, 0.0 to 1.0.
    pub sample_ratio: Option<f64>,
}

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

/// Trace sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
    ParentBasedAlwaysOn,
    ParentBasedAlwaysOff,
    ParentBasedTraceIdRatio(f64),
}

/// Resolved telemetry settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Where to export; `None` means console logging only.
    pub endpoint: Option<String>,
    pub protocol: Protocol,
    pub headers: Vec<(String, String)>,
    pub service_name: String,
    pub attributes: Vec<(String, String)>,
    pub sampler: Sampler,
}

/// A setting that could not be understood; names the key or variable it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {problem}")]
pub struct SettingsError {
    /// `telemetry_protocol`, `OTEL_EXPORTER_OTLP_PROTOCOL`, …
    pub source_name: String,
    pub problem: String,
}

impl Settings {
    /// Console logging only, nothing exported.
    pub fn console_only(service_name: &str) -> Self {
        Settings {
            endpoint: None,
            protocol: Protocol::HttpProtobuf,
            headers: Vec::new(),
            service_name: service_name.to_string(),
            attributes: Vec::new(),
            sampler: Sampler::ParentBasedAlwaysOn,
        }
    }

    /// Resolves settings from the config `keys`, letting the standard OpenTelemetry variables
    /// (looked up through `env`) take precedence key by key. `default_service_name` applies
    /// when neither names the service.
    pub fn resolve(
        keys: &TelemetryKeys,
        default_service_name: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let pick = |var: &str, key: &str, value: &Option<String>| -> Option<(String, String)> {
            env(var)
                .filter(|v| !v.trim().is_empty())
                .map(|v| (var.to_string(), v))
                .or_else(|| value.clone().map(|v| (key.to_string(), v)))
        };

        let endpoint = pick(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "telemetry_endpoint",
            &keys.endpoint,
        )
        .map(|(_, v)| v.trim().trim_end_matches('/').to_string())
        .filter(|v| !v.is_empty());

        let protocol = match pick(
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "telemetry_protocol",
            &keys.protocol,
        ) {
            None => Protocol::HttpProtobuf,
            Some((source, value)) => match value.trim() {
                "grpc" => Protocol::Grpc,
                "http/protobuf" | "http" => Protocol::HttpProtobuf,
                other => {
                    return Err(SettingsError {
                        source_name: source,
                        problem: format!(
                            "unknown protocol {other:?}; use \"grpc\" or \"http/protobuf\""
                        ),
                    });
                }
            },
        };

        let headers = match pick(
            "OTEL_EXPORTER_OTLP_HEADERS",
            "telemetry_headers",
            &keys.headers,
        ) {
            None => Vec::new(),
            Some((source, value)) => parse_pairs(&value, &source)?,
        };

        let mut attributes = match pick(
            "OTEL_RESOURCE_ATTRIBUTES",
            "telemetry_attributes",
            &keys.attributes,
        ) {
            None => Vec::new(),
            Some((source, value)) => parse_pairs(&value, &source)?,
        };
        let service_name = env("OTEL_SERVICE_NAME")
            .filter(|v| !v.trim().is_empty())
            .or_else(|| {
                attributes
                    .iter()
                    .find(|(k, _)| k == "service.name")
                    .map(|(_, v)| v.clone())
            })
            .unwrap_or_else(|| default_service_name.to_string());
        attributes.retain(|(k, _)| k != "service.name");

        let ratio = match env("OTEL_TRACES_SAMPLER_ARG").filter(|v| !v.trim().is_empty()) {
            Some(arg) => Some(arg.trim().parse::<f64>().map_err(|_| SettingsError {
                source_name: "OTEL_TRACES_SAMPLER_ARG".into(),
                problem: format!("{arg:?} is not a number; use a ratio between 0.0 and 1.0"),
            })?),
            None => keys.sample_ratio,
        };
        let ratio_source = if env("OTEL_TRACES_SAMPLER_ARG").is_some() {
            "OTEL_TRACES_SAMPLER_ARG"
        } else {
            "telemetry_sample_ratio"
        };
        if let Some(r) = ratio
            && !(0.0..=1.0).contains(&r)
        {
            return Err(SettingsError {
                source_name: ratio_source.into(),
                problem: format!("{r} is outside 0.0..=1.0"),
            });
        }
        let ratio = ratio.unwrap_or(1.0);
        let sampler = match pick("OTEL_TRACES_SAMPLER", "telemetry_sampler", &keys.sampler) {
            None => Sampler::ParentBasedAlwaysOn,
            Some((source, value)) => match value.trim() {
                "always_on" => Sampler::AlwaysOn,
                "always_off" => Sampler::AlwaysOff,
                "traceidratio" => Sampler::TraceIdRatio(ratio),
                "parentbased_always_on" => Sampler::ParentBasedAlwaysOn,
                "parentbased_always_off" => Sampler::ParentBasedAlwaysOff,
                "parentbased_traceidratio" => Sampler::ParentBasedTraceIdRatio(ratio),
                other => {
                    return Err(SettingsError {
                        source_name: source,
                        problem: format!(
                            "unknown sampler {other:?}; use always_on, always_off, traceidratio, \
                             parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
                        ),
                    });
                }
            },
        };

        Ok(Settings {
            endpoint,
            protocol,
            headers,
            service_name,
            attributes,
            sampler,
        })
    }

    /// The URL a signal (`traces`, `metrics`, `logs`) is exported to.
    pub(crate) fn signal_endpoint(&self, signal: &str) -> Option<String> {
        let base = self.endpoint.as_ref()?;
        Some(match self.protocol {
            Protocol::Grpc => base.clone(),
            Protocol::HttpProtobuf => format!("{base}/v1/{signal}"),
        })
    }
}

/// Parses `key=value,key=value` (values may contain `=`; whitespace around items is ignored).
fn parse_pairs(text: &str, source: &str) -> Result<Vec<(String, String)>, SettingsError> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| SettingsError {
                    source_name: source.to_string(),
                    problem: format!("{item:?} is not key=value; write pairs as k1=v1,k2=v2"),
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn keys() -> TelemetryKeys {
        TelemetryKeys {
            endpoint: Some("http://collector:4318/otlp/".into()),
            headers: Some("Authorization=Basic abc==".into()),
            protocol: Some("http/protobuf".into()),
            attributes: Some("service.name=worker-01,deployment.environment=prod".into()),
            sampler: Some("parentbased_traceidratio".into()),
            sample_ratio: Some(0.1),
        }
    }

    #[test]
    fn config_keys_apply_when_no_otel_variables_are_set() {
        let s = Settings::resolve(&keys(), "hypha-worker", |_| None).unwrap();
        assert_eq!(s.endpoint.as_deref(), Some("http://collector:4318/otlp"));
        assert_eq!(
            s.signal_endpoint("traces").as_deref(),
            Some("http://collector:4318/otlp/v1/traces")
        );
        assert_eq!(
            s.headers,
            vec![("Authorization".into(), "Basic abc==".into())]
        );
        assert_eq!(s.service_name, "worker-01");
        assert_eq!(
            s.attributes,
            vec![("deployment.environment".into(), "prod".into())]
        );
        assert_eq!(s.sampler, Sampler::ParentBasedTraceIdRatio(0.1));
    }

    #[test]
    fn otel_variables_take_precedence() {
        let env: HashMap<&str, &str> = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "from-env"),
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
        ]
        .into();
        let s = Settings::resolve(&keys(), "hypha-worker", |k| {
            env.get(k).map(|v| v.to_string())
        })
        .unwrap();
        assert_eq!(s.endpoint.as_deref(), Some("http://other:4317"));
        assert_eq!(s.protocol, Protocol::Grpc);
        assert_eq!(
            s.signal_endpoint("traces").as_deref(),
            Some("http://other:4317")
        );
        assert_eq!(s.service_name, "from-env");
        assert_eq!(s.sampler, Sampler::TraceIdRatio(0.5));
        // Keys without an OTEL_* counterpart set still come from the config.
        assert_eq!(s.headers.len(), 1);
    }

    #[test]
    fn errors_name_their_source() {
        let mut k = keys();
        k.protocol = Some("carrier-pigeon".into());
        let e = Settings::resolve(&k, "x", |_| None).unwrap_err();
        assert_eq!(e.source_name, "telemetry_protocol");
        let e = Settings::resolve(&keys(), "x", |k| {
            (k == "OTEL_TRACES_SAMPLER_ARG").then(|| "lots".into())
        })
        .unwrap_err();
        assert_eq!(e.source_name, "OTEL_TRACES_SAMPLER_ARG");
        k = keys();
        k.sample_ratio = Some(2.0);
        let e = Settings::resolve(&k, "x", |_| None).unwrap_err();
        assert_eq!(e.source_name, "telemetry_sample_ratio");
        k = keys();
        k.headers = Some("novalue".into());
        assert_eq!(
            Settings::resolve(&k, "x", |_| None)
                .unwrap_err()
                .source_name,
            "telemetry_headers"
        );
    }
}
