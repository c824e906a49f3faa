//! Revocation that takes effect while a node runs.
//!
//! The trust store (`trust_pem` and `crls_pem`) is read again when either file changes on disk
//! (checked every [`CHECK_EVERY`]; a CRL written by `hypha-certutil crl` or `revoke` is replaced by a
//! rename, which this sees) and when the process gets SIGHUP. The new store is put in force for
//! every later handshake, and connected peers it refuses are disconnected
//! ([`Network::replace_trust`]). A file that does not load (half copied, malformed) is named in
//! a warning and the store in force stays; the next change is tried again.
//!
//! A CRL past its next update is named in a warning when it is loaded stale and when it goes
//! stale while in force; what peers it covers get then is `stale_crl`'s choice (see
//! [`StaleCrl`]).

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use hypha_certs::{CrlDeadlines, StaleCrl, TrustStore};
use hypha_network::Network;

/// How often the files are looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// How long before a CRL's next update the node starts warning that it is due.
pub const RENEW_WITHIN: Duration = Duration::from_secs(30 * 24 * 3600);

/// What identifies one version of a file: a rewrite in place changes the time or length, a
/// replacement by rename the inode.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: metadata.modified().ok(),
        len: metadata.len(),
        inode: metadata.ino(),
    })
}

/// The trust store's files, and what they were when last loaded.
#[derive(Debug)]
pub(crate) struct TrustFiles {
    trust_pem: PathBuf,
    crls_pem: Option<PathBuf>,
    stale_crl: StaleCrl,
    loaded: Vec<Option<Stamp>>,
    /// When the CRLs of the store in force go stale.
    in_force: CrlDeadlines,
    /// Those of them already warned about.
    stale: Vec<String>,
    /// Those due for renewal already warned about.
    due: Vec<String>,
}

impl TrustFiles {
    /// The files as they are now, taken to be the ones the node started with.
    pub(crate) fn new(trust_pem: PathBuf, crls_pem: Option<PathBuf>, stale_crl: StaleCrl) -> Self {
        let mut files = TrustFiles {
            trust_pem,
            crls_pem,
            stale_crl,
            loaded: Vec::new(),
            in_force: CrlDeadlines::default(),
            stale: Vec::new(),
            due: Vec::new(),
        };
        files.loaded = files.stamps();
        files
    }

    fn stamps(&self) -> Vec<Option<Stamp>> {
        std::iter::once(&self.trust_pem)
            .chain(self.crls_pem.as_ref())
            .map(|p| stamp(p))
            .collect()
    }

    /// Whether a file changed since it was last loaded (or tried).
    fn changed(&self) -> bool {
        self.stamps() != self.loaded
    }

    fn load(&mut self) -> Result<TrustStore, hypha_certs::Error> {
        self.loaded = self.stamps();
        TrustStore::load(&self.trust_pem, self.crls_pem.as_deref())
            .map(|store| store.with_stale_crl(self.stale_crl))
    }

    /// `store` is in force now: warns about its CRLs that are past their next update.
    pub(crate) fn in_force(&mut self, store: &TrustStore) {
        self.in_force = store.crl_deadlines().clone();
        self.stale.clear();
        self.due.clear();
        self.warn_if_stale();
    }

    /// Warns about the CRLs in force that are past their next update now, or will be within
    /// [`RENEW_WITHIN`], and were not warned about yet.
    fn warn_if_stale(&mut self) {
        let due = self.in_force.due_within(hypha_certs::now(), RENEW_WITHIN);
        for crl in due.iter().filter(|crl| !self.due.contains(crl)) {
            tracing::warn!(
                "{crl}: renew it before then (`hypha-certutil crl`) and copy it to every node, or peers it covers are refused from that day"
            );
        }
        self.due = due;
        let stale = self.in_force.stale(hypha_certs::now());
        for crl in stale.iter().filter(|crl| !self.stale.contains(crl)) {
            match self.stale_crl {
                StaleCrl::Refuse => tracing::warn!(
                    "{crl}: peers whose certificates it covers are refused until it is renewed (`hypha-certutil crl`, then put it in crls_pem); stale_crl = \"warn\" accepts them meanwhile"
                ),
                StaleCrl::Warn => tracing::warn!(
                    "{crl}: peers are checked against it and accepted (stale_crl = \"warn\"); renew it with `hypha-certutil crl`"
                ),
            }
        }
        self.stale = stale;
    }

    /// Watches the files until the network shuts down; see the module's documentation.
    pub(crate) async fn watch(mut self, network: Network) {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangup = signal(SignalKind::hangup())
            .inspect_err(|error| tracing::debug!(%error, "cannot listen for SIGHUP; the files are still watched"))
            .ok();
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let asked = tokio::select! {
                _ = tick.tick() => false,
                Some(()) = async {
                    match &mut hangup {
                        Some(hangup) => hangup.recv().await,
                        None => std::future::pending().await,
                    }
                } => true,
            };
            self.warn_if_stale();
            if !asked && !self.changed() {
                continue;
            }
            let store = match self.load() {
                Ok(store) => store,
                Err(error) => {
                    tracing::warn!(%error, "cannot reload the trust store; the one in force stays");
                    continue;
                }
            };
            self.in_force(&store);
            let Ok(closed) = network.replace_trust(store).await else {
                return; // the network has shut down
            };
            tracing::info!(
                disconnected = closed.len(),
                reason = if asked { "SIGHUP" } else { "a file changed" },
                "trust store reloaded"
            );
        }
    }
}
