//! The job bridge: HTTP/1.1 over each job's Unix socket, the interface of seed 003.
//!
//! | endpoint | what it does |
//! |---|---|
//! | `POST /resources/fetch` | downloads HTTP(S) URLs, Hugging Face files or artifacts (peer to peer from the worker's origins) into the job's directory, or waits for files peers sent |
//! | `POST /resources/send` | sends a file to the jobs of the same task on other workers ([`peers`]) |
//! | `POST /resources/receive` | streams the files peers send, as Server-Sent Events with sequence numbers |
//! | `POST /data/consumed` | tells the job's scheduler which slices went into which round ([`data`]) |
//! | `POST /status/send` | forwards a JSON status to the job's scheduler and returns its answer |
//! | `GET /openapi.json` | describes all of it |
//!
//! Every response that names a file gives its `path` (relative to the job's directory),
//! `size`, `checksum` (`sha256:<hex>`) and `metadata`. Errors are JSON:
//! `{"code": "path_refused", "message": "..."}` with a fitting HTTP status. Request bodies are
//! limited to [`MAX_BODY_BYTES`]. Every path an executor names is confined to its job's
//! directory ([`paths`]).
//!
//! Each job has its own socket (mode 0600, inside the job's 0700 directory) and its own
//! server, which knows only that job: a job cannot name another job's files or inbox, and
//! what peers send reaches only the jobs of the task it was sent to ([`transfer`]).

mod data;
mod fetch;
pub mod paths;
mod peers;
pub mod socket;
pub mod transfer;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use hypha_bridge::{
    ConsumedAnswer, ConsumedRequest, ErrorBody, ReceiveRequest, SendRequest, fetch::FetchBody,
    status,
};
use hypha_messages::Request;
use hypha_network::Network;
use libp2p::PeerId;
use tokio_util::sync::CancellationToken;

use crate::{
    artifacts::ArtifactStore,
    slices::{Holding, Prefetcher, SliceCache, Source},
};

use self::{
    paths::{JobDir, PathError},
    transfer::{Inbox, Inboxes, Registration},
};

pub use hypha_bridge::{FileEntry, MAX_BODY_BYTES};
/// The Hugging Face endpoint used unless `HF_ENDPOINT` says otherwise.
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";

/// Settings of every job's bridge.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where Hugging Face repositories are fetched from (`HF_ENDPOINT`, as the Hub's own tools
    /// read it: a mirror or a private hub).
    pub hf_endpoint: String,
    /// A token sent to the Hub when the job brings none (`HF_TOKEN`).
    pub hf_token: Option<String>,
    /// How long a download may receive nothing (`bridge.download_read_timeout_ms`).
    pub download_read_timeout: std::time::Duration,
}

impl Settings {
    /// Reads `HF_ENDPOINT` and `HF_TOKEN`; downloads time out after `download_read_timeout`.
    pub fn from_env(download_read_timeout: std::time::Duration) -> Self {
        Settings {
            hf_endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.to_string()),
            hf_token: std::env::var("HF_TOKEN").ok().filter(|v| !v.is_empty()),
            download_read_timeout,
        }
    }
}

/// What all jobs' bridges share.
#[derive(Debug)]
pub struct Shared {
    network: Network,
    settings: Settings,
    http: reqwest::Client,
    inboxes: Arc<Inboxes>,
    cache: Arc<SliceCache>,
    prefetch_bytes: u64,
    artifacts: Arc<ArtifactStore>,
}

