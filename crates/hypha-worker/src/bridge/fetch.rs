//! `POST /resources/fetch`: bringing resources into the job's directory.
//!
//! - `{"type": "Uri", "value": "https://…"}`: one HTTP(S) download, named after the URL's last
//!   path segment.
//! - `{"type": "Peers", "peers": [...], "strategy": "All"}`: files other jobs of the task sent
//!   (see [`peers`](super::peers)); with `"wait_ms"`, at most that long (`[]` when nothing
//!   came).
//! - `{"type": "HuggingFace", "repository": "org/model", "revision": "main", "filenames": [...]}`:
//!   files of a Hub repository through the Hub's HTTP file API
//!   (`{endpoint}/{repository}/resolve/{revision}/{filename}`). The endpoint is `HF_ENDPOINT`
//!   (default <https://huggingface.co>); the token is the request's `token`, else the job's
//!   secret `hf_token`, else the worker's `HF_TOKEN`.
//!
//! - `{"type": "Artifact", "profile": "models", "uri": "llama/weights.bin"}`: an object of
//!   one of the worker's artifact origins (`[artifacts.profiles]`; default profile
//!   `"default"`), fetched peer to peer with the other workers that need it and placed at
//!   `out_dir/{last segment of uri}` as a hard link into the worker's artifact store.
//!   `"kind": "prefix"` places every object under the prefix, its tree kept, under
//!   `out_dir/{last segment}`. `"unpack": "auto"` (or `"tar"`, `"tar_gz"`, `"zip"`) also
//!   unpacks the archive into `out_dir/{name without .tar, .tar.gz, .tgz, .zip}` (or
//!   `{name}.d` for other names).
//!
//! - `{"type": "Scheduler", "peer": "…", "dataset": "…"}`: the next slice of the job's
//!   dataset (see [`data`](super::data)); with `"wait_ms"` beside `fetch`, the request waits
//!   at most that long while no slice is free, then answers 503 `data_wait`.
//! - `{"type": "HeldOut", "dataset": "…"}`: every slice of a dataset held out of training, to
//!   score models on (see [`data`](super::data)).
//!
//! Downloads stream to a temporary file in the destination directory while their SHA-256 is
//! computed, are fsynced and renamed into place: an interrupted download never leaves a
//! partial file under the final name.

use std::{ffi::OsStr, io::Write, path::Path};

use axum::http::StatusCode;
use futures::StreamExt;
use hypha_bridge::{FetchRequest, Peers, Reference};
use hypha_messages::artifact;
use sha2::{Digest, Sha256};

use super::{Bridge, BridgeError, FileEntry, paths, timestamp};

pub(super) async fn fetch(
    bridge: &Bridge,
    request: FetchRequest,
) -> Result<Vec<FileEntry>, BridgeError> {
    let out_dir = paths::check(&request.out_dir)?;
    match request.fetch {
        Reference::Peers(Peers { peers, strategy }) => {
            let wait = request.wait_ms.map(std::time::Duration::from_millis);
            super::peers::fetch(bridge, &peers, strategy, &request.out_dir, wait).await
        }
        Reference::Uri { value } => {
            let url = reqwest::Url::parse(&value)
                .map_err(|e| BridgeError::bad_request(format!("{value:?} is not a URL: {e}")))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(BridgeError::bad_request(format!(
                    "{value:?}: only http and https URLs can be fetched"
                )));
            }
            let name = url
                .path_segments()
                .and_then(|mut s| s.next_back())
                .filter(|s| !s.is_empty())
                .unwrap_or("download")
                .to_string();
            let relative = out_dir.join(paths::check(&name)?);
            let entry = download(bridge, url, None, &relative, "uri").await?;
            Ok(vec![entry])
        }
        Reference::HuggingFace {
            repository,
            revision,
            filenames,
            token,
        } => {
            let revision = revision.unwrap_or_else(|| "main".to_string());
            fetch_from_hub(bridge, &out_dir, &repository, &revision, &filenames, token).await
        }
        Reference::Artifact {
            profile,
            uri,
            kind,
            unpack,
        } => fetch_artifact(bridge, &out_dir, profile, uri, kind, unpack).await,
        Reference::Scheduler(reference) => {
            let wait = request.wait_ms.map(std::time::Duration::from_millis);
            super::data::fetch(bridge, reference, &out_dir, wait).await
        }
        Reference::HeldOut { dataset } => super::data::held_out(bridge, &dataset, &out_dir).await,
    }
}

/// Downloads `filenames` of a Hugging Face Hub `repository` at `revision` into `out_dir`,
/// with the job's (or the worker's) token.
async fn fetch_from_hub(
    bridge: &Bridge,
    out_dir: &Path,
    repository: &str,
    revision: &str,
    filenames: &[String],
    token: Option<String>,
) -> Result<Vec<FileEntry>, BridgeError> {
    if repository
        .split('/')
        .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return Err(BridgeError::bad_request(format!(
            "{repository:?} is not a Hub repository (write it as \"org/name\")"
        )));
    }
    if filenames.is_empty() {
        return Err(BridgeError::bad_request(
            "name at least one file in \"filenames\"",
        ));
    }
    let token = token
        .or_else(|| bridge.context.secrets.get("hf_token").cloned())
        .or_else(|| bridge.shared.settings.hf_token.clone());
    let endpoint = bridge.shared.settings.hf_endpoint.trim_end_matches('/');
    let mut entries = Vec::with_capacity(filenames.len());
    for filename in filenames {
        let relative = out_dir.join(paths::check(filename)?);
        let url = format!("{endpoint}/{repository}/resolve/{revision}/{filename}");
        let url = reqwest::Url::parse(&url)
            .map_err(|e| BridgeError::bad_request(format!("{url:?}: {e}")))?;
        let mut entry = download(bridge, url, token.as_deref(), &relative, "huggingface").await?;
        entry
            .metadata
            .insert("repository".into(), repository.into());
        entry.metadata.insert("revision".into(), revision.into());
        entries.push(entry);
    }
    Ok(entries)
}

