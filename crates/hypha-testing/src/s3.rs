//! A real S3 server in-process (`s3s` + `s3s-fs`), for tests and benchmarks: it counts the
//! object bytes it serves and can throttle them to a bandwidth shared by all connections
//! (a token bucket), the way an origin's egress limit would.

use std::{
    collections::BTreeMap,
    io,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{StreamExt, TryStreamExt};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto::Builder as ConnBuilder,
};
use s3s::{
    S3, S3Request, S3Response, S3Result, auth::SimpleAuth, dto::*, service::S3ServiceBuilder,
};
use tokio::time::Instant;

use hypha_artifacts::origin::Profile;

const ACCESS_KEY: &str = "hypha-test";
const SECRET_KEY: &str = "hypha-test-secret";
/// The bucket every test server has.
pub const BUCKET: &str = "artifacts";

/// A running in-process S3 server. It stops when dropped.
#[derive(Debug)]
pub struct S3Server {
    endpoint: String,
    served: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl S3Server {
    /// Serves the buckets under `root` (bucket [`BUCKET`] is created) on 127.0.0.1, limiting
    /// object bytes to `bandwidth` bytes per second over all connections if given.
    pub async fn start(root: &Path, bandwidth: Option<u64>) -> io::Result<S3Server> {
        std::fs::create_dir_all(root.join(BUCKET))?;
        let served = Arc::new(AtomicU64::new(0));
        let fs = s3s_fs::FileSystem::new(root).map_err(|e| io::Error::other(format!("{e:?}")))?;
        let counted = Counted {
            fs,
            root: root.to_path_buf(),
            writes: tokio::sync::RwLock::new(()),
            served: served.clone(),
            bucket: bandwidth.map(|rate| Arc::new(TokenBucket::new(rate))),
        };
        let service = {
            let mut builder = S3ServiceBuilder::new(counted);
            builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
            builder.build()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let http = ConnBuilder::new(TokioExecutor::new());
            // The connections end with the server (its task aborted or dropped).
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((socket, _)) = listener.accept().await {
                while connections.try_join_next().is_some() {}
                let connection = http
                    .serve_connection(TokioIo::new(socket), service.clone())
                    .into_owned();
                connections.spawn(async move {
                    let _ = connection.await;
                });
            }
        });
        Ok(S3Server {
            endpoint,
            served,
            task,
        })
    }

    /// Object bytes sent to clients so far.
    pub fn bytes_served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    pub fn served_counter(&self) -> Arc<AtomicU64> {
        self.served.clone()
    }

    /// An origin profile for this server's bucket.
    pub fn profile(&self) -> Profile {
        Profile {
            url: format!("s3://{BUCKET}"),
            options: BTreeMap::from(
                [
                    ("aws_endpoint", self.endpoint.as_str()),
                    ("aws_access_key_id", ACCESS_KEY),
                    ("aws_secret_access_key", SECRET_KEY),
                    ("aws_region", "us-east-1"),
                    ("aws_allow_http", "true"),
                ]
                .map(|(k, v)| (k.to_string(), v.to_string())),
            ),
        }
    }

    /// The profile as a node config's `[artifacts.profiles.NAME]` table.
    pub fn profile_toml(&self, name: &str) -> String {
        let profile = self.profile();
        let options: Vec<String> = profile
            .options
            .iter()
            .map(|(k, v)| format!("{k} = {v:?}"))
            .collect();
        format!(
            "[artifacts.profiles.{name}]\nurl = {:?}\noptions = {{ {} }}\n",
            profile.url,
            options.join(", ")
        )
    }

    /// Uploads an object through the S3 API (so the server records its ETag as S3 would).
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), object_store::Error> {
        let (store, _) = object_store::parse_url_opts(
            &url::Url::parse(&self.profile().url).map_err(|e| object_store::Error::Generic {
                store: "test",
                source: e.into(),
            })?,
            self.profile().options,
        )?;
        store
            .put(&object_store::path::Path::from(key), bytes.into())
            .await?;
        Ok(())
    }
}

/// Bytes per second shared by everyone who takes from it.
#[derive(Debug)]
struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    fn new(rate: u64) -> TokenBucket {
        let rate = rate.max(1) as f64;
        // A 20 ms burst keeps the rate smooth at any scale.
        let burst = (rate / 50.0).max(64.0 * 1024.0);
        TokenBucket {
            rate,
            burst,
            state: Mutex::new((0.0, Instant::now())),
        }
    }

    async fn take(&self, amount: usize) {
        let amount = amount as f64;
        loop {
            let wait = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let now = Instant::now();
                let (tokens, last) = *state;
                let tokens = (tokens + now.duration_since(last).as_secs_f64() * self.rate)
                    .min(self.burst.max(amount));
                if tokens >= amount {
                    *state = (tokens - amount, now);
                    return;
                }
                *state = (tokens, now);
                (amount - tokens) / self.rate
            };
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
    }
}

