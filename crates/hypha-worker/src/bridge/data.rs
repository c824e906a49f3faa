//! Slices of the job's dataset, from the iteration its scheduler runs (`cluster_sync = true`).
//!
//! - `POST /resources/fetch` with `{"type": "Scheduler", "peer": …, "dataset": …}` (the
//!   `data` reference the scheduler puts in the job's config) asks the scheduler's ledger for
//!   the next slice, fetches it from a data node that holds it (verified against its BLAKE3,
//!   another provider on failure), decompresses it and answers one entry:
//!   `{out_dir}/e{epoch}-slice-{slice}.safetensors`, a plain SafeTensors file, with `epoch`,
//!   `slice` and `samples` in its metadata. An empty list means the iteration is done: every
//!   slice is used or held by jobs still running. While nothing is free the request waits,
//!   at most `wait_ms` when the request gives it (then: 503 `data_wait`).
//! - `POST /data/consumed` with `{"slices": [{"epoch": 0, "slice": 7}], "round": 3}` tells the
//!   ledger those slices' samples went into round 3; `"completed_round": 3` says round 3
//!   reached the model (for jobs without a parameter server). The answer lists `refused`
//!   slices, which the job held too long: another job has them now.
//!
//! - `POST /resources/fetch` with `{"type": "HeldOut", "dataset": …}` fetches every slice of
//!   a dataset held out of training (the job's `[data] eval`), straight from the data nodes
//!   that announce it, verified and decompressed as above, into
//!   `{out_dir}/heldout-{slice}.safetensors` with `slice` and `samples` in their metadata. A
//!   trainer scores global models on them; no ledger hears of them.
//!
//! Slices come through the job's [`Prefetcher`], which keeps the next ones verified, decoded
//! and fsynced in its staging directory under the worker's slice cache (outside every job's
//! directory, so an executor cannot redirect the worker's writes); handing one over is a
//! rename into the job's directory.

use std::{ffi::OsStr, path::Path};

use axum::http::StatusCode;
use hypha_bridge::{ConsumedAnswer, ConsumedRequest, Reference, SchedulerReference};
use hypha_data::iteration::AskError;
use hypha_messages::iterate::IterateRequest;
use hypha_network::PeerId;

use sha2::Digest;

use super::{Bridge, BridgeError, FileEntry, paths, timestamp};
use crate::slices::{Next, Prefetcher, Ready, Source};

/// The scheduler `reference` names.
fn scheduler_of(reference: &SchedulerReference) -> Result<PeerId, BridgeError> {
    reference.peer.parse().map_err(|e| {
        BridgeError::bad_request(format!(
            "\"peer\": {:?} is not a peer ID: {e}",
            reference.peer
        ))
    })
}

/// The slices `reference` names, as this job reads them.
fn source_of(reference: &SchedulerReference, bridge: &Bridge) -> Result<Source, BridgeError> {
    Ok(Source {
        scheduler: scheduler_of(reference)?,
        dataset: reference.dataset.clone(),
        iteration: bridge.context.task.clone(),
        consumer: bridge.context.job.clone(),
        epochs: reference.epochs,
        seed: reference.seed,
    })
}

/// An iterate request of this job for `reference`'s iteration, asking for `want` slices.
fn iterate_request(reference: &SchedulerReference, bridge: &Bridge, want: u32) -> IterateRequest {
    IterateRequest {
        iteration: bridge.context.task.clone(),
        dataset: reference.dataset.clone(),
        consumer: bridge.context.job.clone(),
        epochs: reference.epochs,
        seed: reference.seed,
        want,
        cached: Vec::new(),
        consumed: Vec::new(),
        round: 0,
        completed_round: None,
        holding: None,
        share_with: Vec::new(),
    }
}

async fn ask(
    bridge: &Bridge,
    scheduler: PeerId,
    request: IterateRequest,
) -> Result<hypha_messages::iterate::IterateGrant, BridgeError> {
    hypha_data::iteration::ask(&bridge.shared.network, scheduler, request)
        .await
        .map_err(|e| match e {
            AskError::Refused { message, .. } => {
                BridgeError::new(StatusCode::BAD_GATEWAY, "scheduler_refused", message)
            }
            other => BridgeError::new(
                StatusCode::BAD_GATEWAY,
                "scheduler_unreachable",
                format!("the job's scheduler {other}"),
            ),
        })
}

