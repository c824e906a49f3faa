//! `hypha-certutil`: a small PKI for Hypha networks. All logic lives in `hypha-certs`.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use hypha_certs::{
    NodeIdentity, Role, Roles, TrustStore,
    authority::{self, Authority, Reason, Validity},
};
use hypha_files::{self as files, Mode};

/// Issue and inspect the certificates of a Hypha network.
///
/// A network trusts one root CA. The root signs organisation CAs; an organisation signs the
/// certificates of its nodes (gateways, data nodes, workers, schedulers). Every key is Ed25519
/// and a node's peer id is derived from its certificate's key.
///
/// A complete set-up:
///
///   hypha-certutil root --name "Example Root" --out certs
///   hypha-certutil org  --name example --ca certs/example-root-cert.pem --ca-key certs/example-root-key.pem --out certs
///   hypha-certutil node --name gateway-1 --role gateway --san localhost --ca certs/example-cert.pem --ca-key certs/example-key.pem --out certs
///
/// Nodes then use `cert_pem = "certs/gateway-1-cert.pem"`, `key_pem = "certs/gateway-1-key.pem"`
/// and `trust_pem = "certs/example-root-cert.pem"`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a self-signed root CA: writes NAME-cert.pem and NAME-key.pem (0600) into --out.
    Root {
        #[command(flatten)]
        new: NewCert,
    },
    /// Create an organisation CA signed by a root CA.
    Org {
        #[command(flatten)]
        new: NewCert,
        #[command(flatten)]
        ca: CaArgs,
    },
    /// Create a node certificate (Ed25519, server and client use) signed by an organisation CA.
    ///
    /// The certificate file holds the chain the node presents: its own certificate, then the
    /// organisation CA's.
    Node {
        #[command(flatten)]
        new: NewCert,
        #[command(flatten)]
        ca: CaArgs,
        /// A DNS name or IP address the node is known by; repeat for several.
        #[arg(long = "san", value_name = "NAME")]
        subject_alt_names: Vec<String>,
        /// What the node may do; repeat for several. Written into the certificate's subject
        /// as `OU=hypha:<roles>`. Peers refuse what a role grants to a node without it: only
        /// schedulers lease and dispatch, only workers offer and report on jobs, only data
        /// nodes are taken as dataset providers, only gateways relay, only operators hear a
        /// scheduler's run progress (with the run's own workers). Without any, the
        /// certificate is role-less: fine for a client that reads data or health, and accepted
        /// in every role only by nodes configured with `allow_roleless = true`.
        #[arg(long = "role", value_parser = role_parser())]
        roles: Vec<Role>,
    },
    /// Create a CA's revocation list, empty, or renew an existing one (the same entries, a new
    /// next-update date). Give every node the list from the start (`crls_pem`), so that
    /// revoking later is one `revoke` and a copy to each node, which reads it again within
    /// seconds; renew it before its next update, after which nodes refuse the peers it covers.
    Crl {
        #[command(flatten)]
        ca: CaArgs,
        /// The CRL file to create or renew; nodes list it in `crls_pem`.
        #[arg(long)]
        crl: PathBuf,
        /// Days until the CRL's "next update" date.
        #[arg(long, default_value_t = 365)]
        next_update_days: u32,
    },
    /// Add a certificate to its issuer's revocation list (created if absent, else updated).
    Revoke {
        #[command(flatten)]
        ca: CaArgs,
        /// The certificate to revoke.
        #[arg(long)]
        cert: PathBuf,
        /// The CRL file to create or update; nodes list it in `crls_pem`.
        #[arg(long)]
        crl: PathBuf,
        /// Why the certificate is revoked.
        #[arg(long, value_enum, default_value_t = ReasonArg::Unspecified)]
        reason: ReasonArg,
        /// Days until the CRL's "next update" date.
        #[arg(long, default_value_t = 365)]
        next_update_days: u32,
    },
    /// Describe certificates and CRLs: subject, issuer, validity, names, peer id, revoked serials.
    Inspect {
        /// PEM files to describe.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Check that a certificate chain is trusted, unexpired and not revoked; exit 1 if not.
    Verify {
        /// The node certificate chain to check.
        cert: PathBuf,
        /// The trusted root CA certificate(s).
        #[arg(long)]
        trust: PathBuf,
        /// A revocation list to honour.
        #[arg(long)]
        crl: Option<PathBuf>,
        /// Also check that this private key belongs to the certificate.
        #[arg(long)]
        key: Option<PathBuf>,
    },
}

#[derive(Debug, clap::Args)]
struct NewCert {
    /// The certificate's common name; also names the output files.
    #[arg(long)]
    name: String,
    /// The directory to write NAME-cert.pem and NAME-key.pem into.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// How many days the certificate is valid (default: root 3650, org 1825, node 365).
    #[arg(long)]
    days: Option<u32>,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
}

#[derive(Debug, clap::Args)]
struct CaArgs {
    /// The signing CA's certificate.
    #[arg(long = "ca", value_name = "CERT")]
    ca_cert: PathBuf,
    /// The signing CA's private key.
    #[arg(long = "ca-key", value_name = "KEY")]
    ca_key: PathBuf,
}