/// `s3s-fs` with its object bodies counted and throttled.
///
/// `s3s-fs` opens an object's file, then reads its ETag from a separate metadata file, so a GET
/// racing a PUT of the same key could answer the old bytes under the new ETag, which real S3
/// never does. Writes take `writes` exclusively and reads share it, so every answer is one
/// version's bytes with that version's metadata (the body is read from the file opened under
/// the lock).
struct Counted {
    fs: s3s_fs::FileSystem,
    root: std::path::PathBuf,
    writes: tokio::sync::RwLock<()>,
    served: Arc<AtomicU64>,
    bucket: Option<Arc<TokenBucket>>,
}

#[async_trait::async_trait]
impl S3 for Counted {
    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let object_path = self.object_path(&req.input.bucket, &req.input.key);
        let (mut response, file) = {
            let _consistent = self.writes.read().await;
            let response = self.fs.get_object(req).await?;
            // Opened under the same lock as s3s-fs's file, so the same version.
            let file = object_path.and_then(|path| std::fs::File::open(path).ok());
            (response, file)
        };
        if let Some(body) = response.output.body.take() {
            // s3s-fs streams a file 4 KiB at a time through `tokio::fs`, a blocking-pool hop
            // each: 2.5 million thread switches in one `distribute` benchmark, enough to keep
            // the throttled origin from its rate on two cores. Serve the same range in large
            // blocks instead.
            let body = match (file, body_range(&response.output)) {
                (Some(file), Some((start, len))) => file_blocks(file, start, len).boxed(),
                _ => body.map_err(io::Error::other).boxed(),
            };
            let served = self.served.clone();
            let bucket = self.bucket.clone();
            let counted = body
                .then(move |item| {
                    let served = served.clone();
                    let bucket = bucket.clone();
                    async move {
                        if let Ok(bytes) = &item {
                            if let Some(bucket) = &bucket {
                                bucket.take(bytes.len()).await;
                            }
                            served.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        }
                        item
                    }
                })
                .boxed();
            response.output.body = Some(StreamingBlob::wrap(SyncStream(Mutex::new(counted))));
        }
        Ok(response)
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let _consistent = self.writes.read().await;
        self.fs.head_object(req).await
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let _exclusive = self.writes.write().await;
        self.fs.put_object(req).await
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        let _exclusive = self.writes.write().await;
        self.fs.delete_object(req).await
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        let _consistent = self.writes.read().await;
        self.fs.list_objects_v2(req).await
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.fs.head_bucket(req).await
    }
}

impl Counted {
    /// Where s3s-fs keeps `key` of `bucket`; `None` for a key that is not a plain relative path
    /// (s3s-fs resolves those itself, and its own body is served).
    fn object_path(&self, bucket: &str, key: &str) -> Option<std::path::PathBuf> {
        let plain = |p: &str| {
            Path::new(p)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        };
        (plain(bucket) && plain(key)).then(|| self.root.join(bucket).join(key))
    }
}

/// The byte range a GET answer covers: its `Content-Range`, or the whole object.
fn body_range(output: &GetObjectOutput) -> Option<(u64, u64)> {
    let len = u64::try_from(output.content_length?).ok()?;
    let start = match &output.content_range {
        None => 0,
        Some(range) => range
            .strip_prefix("bytes ")?
            .split_once('-')?
            .0
            .parse()
            .ok()?,
    };
    Some((start, len))
}

/// `len` bytes of `file` from `start`, read on the blocking pool 256 KiB at a time.
fn file_blocks(
    file: std::fs::File,
    start: u64,
    len: u64,
) -> impl futures::Stream<Item = io::Result<bytes::Bytes>> + Send {
    const BLOCK: u64 = 256 * 1024;
    futures::stream::try_unfold(
        (Arc::new(file), start, len),
        |(file, offset, left)| async move {
            if left == 0 {
                return Ok(None);
            }
            let size = left.min(BLOCK);
            let reader = file.clone();
            let block = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut block = vec![0; size as usize];
                reader.read_exact_at(&mut block, offset)?;
                io::Result::Ok(bytes::Bytes::from(block))
            })
            .await
            .map_err(io::Error::other)??;
            Ok(Some((block, (file, offset + size, left - size))))
        },
    )
}

/// Makes a `Send` stream `Sync`, as `StreamingBlob` requires, by polling it under a lock
/// that only its single consumer ever takes.
struct SyncStream<S>(Mutex<S>);

impl<S: futures::Stream + Unpin> futures::Stream for SyncStream<S> {
    type Item = S::Item;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let inner = self
            .get_mut()
            .0
            .get_mut()
            .unwrap_or_else(|e| e.into_inner());
        std::pin::Pin::new(inner).poll_next(cx)
    }
}

/// Deterministic bytes that differ per seed and at every offset, so that a misplaced or mixed
/// chunk shows.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A gzipped tar archive of `files` (`(path, bytes)`, paths relative to the archive's root),
/// made by the system's `tar` as a user's would be.
pub fn tar_gz(files: &[(&str, &[u8])]) -> std::io::Result<Vec<u8>> {
    let dir = tempfile::tempdir()?;
    let tree = dir.path().join("tree");
    for (path, bytes) in files {
        let path = tree.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, bytes)?;
    }
    let status = std::process::Command::new("tar")
        .args(["czf", "archive.tar.gz", "-C", "tree", "."])
        .current_dir(dir.path())
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!("tar failed: {status}")));
    }
    std::fs::read(dir.path().join("archive.tar.gz"))
}