/// The next slice of the iteration into `out_dir`, or nothing when the iteration is done.
pub(super) async fn fetch(
    bridge: &Bridge,
    reference: SchedulerReference,
    out_dir: &Path,
    wait: Option<std::time::Duration>,
) -> Result<Vec<FileEntry>, BridgeError> {
    let source = source_of(&reference, bridge)?;
    let holding = bridge.holding(&source);
    let mut prefetchers = bridge.prefetchers.lock().await;
    let prefetcher = match prefetchers.entry(source.clone()) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => entry.insert(
            Prefetcher::start(
                bridge.shared.network.clone(),
                bridge.shared.cache.clone(),
                source,
                bridge.shared.prefetch_bytes,
                holding,
            )
            .map_err(|e| io_error(Path::new("the slice cache"), e))?,
        ),
    };
    // Waiting on the prefetcher's queue can be given up without losing a slice.
    let patience = async {
        match wait {
            Some(wait) => tokio::time::sleep(wait).await,
            None => std::future::pending().await,
        }
    };
    let next = tokio::select! {
        next = prefetcher.next() => next,
        _ = bridge.stopping.cancelled() => {
            return Err(BridgeError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "the job is ending"));
        }
        _ = patience => {
            return Err(BridgeError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "data_wait",
                "no slice is free now: the rest are held by running jobs; ask again later",
            ));
        }
    };
    drop(prefetchers);
    match next {
        Next::Slice(ready) => deliver(bridge, &reference.dataset, *ready, out_dir),
        Next::Finished => Ok(Vec::new()),
        Next::Failed(why) => Err(BridgeError::new(
            StatusCode::BAD_GATEWAY,
            "data_unavailable",
            why,
        )),
    }
}

