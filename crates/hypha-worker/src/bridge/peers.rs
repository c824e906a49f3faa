//! Resources between the jobs of a task, as executors see them: `POST /resources/send`,
//! `POST /resources/receive` (Server-Sent Events) and `POST /resources/fetch` with
//! `{"type": "Peers"}`. The wire protocol and the inboxes are in [`transfer`](super::transfer).
//!
//! Strategies, for sending: `All` sends to every listed peer at once and succeeds only when
//! all took the file; `One` tries the peers in the order given until one takes it; `Random`
//! does the same in a random order. For receiving, `All` streams every file from the listed
//! peers (from anyone when the list is empty) until the client hangs up or the job ends, while
//! `One` and `Random` end the stream after the first file. For fetching, `All` with a
//! non-empty list waits for one file from each listed peer; otherwise it waits for the first
//! file from any of them. With `"wait_ms"` beside `fetch`, a fetch waits at most that long and
//! answers with the files that arrived by then: `[]` when none did.

use std::{
    collections::{BTreeMap, HashSet},
    convert::Infallible,
    path::PathBuf,
    sync::Arc,
};

use axum::{
    http::{StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
};
use futures::Stream;
use hypha_bridge::{
    Peers, ReceiveEvent, ReceiveRequest, SendRequest, Strategy, StreamError, Target,
};
use hypha_network::PeerId;
use rand::seq::SliceRandom;

use super::{
    Bridge, BridgeError, FileEntry, paths, timestamp,
    transfer::{self, Arrived, Header},
};

fn parse_peers(peers: &[String]) -> Result<Vec<PeerId>, BridgeError> {
    let mut parsed = Vec::with_capacity(peers.len());
    for peer in peers {
        let id = peer.parse::<PeerId>().map_err(|e| {
            BridgeError::bad_request(format!(
                "{peer:?} is not a peer ID ({e}); peers are written as 12D3KooW…"
            ))
        })?;
        if !parsed.contains(&id) {
            parsed.push(id);
        }
    }
    Ok(parsed)
}

/// Sends a file of the job to the jobs of its task on other workers.
pub(super) async fn send(bridge: &Bridge, request: SendRequest) -> Result<FileEntry, BridgeError> {
    let Target::Peers(Peers { peers, strategy }) = request.send;
    let patience = request
        .patience_ms
        .map_or(transfer::SEND_PATIENCE, std::time::Duration::from_millis);
    let peers = parse_peers(&peers)?;
    if peers.is_empty() {
        return Err(BridgeError::bad_request(
            "name at least one peer in \"peers\" to send to",
        ));
    }
    let local = bridge.shared.network.local_peer_id();
    if peers.contains(&local) {
        return Err(BridgeError::bad_request(format!(
            "{local} is this worker itself; jobs of a task on one worker share nothing through the network"
        )));
    }
    let relative = paths::check(&request.path)?;
    let size = bridge
        .dir
        .open_read(&relative)?
        .metadata()
        .map_err(|e| BridgeError::new(StatusCode::INTERNAL_SERVER_ERROR, "io", e.to_string()))?
        .len();
    let name = relative
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| BridgeError::bad_request("the path names no file"))?;
    let header = Header {
        task: bridge.context.task.clone(),
        name,
        size,
        published: None,
        sha256: None,
    };
    let send_to = |peer: PeerId| {
        let header = &header;
        let relative = &relative;
        async move {
            let file = bridge.dir.open_read(relative).map_err(|e| e.to_string())?;
            transfer::send(&bridge.shared.network, peer, header, file, patience)
                .await
                .map_err(|e| format!("{peer}: {e}"))
        }
    };
    let mut delivered = Vec::new();
    let mut failures = Vec::new();
    let mut checksum = None;
    match strategy {
        Strategy::All => {
            let results = futures::future::join_all(peers.iter().map(|p| send_to(*p))).await;
            for (peer, result) in peers.iter().zip(results) {
                match result {
                    Ok(sum) => {
                        checksum = Some(sum);
                        delivered.push(*peer);
                    }
                    Err(e) => failures.push(e),
                }
            }
        }
        Strategy::One | Strategy::Random => {
            let mut order = peers.clone();
            if strategy == Strategy::Random {
                order.shuffle(&mut rand::rng());
            }
            for peer in order {
                match send_to(peer).await {
                    Ok(sum) => {
                        checksum = Some(sum);
                        delivered.push(peer);
                        break;
                    }
                    Err(e) => failures.push(e),
                }
            }
        }
    }
    let checksum = match checksum {
        Some(checksum) if strategy != Strategy::All || failures.is_empty() => checksum,
        _ => return Err(send_failed(&failures, &delivered)),
    };
    Ok(FileEntry {
        path: relative.display().to_string(),
        size,
        checksum,
        metadata: BTreeMap::from([
            (
                "strategy".to_string(),
                serde_json::to_value(strategy).unwrap_or_default(),
            ),
            (
                "peers".to_string(),
                delivered
                    .iter()
                    .map(PeerId::to_string)
                    .collect::<Vec<_>>()
                    .into(),
            ),
            ("timestamp".to_string(), timestamp().into()),
        ]),
    })
}

