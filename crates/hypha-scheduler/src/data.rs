//! A job's data with `cluster_sync = true`: the scheduler finds the dataset's data nodes,
//! learns which slices each holds (each may hold all of them or a shard), and runs the
//! iteration's ledger, which hands every slice of every epoch to exactly one job.
//!
//! Workers ask through the job bridge's `Scheduler` reference; each grant names the data
//! nodes that hold the slice, rotated so replicas share the load. Slices of a job that ends,
//! fails or loses its worker go back to the ledger ([`JobData::release`]).

use std::{collections::HashMap, path::Path, time::Duration};

use hypha_data::{
    DataClient,
    iteration::{IterationService, LEASE_MS, SliceSource, spec_of},
};
use hypha_dataset::{Manifest, SliceEntry, slice_order};
use hypha_ledger::{Ledger, LedgerHandle};
use hypha_network::{Network, PeerId};

use crate::{event::Event, spec::DataSpec, unix_ms};

/// How long a scheduler looks for the dataset's providers before giving up.
const PROVIDER_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("no data node announces {dataset:?} (looked for {}s): {detail}", PROVIDER_WAIT.as_secs())]
    NoProviders {
        dataset: String,
        detail: Box<hypha_data::FetchError>,
    },
    #[error("none of the {count} data nodes announcing {dataset:?} sent its manifest")]
    NoManifest { dataset: String, count: usize },
    /// What of the dataset does not fit the job (`JobFile::check_dataset`), with the fix.
    #[error("the job cannot train on {dataset:?}: {message}")]
    Misfit { dataset: String, message: String },
    #[error("the ledger at {path}: {error}")]
    Ledger {
        path: String,
        error: hypha_ledger::Error,
    },
}

/// What a resumed run carries over into its iteration.
#[derive(Debug, Default)]
pub struct CarriedOver {
    /// Rounds (peer, job, round) in the model the run continues from: their slices are used.
    pub committed: Vec<(PeerId, String, u64)>,
    /// Jobs (peer, job) of the earlier run that the run may take over still running, or
    /// whose rounds may still reach the model: they keep the slices they fetched ahead and
    /// those they consumed into rounds from `open_from` on (and give them back if they are
    /// not taken over, or those rounds are lost).
    pub going_on: Vec<(PeerId, String)>,
    /// The first round not in the checkpoint the run continues from.
    pub open_from: u64,
    /// The data nodes the earlier run took the dataset from: asked first, before the DHT.
    pub data_nodes: Vec<PeerId>,
}

/// The iteration a job runs.
#[derive(Debug, Clone)]
pub struct JobData {
    service: IterationService,
    /// The data nodes whose manifests make the iteration.
    data_nodes: Vec<PeerId>,
    /// What executors hand `/resources/fetch` for their next slice.
    reference: serde_json::Value,
    /// The [`Event::DataReady`] the run starts with.
    ready: Event,
}

