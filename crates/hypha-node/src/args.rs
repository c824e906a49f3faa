use std::path::PathBuf;

use hypha_config::{Layers, Schema};

use crate::Error;

/// `init`: write a commented config file holding every key with its default.
#[derive(Debug, Clone, clap::Args)]
pub struct InitArgs {
    /// Where to write the config.
    #[arg(short, long, default_value = "config.toml")]
    pub output: PathBuf,
    /// Overwrite an existing file.
    #[arg(long)]
    pub force: bool,
}

/// `run`: start the node.
///
/// Settings come from the config file, then HYPHA_* environment variables (HYPHA_WORK_DIR,
/// nested keys with __ as in HYPHA_RESOURCES__CPU), then these flags.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The TOML config file (write one with `init`).
    #[arg(short, long)]
    pub config: PathBuf,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// Flags that override config keys.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// Listen on this multiaddr instead of listen_addresses (repeatable).
    #[arg(long = "listen", value_name = "MULTIADDR")]
    pub listen_addresses: Vec<String>,
    /// Join this gateway instead of gateway_addresses (repeatable).
    #[arg(long = "gateway", value_name = "MULTIADDR")]
    pub gateway_addresses: Vec<String>,
    /// Announce this external address instead of external_addresses (repeatable).
    #[arg(long = "external", value_name = "MULTIADDR")]
    pub external_addresses: Vec<String>,
    /// The node certificate chain (cert_pem).
    #[arg(long, value_name = "FILE")]
    pub cert_pem: Option<String>,
    /// The node private key (key_pem).
    #[arg(long, value_name = "FILE")]
    pub key_pem: Option<String>,
    /// The trusted CA certificate(s) (trust_pem).
    #[arg(long, value_name = "FILE")]
    pub trust_pem: Option<String>,
    /// The certificate revocation list(s) to honour (crls_pem; `hypha-certutil crl` makes
    /// an empty one to start with).
    #[arg(long, value_name = "FILE")]
    pub crls_pem: Option<String>,
    /// Set any key: `--set resources.cpu=8` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl Overrides {
    /// Applies the flags as the top layer.
    pub(crate) fn apply<'s>(
        &self,
        mut layers: Layers<'s>,
        schema: &Schema,
    ) -> Result<Layers<'s>, Error> {
        let has = |name: &str| schema.keys().iter().any(|k| k.name == name);
        for (key, values, flag) in [
            ("listen_addresses", &self.listen_addresses, "--listen"),
            ("gateway_addresses", &self.gateway_addresses, "--gateway"),
            ("external_addresses", &self.external_addresses, "--external"),
        ] {
            if !values.is_empty() && has(key) {
                layers = layers.flag_list(key, values, flag)?;
            }
        }
        for (key, value, flag) in [
            ("cert_pem", &self.cert_pem, "--cert-pem"),
            ("key_pem", &self.key_pem, "--key-pem"),
            ("trust_pem", &self.trust_pem, "--trust-pem"),
            ("crls_pem", &self.crls_pem, "--crls-pem"),
        ] {
            if let Some(value) = value {
                layers = layers.flag(key, value, flag)?;
            }
        }
        for item in &self.set {
            let Some((key, value)) = item.split_once('=') else {
                return Err(Error::BadInput(format!(
                    "flag --set {item}: expected KEY=VALUE, e.g. --set resources.cpu=8"
                )));
            };
            layers = layers.flag(key.trim(), value, &format!("--set {}", key.trim()))?;
        }
        Ok(layers)
    }
}

/// `probe`: check a node's health over the network with this node's certificate.
///
/// Exits 0 when the node answers healthy, 1 when it is unhealthy or unreachable, and 2 when
/// the probe's own certificate or arguments are wrong.
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    /// The node to check, e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...
    pub address: String,
    /// A config file to take cert_pem, key_pem, trust_pem and crls_pem from.
    #[arg(short, long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: Overrides,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 10)]
    pub timeout: u64,
}
