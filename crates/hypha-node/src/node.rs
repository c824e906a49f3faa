use std::{path::Path, sync::Arc};

use hypha_certs::{NodeIdentity, Role, TrustStore};
use hypha_config::{Layers, Loaded, Schema, network::NetworkConfig, telemetry::TelemetryConfig};
use hypha_files::{Mode, write_atomic};
use hypha_network::{InboundRequest, Network, Settings};
use tokio::sync::mpsc;

use crate::{
    Error,
    args::{InitArgs, Overrides, RunArgs},
    trust_reload::TrustFiles,
};

/// A started node: its settings, network handle and inbound requests.
#[derive(Debug)]
pub struct Node {
    pub network: Network,
    /// Requests from peers for the node to answer (health is answered by the network).
    pub inbound: mpsc::Receiver<InboundRequest>,
    pub config: Loaded,
    pub network_config: NetworkConfig,
    _telemetry: hypha_telemetry::Guard,
    /// Reloads the trust store when its files change (or on SIGHUP), while the node lives.
    _trust_reload: tokio::task::JoinSet<()>,
}

impl Node {
    /// Loads the config of `args`, sets up telemetry (service name `hypha-<kind>` unless
    /// configured), loads the certificate and trust store, and starts the network.
    /// `adjust` sees the network settings last, for what only the node kind decides.
    pub async fn start(
        kind: &str,
        schema: &Schema,
        args: &RunArgs,
        adjust: impl FnOnce(&mut Settings),
    ) -> Result<Node, Error> {
        Self::start_with(kind, load_run_config(schema, args)?, adjust).await
    }

    /// [`start`](Self::start) with a config already loaded by [`load_run_config`], for nodes
    /// that check their own settings before joining the network.
    pub async fn start_with(
        kind: &str,
        config: Loaded,
        adjust: impl FnOnce(&mut Settings),
    ) -> Result<Node, Error> {
        let network_config = NetworkConfig::from_loaded(&config)?;
        let telemetry = telemetry_settings(&config, kind)?;
        // Taken before the files are read, so that a change while they are read is seen.
        let mut trust_files = TrustFiles::new(
            network_config.trust_pem.clone(),
            network_config.crls_pem.clone(),
            stale_crl(&network_config),
        );
        let (identity, trust) = load_identity(&config, &network_config)?;

        let guard = hypha_telemetry::init(&telemetry)
            .map_err(|e| Error::BadInput(format!("telemetry: {e}")))?;
        for ignored in config.ignored_variables() {
            match ignored.closest {
                Some(_) => tracing::warn!("{ignored}"),
                None => tracing::debug!("{ignored}"),
            }
        }
        check_own_role(&config, &identity, kind)?;
        trust_files.in_force(&trust);

        let mut settings = Settings::new(kind);
        settings.listen_addresses = network_config.listen_addresses.clone();
        settings.external_addresses = network_config.external_addresses.clone();
        settings.gateway_addresses = network_config.gateway_addresses.clone();
        settings.exclude_cidr = network_config.exclude_cidr.clone();
        settings.relay_circuit = network_config.relay_circuit;
        settings.allow_roleless = network_config.allow_roleless;
        // Each kind of node says when it is ready (`Network::set_health`).
        settings.healthy_at_start = false;
        adjust(&mut settings);

        let (network, inbound) = hypha_network::start(settings, &identity, trust)
            .await
            .map_err(|e| Error::Failed(e.to_string()))?;
        tracing::info!(peer_id = %network.local_peer_id(), kind, "node started");
        let mut trust_reload = tokio::task::JoinSet::new();
        trust_reload.spawn(trust_files.watch(network.clone()));
        Ok(Node {
            network,
            inbound,
            config,
            network_config,
            _telemetry: guard,
            _trust_reload: trust_reload,
        })
    }
}

/// Loads the config of a `run` command.
pub fn load_run_config(schema: &Schema, args: &RunArgs) -> Result<Loaded, Error> {
    load(schema, Some(&args.config), &args.overrides)
}

/// Loads the layered config: schema defaults, the file, `HYPHA_*` variables, then flags.
pub(crate) fn load(
    schema: &Schema,
    file: Option<&Path>,
    overrides: &Overrides,
) -> Result<Loaded, Error> {
    let mut layers = Layers::new(schema);
    if let Some(file) = file {
        layers = layers.file(file)?;
    }
    layers = layers.env(std::env::vars())?;
    layers = overrides.apply(layers, schema)?;
    Ok(layers.load()?)
}