/// A send that reached too few of its peers: why each failed, and who got the file.
fn send_failed(failures: &[String], delivered: &[PeerId]) -> BridgeError {
    let delivered = if delivered.is_empty() {
        String::new()
    } else {
        let peers: Vec<String> = delivered.iter().map(PeerId::to_string).collect();
        format!(" (delivered to {})", peers.join(", "))
    };
    BridgeError::new(
        StatusCode::BAD_GATEWAY,
        "send_failed",
        format!("{}{delivered}", failures.join("; ")),
    )
}

/// Streams the files that arrive for the job as Server-Sent Events.
pub(super) fn receive(
    bridge: Arc<Bridge>,
    request: ReceiveRequest,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, BridgeError> {
    let Target::Peers(Peers { peers, strategy }) = request.receive;
    let from: HashSet<PeerId> = parse_peers(&peers)?.into_iter().collect();
    let out_dir = checked_out_dir(&bridge, &request.out_dir)?;
    let just_one = strategy != Strategy::All;
    let events = futures::stream::unfold(Some(()), move |more| {
        let bridge = bridge.clone();
        let from = from.clone();
        let out_dir = out_dir.clone();
        async move {
            more?;
            let arrived = tokio::select! {
                arrived = bridge.inbox().next(&from) => arrived,
                () = bridge.stopping.cancelled() => return None,
            };
            let event = match deliver(&bridge, &arrived, &out_dir) {
                Ok(entry) => Event::default()
                    .id(arrived.sequence.to_string())
                    .json_data(ReceiveEvent {
                        entry,
                        from_peer: arrived.from.to_string(),
                        sequence: arrived.sequence,
                    })
                    .unwrap_or_default(),
                Err(e) => error_event(e),
            };
            Some((Ok(event), (!just_one).then_some(())))
        }
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// An error in a receive stream: `event: error`, its data a [`StreamError`].
fn error_event(error: BridgeError) -> Event {
    Event::default()
        .event("error")
        .json_data(StreamError {
            error: error.body(),
        })
        .unwrap_or_default()
}

/// A receive refused before its stream started, answered to a client that reads event
/// streams: the error's status, and the error as the stream's one event, so that a client
/// that never looks at the status (the upstream one) still sees it.
pub(super) fn refused_stream(error: BridgeError) -> Response {
    let data = serde_json::to_string(&StreamError {
        error: error.body(),
    })
    .unwrap_or_default();
    (
        error.status,
        [(header::CONTENT_TYPE, "text/event-stream")],
        format!("event: error\ndata: {data}\n\n"),
    )
        .into_response()
}

/// `/resources/fetch` of `{"type": "Peers"}`: waits for files sent to the job; with `wait`,
/// at most that long, then answers with what arrived by then (possibly nothing), so that an
/// executor can look around (ask its scheduler whether the peer is still there) and ask again.
pub(super) async fn fetch(
    bridge: &Bridge,
    peers: &[String],
    strategy: Strategy,
    out_dir: &str,
    wait: Option<std::time::Duration>,
) -> Result<Vec<FileEntry>, BridgeError> {
    let deadline = wait.map(|wait| tokio::time::Instant::now() + wait);
    let peers = parse_peers(peers)?;
    let out_dir = checked_out_dir(bridge, out_dir)?;
    let waits: Vec<HashSet<PeerId>> = if strategy == Strategy::All && !peers.is_empty() {
        peers.iter().map(|p| HashSet::from([*p])).collect()
    } else {
        vec![peers.into_iter().collect()]
    };
    let mut entries = Vec::with_capacity(waits.len());
    for from in waits {
        let until = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let arrived = tokio::select! {
            arrived = bridge.inbox().next(&from) => arrived,
            () = until => break,
            () = bridge.stopping.cancelled() => return Err(BridgeError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "job_ending",
                "the job is ending",
            )),
        };
        entries.push(deliver(bridge, &arrived, &out_dir)?);
    }
    Ok(entries)
}

/// Checks `out_dir` and creates it, so that a bad one is refused before a file is taken.
fn checked_out_dir(bridge: &Bridge, out_dir: &str) -> Result<PathBuf, BridgeError> {
    let out_dir = paths::check(out_dir)?;
    bridge.dir.create_dir_all(&out_dir)?;
    Ok(out_dir)
}

fn deliver(
    bridge: &Bridge,
    arrived: &Arrived,
    out_dir: &std::path::Path,
) -> Result<FileEntry, BridgeError> {
    let path = bridge.inbox().deliver(arrived, out_dir)?;
    Ok(FileEntry {
        path,
        size: arrived.size,
        checksum: arrived.checksum.clone(),
        metadata: BTreeMap::from([
            ("source".to_string(), "peer".into()),
            ("from_peer".to_string(), arrived.from.to_string().into()),
            ("sequence".to_string(), arrived.sequence.into()),
            ("name".to_string(), arrived.name.clone().into()),
            ("timestamp".to_string(), timestamp().into()),
        ]),
    })
}