/// Moves a prefetched slice into the job's directory.
fn deliver(
    bridge: &Bridge,
    dataset: &str,
    ready: Ready,
    out_dir: &Path,
) -> Result<Vec<FileEntry>, BridgeError> {
    let slice = ready.slice.clone();
    let name = format!("e{}-slice-{}.safetensors", slice.epoch, slice.slice);
    let relative = out_dir.join(&name);
    let parent = if out_dir.as_os_str().is_empty() {
        bridge.dir.create_dir_all(Path::new("."))?
    } else {
        bridge.dir.create_dir_all(out_dir)?
    };
    let provider = ready
        .provider
        .map_or_else(|| "cache".to_string(), |p| p.to_string());
    let (size, sha256) = (ready.size, ready.sha256.clone());
    ready
        .place(&parent, OsStr::new(&name))
        .map_err(|e| io_error(&relative, e))?;
    Ok(vec![FileEntry {
        path: relative.display().to_string(),
        size,
        checksum: format!("sha256:{sha256}"),
        metadata: [
            ("source", serde_json::Value::from("scheduler")),
            ("dataset", dataset.into()),
            ("epoch", slice.epoch.into()),
            ("slice", slice.slice.into()),
            ("samples", slice.samples.into()),
            ("provider", provider.into()),
            ("timestamp", timestamp().into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
    }])
}

/// The most bytes a held-out dataset may hold: every slice is fetched whenever a job asks, and
/// a trainer keeps them in memory to score each model on. A tenth of a large dataset belongs
/// in a held-out dataset of its own first slices, not whole.
pub const HELD_OUT_MAX_BYTES: u64 = 1 << 30;

/// Every slice of the held-out `dataset` into `out_dir`, in slice order, from the data nodes
/// that announce it: nothing is asked of the scheduler and no ledger records them.
pub(super) async fn held_out(
    bridge: &Bridge,
    dataset: &str,
    out_dir: &Path,
) -> Result<Vec<FileEntry>, BridgeError> {
    let unavailable =
        |message: String| BridgeError::new(StatusCode::BAD_GATEWAY, "data_unavailable", message);
    let client = hypha_data::DataClient::new(bridge.shared.network.clone());
    let providers = client.providers(dataset).await.map_err(|e| {
        unavailable(format!(
            "no data node announces the held-out dataset {dataset:?}: {e}"
        ))
    })?;
    let mut manifest = None;
    for peer in &providers {
        match client.manifest(*peer, dataset).await {
            Ok(found) => {
                manifest = Some(found);
                break;
            }
            Err(error) => {
                tracing::warn!(%peer, %error, dataset, "no held-out manifest from a data node")
            }
        }
    }
    let Some(manifest) = manifest else {
        return Err(unavailable(format!(
            "none of the {} data nodes announcing {dataset:?} sent its manifest",
            providers.len()
        )));
    };
    let bytes: u64 = manifest.slices.iter().map(|entry| entry.size).sum();
    if bytes > HELD_OUT_MAX_BYTES {
        return Err(BridgeError::bad_request(format!(
            "the held-out dataset {dataset:?} holds {bytes} bytes, more than the {HELD_OUT_MAX_BYTES} a job scores models on: hold out fewer slices"
        )));
    }
    let parent = if out_dir.as_os_str().is_empty() {
        bridge.dir.create_dir_all(Path::new("."))?
    } else {
        bridge.dir.create_dir_all(out_dir)?
    };
    let mut entries = Vec::with_capacity(manifest.slices.len());
    let mut buffer = Vec::new();
    for (slice, entry) in manifest.slices.iter().enumerate() {
        client
            .fetch_slice_to_vec(dataset, entry, &providers, &mut buffer)
            .await
            .map_err(|e| unavailable(format!("held-out slice {slice} of {dataset:?}: {e}")))?;
        let (_, plain) = hypha_dataset::slice::decode(&buffer).map_err(|e| {
            unavailable(format!(
                "held-out slice {slice} of {dataset:?} is not a slice: {e}"
            ))
        })?;
        let name = format!("heldout-{slice}.safetensors");
        let relative = out_dir.join(&name);
        let (mut file, temp) = paths::JobDir::create_temp(&parent, OsStr::new(&name))
            .map_err(|e| io_error(&relative, e))?;
        let written = std::io::Write::write_all(&mut file, &plain)
            .and_then(|()| file.sync_all())
            .and_then(|()| paths::JobDir::publish(&parent, &temp, OsStr::new(&name)));
        if let Err(e) = written {
            paths::JobDir::discard(&parent, &temp);
            return Err(io_error(&relative, e));
        }
        entries.push(FileEntry {
            path: relative.display().to_string(),
            size: plain.len() as u64,
            checksum: format!("sha256:{}", hex::encode(sha2::Sha256::digest(&plain))),
            metadata: [
                ("source", serde_json::Value::from("held_out")),
                ("dataset", dataset.into()),
                ("slice", slice.into()),
                ("samples", entry.samples.into()),
                ("timestamp", timestamp().into()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        });
    }
    Ok(entries)
}

/// `POST /data/consumed`.
pub(super) async fn consumed(
    bridge: &Bridge,
    request: ConsumedRequest,
) -> Result<ConsumedAnswer, BridgeError> {
    let Reference::Scheduler(reference) = request.data else {
        return Err(BridgeError::bad_request(
            "\"data\" must be the job's data reference, {\"type\": \"Scheduler\", …}, as its config gives it",
        ));
    };
    let source = source_of(&reference, bridge)?;
    let mut iterate = iterate_request(&reference, bridge, 0);
    iterate.consumed = request.slices.clone();
    iterate.round = request.round;
    iterate.completed_round = request.completed_round;
    let grant = ask(bridge, source.scheduler, iterate).await?;
    // Reported: no longer the job's to hold (refused ones are someone else's).
    bridge.holding(&source).let_go(&request.slices);
    Ok(ConsumedAnswer {
        refused: grant.refused,
    })
}

fn io_error(path: &Path, e: std::io::Error) -> BridgeError {
    BridgeError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "io",
        format!("{}: {e}", path.display()),
    )
}