impl JobData {
    /// Finds the dataset, checks its manifest with `fits` (the job's model against the
    /// slices' tensors), then opens (or resumes) the ledger at `ledger` for iteration `task`.
    /// A resumed run's committed rounds become used before what the earlier run's jobs held
    /// goes back (except what jobs that may go on fetched ahead).
    pub async fn start(
        network: &Network,
        spec: &DataSpec,
        ledger: &Path,
        task: &str,
        carried: &CarriedOver,
        fits: impl Fn(&Manifest) -> Result<(), String>,
    ) -> Result<Self, DataError> {
        let client = DataClient::new(network.clone());
        let (manifests, sources, manifest) =
            find(&client, &spec.dataset, &carried.data_nodes).await?;
        let misfit = |dataset: &str, message| DataError::Misfit {
            dataset: dataset.to_string(),
            message,
        };
        fits(&manifest).map_err(|message| misfit(&spec.dataset, message))?;
        if let Some(eval) = &spec.eval {
            // Trainers fetch the held-out slices themselves; the run starts only once it
            // knows they are there and fit the model, rather than fail its first scoring.
            let (_, _, held_out) = find(&client, eval, &carried.data_nodes).await?;
            fits(&held_out).map_err(|message| misfit(eval, message))?;
        }
        let iteration = spec_of(&manifest, spec.epochs, spec.seed);
        let path = ledger.to_path_buf();
        let open_from = carried.open_from;
        let committed: Vec<(String, u64)> = carried
            .committed
            .iter()
            .map(|(peer, job, round)| (IterationService::consumer_name(peer, job), *round))
            .collect();
        let going_on: Vec<String> = carried
            .going_on
            .iter()
            .map(|(peer, job)| IterationService::consumer_name(peer, job))
            .collect();
        let opened = tokio::task::spawn_blocking(move || {
            let mut ledger = Ledger::open_or_create(&path, iteration, LEASE_MS, unix_ms())?;
            for (consumer, round) in &committed {
                ledger.commit_round(consumer, *round, unix_ms());
            }
            // A resumed iteration's holders were jobs of an earlier run of this scheduler:
            // what they consumed into rounds not in the model goes back, and what they were
            // assigned, unless the job may go on (with a parameter server that may).
            let returned = ledger.release_all(&going_on, open_from, unix_ms());
            ledger.flush()?;
            if returned > 0 {
                tracing::info!(
                    returned,
                    "slices held by the previous run are available again"
                );
            }
            Ok(ledger)
        })
        .await
        .map_err(|_| hypha_ledger::Error::Stopped)
        .and_then(|r| r)
        .map_err(|error| DataError::Ledger {
            path: ledger.display().to_string(),
            error,
        })?;
        let progress = opened.progress(unix_ms());
        let ready = Event::DataReady {
            dataset: spec.dataset.clone(),
            slices: manifest.slices.len(),
            data_nodes: manifests.len(),
            used: progress.epochs.iter().map(|e| e.used).sum::<u64>(),
            ledger: ledger.display().to_string(),
        };
        let (handle, _task) = LedgerHandle::spawn(opened);
        let reference = serde_json::json!({
            "type": "Scheduler",
            "peer": network.local_peer_id().to_string(),
            "dataset": spec.dataset,
            "epochs": spec.epochs,
            "seed": spec.seed,
        });
        Ok(Self {
            service: IterationService::new(task.to_string(), handle, sources, false),
            data_nodes: manifests.iter().map(|(peer, _)| *peer).collect(),
            reference,
            ready,
        })
    }

    /// The data found and the iteration opened, for the run's events.
    pub fn ready(&self) -> &Event {
        &self.ready
    }

    /// The data nodes the iteration takes its slices from, for the run's record.
    pub fn data_nodes(&self) -> &[PeerId] {
        &self.data_nodes
    }