impl Shared {
    /// `cache` holds the worker's slices; each job's prefetcher keeps up to `prefetch_bytes`
    /// of them ready. `artifacts` brings in what jobs name.
    pub fn new(
        network: Network,
        settings: Settings,
        cache: Arc<SliceCache>,
        prefetch_bytes: u64,
        artifacts: Arc<ArtifactStore>,
    ) -> Self {
        let http = reqwest::Client::builder()
            .user_agent(concat!("hypha-worker/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(std::time::Duration::from_secs(30))
            .read_timeout(settings.download_read_timeout)
            .build()
            .unwrap_or_default();
        Shared {
            network,
            settings,
            http,
            inboxes: Arc::default(),
            cache,
            prefetch_bytes,
            artifacts,
        }
    }

    /// The worker's artifact store.
    pub fn artifacts(&self) -> &Arc<ArtifactStore> {
        &self.artifacts
    }

    /// The worker's network.
    pub fn network(&self) -> &Network {
        &self.network
    }

    /// The inboxes of this worker's jobs, by task.
    pub fn inboxes(&self) -> &Arc<Inboxes> {
        &self.inboxes
    }

    /// Receives what peers send to this worker's jobs, until the network stops.
    pub async fn receive_transfers(&self) {
        transfer::serve(
            self.network.clone(),
            self.inboxes.clone(),
            self.artifacts.clone(),
        )
        .await;
    }
}

/// The one job a bridge serves.
#[derive(Debug, Clone)]
pub struct BridgeContext {
    pub job: String,
    pub task: String,
    pub scheduler: PeerId,
    pub dir: PathBuf,
    pub secrets: hypha_messages::job::Secrets,
    /// The workers of the task's jobs at dispatch (see [`transfer::Inboxes`]).
    pub task_peers: hypha_messages::job::TaskPeers,
}

struct Bridge {
    shared: Arc<Shared>,
    context: BridgeContext,
    dir: Arc<JobDir>,
    registration: Registration,
    /// Cancelled when the job ends: ends event streams and waits so the server can stop.
    stopping: CancellationToken,
    /// The job's prefetchers, one per data source it reads.
    prefetchers: tokio::sync::Mutex<HashMap<Source, Prefetcher>>,
    /// What the job holds of each source's grants; apart from the prefetchers, which a slow
    /// fetch keeps locked, so that reporting consumed slices never waits for one.
    holdings: std::sync::Mutex<HashMap<Source, Holding>>,
}

impl Bridge {
    fn inbox(&self) -> &Inbox {
        self.registration.inbox()
    }

    /// What the job holds of `source`'s grants.
    fn holding(&self, source: &Source) -> Holding {
        self.holdings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(source.clone())
            .or_default()
            .clone()
    }
}

/// A running bridge; [`stop`](BridgeHandle::stop) it when the job ends.
#[derive(Debug)]
pub struct BridgeHandle {
    stopping: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    inbox: Arc<Inbox>,
}

impl BridgeHandle {
    /// What peers sent to the job: built-in runtimes take it from here directly.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Stops serving: open event streams and waits end, and the job's inbox closes (files
    /// still waiting in it stay in its staging directory).
    pub async fn stop(self) {
        self.stopping.cancel();
        let _ = self.task.await;
    }
}

/// Starts a job's bridge on a new Unix socket at `socket` (mode 0600).
pub fn serve(
    shared: Arc<Shared>,
    context: BridgeContext,
    socket: &Path,
) -> std::io::Result<BridgeHandle> {
    use std::os::unix::fs::PermissionsExt;
    let dir = Arc::new(JobDir::open(&context.dir)?);
    // The socket lives in the job's 0700 directory (or the worker's 0700 socket directory),
    // so nobody else can reach it even in the moment between bind and chmod.
    let listener = tokio::net::UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    // The job manager checked the task's owner before it made the job's directory; this is
    // the same check, under the inboxes' lock.
    let registration = shared
        .inboxes
        .open(
            &context.task,
            &context.job,
            dir.clone(),
            context.scheduler,
            &context.task_peers,
        )
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))?;
    let stopping = CancellationToken::new();
    let inbox = registration.inbox().clone();
    let bridge = Arc::new(Bridge {
        shared,
        context,
        dir,
        registration,
        stopping: stopping.clone(),
        prefetchers: tokio::sync::Mutex::default(),
        holdings: std::sync::Mutex::default(),
    });
    let router = Router::new()
        .route("/resources/fetch", post(fetch_handler))
        .route("/resources/send", post(send_handler))
        .route("/resources/receive", post(receive_handler))
        .route("/data/consumed", post(consumed_handler))
        .route("/status/send", post(status_send))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .with_state(bridge);
    let task = tokio::spawn({
        let stopping = stopping.clone();
        async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(stopping.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "job bridge stopped");
            }
        }
    });
    Ok(BridgeHandle {
        stopping,
        task,
        inbox,
    })
}