/// `--role`: every role the certificates know (`Role::ALL`), listed in `--help`.
fn role_parser() -> impl clap::builder::TypedValueParser<Value = Role> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Role::ALL.map(Role::name))
        .try_map(|name| name.parse::<Role>())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ReasonArg {
    Unspecified,
    KeyCompromise,
    Superseded,
    CessationOfOperation,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Root { new } => {
            let ca = authority::create_root(&new.name, validity(&new, 3650))?;
            write_pair(&new, &ca.cert_pem(), &ca.key_pem())?;
        }
        Command::Org { new, ca } => {
            let root = load_ca(&ca)?;
            let org = authority::create_org(&root, &new.name, validity(&new, 1825))?;
            write_pair(&new, &org.cert_pem(), &org.key_pem())?;
        }
        Command::Node {
            new,
            ca,
            subject_alt_names,
            roles,
        } => {
            let org = load_ca(&ca)?;
            let roles: Roles = roles.into_iter().collect();
            let node = authority::create_node(
                &org,
                &new.name,
                &subject_alt_names,
                roles,
                validity(&new, 365),
            )?;
            write_pair(&new, &node.chain_pem(), &node.key_pem())?;
            let identity =
                NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes())?;
            println!("peer id {}", identity.peer_id());
            if roles.is_empty() {
                println!(
                    "roles: none (role-less; give a node its roles with --role, e.g. --role worker)"
                );
            } else {
                println!("roles: {roles}");
            }
        }
        Command::Crl {
            ca,
            crl,
            next_update_days,
        } => {
            let issuer = load_ca(&ca)?;
            let existing = read_existing(&crl)?;
            let pem = authority::renew_crl(&issuer, existing.as_deref(), next_update_days)
                .with_context(|| format!("issuing {}", crl.display()))?;
            files::write_atomic(&crl, pem.as_bytes(), Mode::Public, true)?;
            println!("wrote {}", crl.display());
        }
        Command::Revoke {
            ca,
            cert,
            crl,
            reason,
            next_update_days,
        } => {
            let issuer = load_ca(&ca)?;
            let existing = read_existing(&crl)?;
            let reason = match reason {
                ReasonArg::Unspecified => Reason::Unspecified,
                ReasonArg::KeyCompromise => Reason::KeyCompromise,
                ReasonArg::Superseded => Reason::Superseded,
                ReasonArg::CessationOfOperation => Reason::CessationOfOperation,
            };
            let pem = authority::revoke(
                &issuer,
                existing.as_deref(),
                &files::read(&cert)?,
                reason,
                next_update_days,
            )
            .with_context(|| format!("revoking {}", cert.display()))?;
            files::write_atomic(&crl, pem.as_bytes(), Mode::Public, true)?;
            println!("wrote {}", crl.display());
        }
        Command::Inspect { files: paths } => {
            for path in paths {
                let text = hypha_certs::inspect::describe(
                    &files::read(&path)?,
                    &path.display().to_string(),
                )?;
                println!("{}:\n{text}", path.display());
            }
        }
        Command::Verify {
            cert,
            trust,
            crl,
            key,
        } => {
            let store = TrustStore::load(&trust, crl.as_deref())?;
            let chain = files::read(&cert)?;
            let identity = match &key {
                Some(key) => NodeIdentity::load(&cert, key)?,
                None => {
                    let certs =
                        hypha_certs::certificates_from_pem(&chain, &cert.display().to_string())?;
                    return Ok(report(store.verify_peer(&certs, hypha_certs::now()), &cert));
                }
            };
            return Ok(report(
                store.verify_peer(identity.chain(), hypha_certs::now()),
                &cert,
            ));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn report(
    result: Result<hypha_certs::VerifiedPeer, hypha_certs::Rejection>,
    cert: &Path,
) -> ExitCode {
    match result {
        Ok(peer) => {
            let roles = peer
                .roles
                .map_or_else(|| "none stated (role-less)".to_string(), |r| r.to_string());
            println!(
                "{}: trusted, peer id {}, roles: {roles}",
                cert.display(),
                peer.id
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{}: rejected: {e}", cert.display());
            ExitCode::FAILURE
        }
    }
}

fn validity(new: &NewCert, default_days: u32) -> Validity {
    Validity::days(new.days.unwrap_or(default_days))
}

/// The bytes of an existing CRL file; `None` when there is none yet.
fn read_existing(crl: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    match std::fs::read(crl) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", crl.display())),
    }
}

fn load_ca(ca: &CaArgs) -> anyhow::Result<Authority> {
    Authority::from_pem(&files::read(&ca.ca_cert)?, &files::read(&ca.ca_key)?).with_context(|| {
        format!(
            "loading the CA from {} and {}",
            ca.ca_cert.display(),
            ca.ca_key.display()
        )
    })
}

fn write_pair(new: &NewCert, cert_pem: &str, key_pem: &str) -> anyhow::Result<()> {
    let stem = file_stem(&new.name);
    let cert_path = new.out.join(format!("{stem}-cert.pem"));
    let key_path = new.out.join(format!("{stem}-key.pem"));
    // Check both before writing either, so a refused overwrite leaves nothing half-done.
    if !new.force {
        for path in [&cert_path, &key_path] {
            if path.exists() {
                anyhow::bail!(
                    "{} already exists; pass --force to overwrite it",
                    path.display()
                );
            }
        }
    }
    files::write_atomic(&key_path, key_pem.as_bytes(), Mode::Private, new.force)?;
    files::write_atomic(&cert_path, cert_pem.as_bytes(), Mode::Public, new.force)?;
    println!("wrote {}", cert_path.display());
    println!("wrote {} (private key, mode 0600)", key_path.display());
    Ok(())
}

/// A file-name-safe form of a certificate name: lower case, runs of anything but letters and
/// digits become one '-'.
fn file_stem(name: &str) -> String {
    let mut stem = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            stem.push(c.to_ascii_lowercase());
        } else if !stem.ends_with('-') {
            stem.push('-');
        }
    }
    let stem = stem.trim_matches('-');
    if stem.is_empty() {
        "cert".into()
    } else {
        stem.into()
    }
}