    /// The most samples any slice of the dataset holds.
    pub fn largest_slice(&self) -> u64 {
        self.ledger()
            .spec()
            .samples
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    pub fn service(&self) -> &IterationService {
        &self.service
    }

    pub fn reference(&self) -> &serde_json::Value {
        &self.reference
    }

    pub fn ledger(&self) -> &LedgerHandle {
        self.service.ledger()
    }

    /// Job `job` on `peer` has ended or is gone: what it held and did not see used goes back.
    pub async fn release(&self, peer: &PeerId, job: &str) {
        let consumer = IterationService::consumer_name(peer, job);
        match self.ledger().release_worker(&consumer).await {
            Ok(0) => {}
            Ok(returned) => {
                tracing::info!(%job, returned, "slices of an ended job are available again")
            }
            Err(error) => tracing::warn!(%job, %error, "could not return an ended job's slices"),
        }
    }

    /// Job `job` on `peer` ended with rounds not settled yet: the slices it fetched ahead go
    /// back now, those of its rounds when they are settled.
    pub async fn release_assigned(&self, peer: &PeerId, job: &str) {
        let consumer = IterationService::consumer_name(peer, job);
        match self.ledger().release_assigned(&consumer).await {
            Ok(0) => {}
            Ok(returned) => {
                tracing::info!(%job, returned, "slices an ended job fetched ahead are available again")
            }
            Err(error) => tracing::warn!(%job, %error, "could not return an ended job's slices"),
        }
    }

    /// Round `round` of job `job` on `peer` reached the model (`commit`: its slices are
    /// used) or was left out (its slices are available again).
    pub async fn settle_round(
        &self,
        peer: &PeerId,
        job: &str,
        round: u64,
        commit: bool,
    ) -> Result<(), hypha_ledger::Error> {
        let consumer = IterationService::consumer_name(peer, job);
        let ledger = self.ledger();
        let slices = if commit {
            ledger.commit_round(&consumer, round).await?
        } else {
            ledger.drop_round(&consumer, round).await?
        };
        if !commit && !slices.is_empty() {
            tracing::info!(%job, round, returned = slices.len(), "a round left out: its slices are available again");
        }
        Ok(())
    }

    /// Whether the ledger has nothing more to hand out: no slice available, none handed out
    /// and not yet consumed (one that comes back, from a round left out or a worker lost,
    /// makes it so again).
    pub async fn drained(&self) -> bool {
        self.ledger().progress().await.is_ok_and(|progress| {
            progress
                .epochs
                .iter()
                .all(|epoch| epoch.available == 0 && epoch.assigned == 0)
        })
    }

    /// Every slice of every epoch is used.
    pub async fn finished(&self) -> bool {
        self.ledger()
            .progress()
            .await
            .is_ok_and(|progress| progress.finished)
    }
}

/// The slices to iterate and who holds each: every slice file any data node lists, in
/// numeric file order, with the nodes that hold that file with the same hash. Replicas (nodes
/// with every slice) and shards (nodes with some) both work, since slices are matched by file
/// name, not by the number each node gives them. A node whose copy of a file has another hash
/// than the first node's that listed it is not used for that slice.
/// The manifests of `dataset` from the data nodes that hold it, merged. A resumed run asks
/// the data nodes it used (`known`) first: a restarted node's DHT may take seconds to answer
/// a provider lookup (10 s at times in `hypha-bench recovery`), while the nodes are reached
/// through the gateway at once.
async fn find(
    client: &DataClient,
    dataset: &str,
    known: &[PeerId],
) -> Result<(Vec<(PeerId, Manifest)>, Vec<SliceSource>, Manifest), DataError> {
    let mut manifests = manifests_of(client, dataset, known).await;
    let mut providers = known.to_vec();
    if manifests.is_empty() {
        let deadline = tokio::time::Instant::now() + PROVIDER_WAIT;
        providers = loop {
            match client.providers(dataset).await {
                Ok(providers) => break providers,
                Err(error) if tokio::time::Instant::now() >= deadline => {
                    return Err(DataError::NoProviders {
                        dataset: dataset.to_string(),
                        detail: Box::new(error),
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        manifests = manifests_of(client, dataset, &providers).await;
    }
    let Some((sources, manifest)) = merge(dataset, &manifests) else {
        return Err(DataError::NoManifest {
            dataset: dataset.to_string(),
            count: providers.len(),
        });
    };
    Ok((manifests, sources, manifest))
}

/// The manifests of `dataset` that `peers` send; a node that sends none is left out, with a
/// warning.
async fn manifests_of(
    client: &DataClient,
    dataset: &str,
    peers: &[PeerId],
) -> Vec<(PeerId, Manifest)> {
    let mut manifests = Vec::new();
    for peer in peers {
        match client.manifest(*peer, dataset).await {
            Ok(manifest) => manifests.push((*peer, manifest)),
            Err(error) => {
                tracing::warn!(%peer, %error, "a data node did not send its manifest; not using it")
            }
        }
    }
    manifests
}

fn merge(dataset: &str, manifests: &[(PeerId, Manifest)]) -> Option<(Vec<SliceSource>, Manifest)> {
    let (_, first) = manifests.first()?;
    let mut by_file: HashMap<&str, (&SliceEntry, Vec<PeerId>)> = HashMap::new();
    for (peer, manifest) in manifests {
        for entry in &manifest.slices {
            match by_file.get_mut(entry.file.as_str()) {
                None => {
                    by_file.insert(&entry.file, (entry, vec![*peer]));
                }
                Some((known, holders)) if known.blake3 == entry.blake3 => holders.push(*peer),
                Some(_) => tracing::warn!(
                    %peer,
                    file = %entry.file,
                    "a data node's copy of a slice differs from another's; not fetching it there"
                ),
            }
        }
    }
    let mut files: Vec<(&str, (&SliceEntry, Vec<PeerId>))> = by_file.into_iter().collect();
    files.sort_by(|a, b| slice_order(a.0, b.0));
    let sources = files
        .iter()
        .map(|(file, (entry, holders))| SliceSource {
            file: (*file).to_string(),
            size: entry.size,
            blake3: entry.blake3.clone(),
            providers: holders.clone(),
        })
        .collect();
    let merged = Manifest {
        format: first.format.clone(),
        name: dataset.to_string(),
        slices: files
            .iter()
            .enumerate()
            .map(|(index, (_, (entry, _)))| SliceEntry {
                index: index as u64,
                ..(*entry).clone()
            })
            .collect(),
    };
    Some((sources, merged))
}