/// An error answered to the executor as JSON.
#[derive(Debug)]
pub struct BridgeError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl BridgeError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        BridgeError {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    fn body(&self) -> ErrorBody {
        ErrorBody::new(self.code, self.message.clone())
    }
}

impl From<PathError> for BridgeError {
    fn from(e: PathError) -> Self {
        match e {
            PathError::Refused { .. } => {
                Self::new(StatusCode::FORBIDDEN, "path_refused", e.to_string())
            }
            PathError::Io { ref error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
                Self::new(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            PathError::Io { .. } => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "io", e.to_string())
            }
        }
    }
}

impl IntoResponse for BridgeError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Reads a JSON body of at most [`MAX_BODY_BYTES`].
async fn json_body<T: serde::de::DeserializeOwned>(body: Body) -> Result<T, BridgeError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            BridgeError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
            )
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| BridgeError::bad_request(format!("the body is not the expected JSON: {e}")))
}

fn timestamp() -> String {
    time::OffsetDateTime::from(SystemTime::now())
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

async fn fetch_handler(
    State(bridge): State<Arc<Bridge>>,
    body: Body,
) -> Result<Json<Vec<FileEntry>>, BridgeError> {
    let request: FetchBody = json_body(body).await?;
    fetch::fetch(&bridge, request.into()).await.map(Json)
}

async fn send_handler(
    State(bridge): State<Arc<Bridge>>,
    body: Body,
) -> Result<Json<FileEntry>, BridgeError> {
    let request: SendRequest = json_body(body).await?;
    peers::send(&bridge, request).await.map(Json)
}

async fn receive_handler(
    State(bridge): State<Arc<Bridge>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let wants_events = headers
        .get(header::ACCEPT)
        .and_then(|accept| accept.to_str().ok())
        .is_some_and(|accept| accept.contains("text/event-stream"));
    let stream = match json_body::<ReceiveRequest>(body).await {
        Ok(request) => peers::receive(bridge, request),
        Err(error) => Err(error),
    };
    match stream {
        Ok(stream) => stream.into_response(),
        Err(error) if wants_events => peers::refused_stream(error),
        Err(error) => error.into_response(),
    }
}

async fn consumed_handler(
    State(bridge): State<Arc<Bridge>>,
    body: Body,
) -> Result<Json<ConsumedAnswer>, BridgeError> {
    let request: ConsumedRequest = json_body(body).await?;
    data::consumed(&bridge, request).await.map(Json)
}

async fn status_send(
    State(bridge): State<Arc<Bridge>>,
    body: Body,
) -> Result<Response, BridgeError> {
    let status: serde_json::Value = json_body(body).await?;
    let answer = bridge
        .shared
        .network
        .request(
            bridge.context.scheduler,
            Request::ExecutorStatus {
                job: bridge.context.job.clone(),
                payload: status.to_string(),
            },
        )
        .await
        .map_err(|e| {
            BridgeError::new(
                StatusCode::BAD_GATEWAY,
                "scheduler_unreachable",
                format!("the job's scheduler did not take the status: {e}"),
            )
        })?;
    match answer {
        hypha_messages::Response::ExecutorStatus { payload } => {
            let answer = status::with_upstream_type(&payload, &status).map_err(|e| {
                BridgeError::new(StatusCode::BAD_GATEWAY, "scheduler_answer", e.to_string())
            })?;
            Ok(([(header::CONTENT_TYPE, "application/json")], answer).into_response())
        }
        _ => Err(BridgeError::new(
            StatusCode::BAD_GATEWAY,
            "scheduler_unreachable",
            "the scheduler answered with something other than a status",
        )),
    }
}

async fn not_found() -> BridgeError {
    BridgeError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint; GET /openapi.json lists them",
    )
}

async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        hypha_bridge::openapi::JSON,
    )
}