/// Provides an artifact into `out_dir` (unpacked beside it when asked), shared with the
/// workers of the job's task, and lists its files with their SHA-256.
async fn fetch_artifact(
    bridge: &Bridge,
    out_dir: &Path,
    profile: String,
    uri: String,
    kind: artifact::Kind,
    unpack: Option<artifact::UnpackMethod>,
) -> Result<Vec<FileEntry>, BridgeError> {
    let name = uri
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| BridgeError::bad_request(format!("{uri:?} names no object")))?;
    let destination = out_dir.join(paths::check(name)?);
    let unpack = unpack.map(|method| artifact::Unpack {
        destination: out_dir.join(archive_stem(name)),
        method,
    });
    let request = artifact::Request {
        profile: profile.clone(),
        uri: uri.clone(),
        kind,
        destination,
        unpack,
    };
    let provided = bridge
        .shared
        .artifacts()
        .provide(
            &request,
            bridge.dir.clone(),
            0,
            bridge
                .shared
                .inboxes()
                .artifact_admission(bridge.context.scheduler, &bridge.context.task),
        )
        .await
        .map_err(|e| BridgeError::new(StatusCode::BAD_GATEWAY, "artifact", e.to_string()))?;
    let metadata: std::collections::BTreeMap<String, serde_json::Value> = [
        ("source", serde_json::Value::from("artifact")),
        ("profile", profile.into()),
        ("uri", uri.into()),
        ("artifact", provided.fetched.artifact.to_string().into()),
        ("from_cache", provided.fetched.from_cache.into()),
        ("timestamp", timestamp().into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    tokio::task::spawn_blocking(move || {
        provided
            .files
            .into_iter()
            .map(|(path, stored)| {
                let (size, checksum) = sha256_file(&stored).map_err(|e| {
                    BridgeError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "io",
                        format!("reading {}: {e}", path.display()),
                    )
                })?;
                Ok(FileEntry {
                    path: path.display().to_string(),
                    size,
                    checksum,
                    metadata: metadata.clone(),
                })
            })
            .collect::<Result<Vec<_>, BridgeError>>()
    })
    .await
    .map_err(|e| BridgeError::new(StatusCode::INTERNAL_SERVER_ERROR, "io", e.to_string()))?
}

/// Where an archive is unpacked: its name without the archive extension, or with `.d`
/// appended when it has none.
fn archive_stem(name: &str) -> String {
    [".tar.gz", ".tgz", ".tar", ".zip"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
        .filter(|stem| !stem.is_empty())
        .map_or_else(|| format!("{name}.d"), str::to_string)
}

/// The size and `sha256:<hex>` of a file.
fn sha256_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let size = std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok((size, format!("sha256:{}", hex::encode(hasher.finalize()))))
}

async fn download(
    bridge: &Bridge,
    url: reqwest::Url,
    token: Option<&str>,
    relative: &Path,
    source: &str,
) -> Result<FileEntry, BridgeError> {
    let upstream = |message: String| BridgeError::new(StatusCode::BAD_GATEWAY, "upstream", message);
    let mut request = bridge.shared.http.get(url.clone());
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request
        .send()
        .await
        .map_err(|e| upstream(format!("cannot fetch {url}: {e}")))?;
    let status = response.status();
    if !status.is_success() {
        let hint = match status.as_u16() {
            401 | 403 => {
                " (a private or gated repository needs a token: the request's \"token\", the job's hf_token secret, or HF_TOKEN)"
            }
            404 => " (check the repository, revision and file name)",
            _ => "",
        };
        return Err(upstream(format!("{url} answered {status}{hint}")));
    }
    let (Some(parent), Some(name)) = (relative.parent(), relative.file_name()) else {
        return Err(BridgeError::bad_request("the destination names no file"));
    };
    let parent_fd = if parent.as_os_str().is_empty() {
        bridge.dir.create_dir_all(Path::new("."))?
    } else {
        bridge.dir.create_dir_all(parent)?
    };
    let io = |e: std::io::Error| {
        BridgeError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            format!("writing {}: {e}", relative.display()),
        )
    };
    let (mut file, temp) = paths::JobDir::create_temp(&parent_fd, name).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut body = response.bytes_stream();
    let written: Result<(), BridgeError> = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| upstream(format!("{url}: download broke off: {e}")))?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            file.write_all(&chunk).map_err(io)?;
        }
        file.sync_all().map_err(io)?;
        paths::JobDir::publish(&parent_fd, &temp, name as &OsStr).map_err(io)
    }
    .await;
    if let Err(e) = written {
        paths::JobDir::discard(&parent_fd, &temp);
        return Err(e);
    }
    Ok(FileEntry {
        path: relative.display().to_string(),
        size,
        checksum: format!("sha256:{}", hex::encode(hasher.finalize())),
        metadata: [
            ("source".to_string(), serde_json::Value::from(source)),
            ("url".to_string(), url.to_string().into()),
            ("timestamp".to_string(), timestamp().into()),
        ]
        .into_iter()
        .collect(),
    })
}