/// Loads the node's certificate, key and trust store, naming the config key of any bad file.
pub(crate) fn load_identity(
    config: &Loaded,
    network: &NetworkConfig,
) -> Result<(NodeIdentity, Arc<TrustStore>), Error> {
    let identity = NodeIdentity::load(&network.cert_pem, &network.key_pem).map_err(|e| {
        let key = match &e {
            hypha_certs::Error::File(hypha_files::Error::Read { path, .. })
                if *path == network.key_pem =>
            {
                "key_pem"
            }
            hypha_certs::Error::Malformed { what, .. }
                if *what == network.key_pem.display().to_string() =>
            {
                "key_pem"
            }
            hypha_certs::Error::KeyMismatch { .. } => "key_pem",
            _ => "cert_pem",
        };
        config.error(
            key,
            e.to_string(),
            "point cert_pem and key_pem at a certificate and key made together by `hypha-certutil node`",
        )
    })?;
    let trust = TrustStore::load(&network.trust_pem, network.crls_pem.as_deref())
        .map(|store| store.with_stale_crl(stale_crl(network)))
        .map_err(|e| {
        let key = match &e {
            hypha_certs::Error::File(hypha_files::Error::Read { path, .. })
                if Some(path.as_path()) == network.crls_pem.as_deref() =>
            {
                "crls_pem"
            }
            hypha_certs::Error::Malformed { what, .. }
                if network
                    .crls_pem
                    .as_ref()
                    .is_some_and(|c| *what == c.display().to_string()) =>
            {
                "crls_pem"
            }
            _ => "trust_pem",
        };
        config.error(
            key,
            e.to_string(),
            "point trust_pem at the root CA certificate (and crls_pem at CRLs made by `hypha-certutil crl` or `revoke`)",
        )
    })?;
    Ok((identity, Arc::new(trust)))
}

/// The trust store's policy for CRLs past their next update, as `stale_crl` says.
pub(crate) fn stale_crl(network: &NetworkConfig) -> hypha_certs::StaleCrl {
    match network.stale_crl {
        hypha_config::network::StaleCrl::Refuse => hypha_certs::StaleCrl::Refuse,
        hypha_config::network::StaleCrl::Warn => hypha_certs::StaleCrl::Warn,
    }
}

/// Refuses to start a node of `kind` whose certificate states roles without that one: every
/// peer would refuse what it is there to do. A role-less certificate starts, with a warning.
fn check_own_role(config: &Loaded, identity: &NodeIdentity, kind: &str) -> Result<(), Error> {
    let Ok(role) = kind.parse::<Role>() else {
        return Ok(());
    };
    match identity.roles() {
        Some(roles) if roles.contains(role) => Ok(()),
        Some(roles) => Err(config.error(
            "cert_pem",
            format!("the certificate grants {roles}, not the {role} role this node needs"),
            format!("issue this node's certificate with `hypha-certutil node --role {role}` (repeat --role for several)"),
        ).into()),
        None => {
            tracing::warn!(
                "this node's certificate states no role; peers accept it as a {role} only if they set allow_roleless = true (issue it with `hypha-certutil node --role {role}`)"
            );
            Ok(())
        }
    }
}

fn telemetry_settings(config: &Loaded, kind: &str) -> Result<hypha_telemetry::Settings, Error> {
    let keys: TelemetryConfig = config.section()?;
    let keys = hypha_telemetry::TelemetryKeys {
        endpoint: keys.telemetry_endpoint,
        headers: keys.telemetry_headers,
        protocol: keys.telemetry_protocol,
        attributes: keys.telemetry_attributes,
        sampler: keys.telemetry_sampler,
        sample_ratio: keys.telemetry_sample_ratio,
    };
    hypha_telemetry::Settings::resolve(&keys, &format!("hypha-{kind}"), |k| std::env::var(k).ok())
        .map_err(|e| {
            if e.source_name.starts_with("OTEL_") {
                Error::BadInput(format!("environment variable {e}"))
            } else {
                Error::BadInput(
                    config
                        .error(
                            &e.source_name,
                            e.problem,
                            "see the comment above the key in `init`'s output",
                        )
                        .to_string(),
                )
            }
        })
}

/// Writes the commented config template of `schema`.
pub fn init(schema: &Schema, args: &InitArgs) -> Result<(), Error> {
    write_atomic(
        &args.output,
        schema.template().as_bytes(),
        Mode::Public,
        args.force,
    )
    .map_err(|e| match e {
        hypha_files::Error::Exists { .. } => Error::BadInput(e.to_string()),
        other => Error::Failed(other.to_string()),
    })?;
    println!("wrote {}", args.output.display());
    Ok(())
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
