//! Running jobs: a work directory per job, an executor per job, cancellation that always ends.
//!
//! Each job gets `work_dir/hypha-{uuid}` (mode 0700) holding:
//!
//! - `job.json`: the job specification without its secrets (also passed as `{JOB_JSON}`),
//! - `secrets.json` (0600, only when the job has secrets): read by the executor if it needs
//!   them, removed when the job ends; secrets never appear in argv or in any process's
//!   environment,
//! - `bridge.sock` (0600): the job bridge, removed when the job ends (a link to a short
//!   private path when `work_dir` is too long for a socket path: see
//!   [`SocketPlace`](crate::bridge::socket::SocketPlace)),
//! - `stdout.log`, `stderr.log`: everything the executor printed,
//! - the spec's `artifacts`, fetched (copied from the worker's artifact store) before the
//!   executor starts; a job whose artifacts cannot be fetched fails without starting.
//!
//! An executor starts with a cleared environment: [`BASE_ENV`] and what its `env` allows of
//! the worker's, so that the worker's credentials (`HF_TOKEN`, cloud keys) never reach a job.
//! An executor runs in its own process group, so that cancelling a job reaches every process it
//! started (`uv` → `python` → …): SIGTERM to the group, then SIGKILL after the grace period.
//! Work directories stay after the job ends so that logs and outputs can be inspected.

use std::{
    collections::HashMap,
    ffi::OsString,
    fs::{DirBuilder, File},
    io::{BufRead, BufReader, Seek, SeekFrom},
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use hypha_artifacts::Admission;
use hypha_messages::{
    artifact,
    job::{JobSpec, JobStatus},
    market::ExecutorRef,
};
use libp2p::PeerId;
use nix::{sys::signal::Signal, unistd::Pid};
use tokio::sync::{mpsc, oneshot};

use crate::{
    artifacts::ArtifactStore,
    bridge::{self, BridgeContext, paths::JobDir, socket::SocketPlace},
    config::{EnvVar, Executor, Runtime},
    metrics,
    parameter_server::{ModelPublisher, ServerJob},
};

/// The job's secrets in its directory, while it runs.
const SECRETS: &str = "secrets.json";

/// What every executor's environment holds of the worker's, besides its `env`: what a program
/// needs to start and to find its tools, and nothing that grants access.
pub const BASE_ENV: [&str; 8] = [
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR",
];

/// An executor's environment: [`BASE_ENV`] and `env`, the values passed taken from `lookup`
/// (the worker's environment).
pub fn environment(
    env: &[EnvVar],
    lookup: impl Fn(&str) -> Option<OsString>,
) -> Vec<(String, OsString)> {
    let mut out: Vec<(String, OsString)> = Vec::new();
    let passed = BASE_ENV
        .iter()
        .map(|name| EnvVar::Pass((*name).to_string()))
        .chain(env.iter().cloned());
    for var in passed {
        let (name, value) = match var {
            EnvVar::Pass(name) => match lookup(&name) {
                Some(value) => (name, value),
                None => continue,
            },
            EnvVar::Set(name, value) => (name, OsString::from(value)),
        };
        out.retain(|(known, _)| *known != name);
        out.push((name, value));
    }
    out
}

/// How many lines of an executor's stderr a failure report carries.
pub const STDERR_TAIL_LINES: usize = 20;

/// A job that ended, for the node to report and account.
#[derive(Debug)]
pub struct Ended {
    pub job: String,
    pub lease: u64,
    pub scheduler: PeerId,
    pub status: JobStatus,
}

/// Why a job did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("job id {0:?} is not a UUID")]
    BadId(String),
    #[error("job {0} is already running here")]
    Duplicate(String),
    #[error("this worker has no executor {0}")]
    UnknownExecutor(ExecutorRef),
    #[error("cannot prepare the job's directory {path}: {error}")]
    Directory {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    File(#[from] hypha_files::Error),
    #[error("cannot start the job bridge: {0}")]
    Bridge(std::io::Error),
    #[error(transparent)]
    ForeignTask(#[from] Box<bridge::transfer::ForeignTask>),
}

struct Running {
    lease: u64,
    scheduler: PeerId,
    cancel: Option<oneshot::Sender<String>>,
}

/// The jobs of one worker. Owned by the worker's node loop; every job's supervisor reports
/// its end on the channel given to [`JobManager::new`].
pub struct JobManager {
    work_dir: PathBuf,
    executors: HashMap<ExecutorRef, Runtime>,
    kill_grace: Duration,
    bridge: Arc<bridge::Shared>,
    sockets: Arc<SocketPlace>,
    ended: mpsc::Sender<Ended>,
    running: HashMap<String, Running>,
}

impl std::fmt::Debug for JobManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobManager")
            .field("work_dir", &self.work_dir)
            .field("running", &self.running.len())
            .finish()
    }
}

impl JobManager {
    pub fn new(
        work_dir: PathBuf,
        executors: &[Executor],
        kill_grace: Duration,
        bridge: Arc<bridge::Shared>,
        sockets: SocketPlace,
        ended: mpsc::Sender<Ended>,
    ) -> Self {
        JobManager {
            work_dir,
            executors: executors
                .iter()
                .map(|e| (e.executor.clone(), e.runtime.clone()))
                .collect(),
            kill_grace,
            bridge,
            sockets: Arc::new(sockets),
            ended,
            running: HashMap::new(),
        }
    }

    /// How many jobs are running.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// The scheduler a running job belongs to.
    pub fn scheduler_of(&self, job: &str) -> Option<PeerId> {
        self.running.get(job).map(|r| r.scheduler)
    }

    /// The inboxes of the jobs, by task (who may send to them).
    pub fn inboxes(&self) -> &bridge::transfer::Inboxes {
        self.bridge.inboxes()
    }

    /// The running jobs under `lease`.
    pub fn jobs_under(&self, lease: u64) -> Vec<String> {
        self.running
            .iter()
            .filter(|(_, r)| r.lease == lease)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Prepares the job's directory and bridge and starts its executor. The job's end arrives
    /// later as an [`Ended`].
    pub fn start(&mut self, spec: JobSpec, scheduler: PeerId) -> Result<(), StartError> {
        let id = uuid::Uuid::try_parse(&spec.id)
            .map_err(|_| StartError::BadId(spec.id.clone()))?
            .hyphenated()
            .to_string();
        if self.running.contains_key(&id) {
            return Err(StartError::Duplicate(id));
        }
        // Before anything is created: a job of another scheduler's task changes nothing.
        self.bridge.inboxes().check_owner(&spec.task, scheduler)?;
        let runtime = self
            .executors
            .get(&spec.executor)
            .ok_or_else(|| StartError::UnknownExecutor(spec.executor.clone()))?
            .clone();
        let (dir, job_json) = self.create_job_dir(&id, &spec)?;
        let socket = self.sockets.socket(&dir, &id);
        // The link first: a failure here leaves no bridge running.
        self.sockets
            .link(&dir, &socket)
            .map_err(StartError::Bridge)?;
        let bridge = bridge::serve(
            self.bridge.clone(),
            BridgeContext {
                job: id.clone(),
                task: spec.task.clone(),
                scheduler,
                dir: dir.clone(),
                secrets: spec.secrets.clone(),
                task_peers: spec.task_peers.clone(),
            },
            &socket,
        )
        .map_err(|error| {
            self.sockets.remove(&dir, &socket);
            StartError::Bridge(error)
        })?;

        let launch = match runtime {
            Runtime::Process { cmd, args, env } => Launch::Process { cmd, args, env },
            Runtime::ParameterServer => Launch::ParameterServer(Box::new(ServerJob {
                network: self.bridge.network().clone(),
                scheduler,
                job: id.clone(),
                task: spec.task.clone(),
                dir: dir.clone(),
                inbox: bridge.inbox().clone(),
                config: serde_json::from_str(&spec.config).unwrap_or_default(),
                publisher: ModelPublisher::new(
                    self.bridge.artifacts().clone(),
                    self.bridge
                        .inboxes()
                        .artifact_admission(scheduler, &spec.task),
                ),
                sends: Default::default(),
            })),
        };
        let artifacts = Artifacts {
            store: self.bridge.artifacts().clone(),
            requests: spec.artifacts.clone(),
            peers: spec.artifact_peers,
            admission: self
                .bridge
                .inboxes()
                .artifact_admission(scheduler, &spec.task),
        };
        let (cancel_tx, mut cancel_rx) = oneshot::channel();
        self.running.insert(
            id.clone(),
            Running {
                lease: spec.lease,
                scheduler,
                cancel: Some(cancel_tx),
            },
        );
        metrics::job_started();
        let supervisor = Supervisor {
            job: id,
            lease: spec.lease,
            scheduler,
            dir,
            kill_grace: self.kill_grace,
            ended: self.ended.clone(),
            started: Instant::now(),
        };
        let span = tracing::info_span!("job", job = %supervisor.job, executor = %spec.executor);
        let sockets = self.sockets.clone();
        // Never aborted from outside: the supervisor owns the executor's process, which it
        // must stop (SIGTERM, SIGKILL after the grace) and clean up after. It is reached
        // through `Running::cancel`, and it ends by sending its `Ended`, which the worker's
        // shutdown waits for.
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let status = match supervisor.provide(artifacts, &mut cancel_rx).await {
                    Ok(()) => supervisor.run(launch, &job_json, &socket, cancel_rx).await,
                    Err(status) => status,
                };
                bridge.stop().await;
                sockets.remove(&supervisor.dir, &socket);
                // The job's secrets do not outlive it; its logs and outputs stay.
                let secrets = supervisor.dir.join(SECRETS);
                if let Err(error) = std::fs::remove_file(&secrets)
                    && error.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(%error, path = %secrets.display(), "could not remove the job's secrets");
                }
                supervisor.finish(status).await;
            },
            span,
        ));
        Ok(())
    }

    /// The job's own directory under the work directory, private to this user, with its
    /// `job.json` (returned too) and its secrets.
    fn create_job_dir(&self, id: &str, spec: &JobSpec) -> Result<(PathBuf, String), StartError> {
        let dir = self.work_dir.join(format!("hypha-{id}"));
        DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|error| StartError::Directory {
                path: dir.clone(),
                error,
            })?;
        let job_json = job_json(id, spec);
        write_private(&dir.join("job.json"), job_json.as_bytes())?;
        if !spec.secrets.is_empty() {
            let secrets = serde_json::to_vec(&spec.secrets).unwrap_or_default();
            write_private(&dir.join(SECRETS), &secrets)?;
        }
        Ok((dir, job_json))
    }

    /// Stops a job: SIGTERM, then SIGKILL after the grace period. Its end arrives as an
    /// [`Ended`] like any other.
    pub fn cancel(&mut self, job: &str, reason: impl Into<String>) {
        if let Some(cancel) = self.running.get_mut(job).and_then(|r| r.cancel.take()) {
            let _ = cancel.send(reason.into());
        }
    }

    /// Forgets a job that ended; called by the node when it handles the [`Ended`].
    pub fn remove(&mut self, job: &str) {
        self.running.remove(job);
    }

    /// Cancels every job (shutdown).
    pub fn cancel_all(&mut self, reason: &str) {
        let jobs: Vec<String> = self.running.keys().cloned().collect();
        for job in jobs {
            self.cancel(&job, reason);
        }
    }
}

/// What a job runs.
enum Launch {
    Process {
        cmd: String,
        args: Vec<String>,
        env: Vec<EnvVar>,
    },
    ParameterServer(Box<ServerJob>),
}

struct Supervisor {
    job: String,
    lease: u64,
    scheduler: PeerId,
    dir: PathBuf,
    kill_grace: Duration,
    ended: mpsc::Sender<Ended>,
    started: Instant,
}

/// What a job needs in its directory before it starts.
struct Artifacts {
    store: Arc<ArtifactStore>,
    requests: Vec<artifact::Request>,
    /// Workers of the job fetching them too.
    peers: usize,
    /// Who may share them with this worker: the workers of the job's task.
    admission: Admission,
}

impl Supervisor {
    /// Fetches the job's artifacts into its directory; the status to report when that fails
    /// or the job is cancelled meanwhile.
    async fn provide(
        &self,
        artifacts: Artifacts,
        cancel: &mut oneshot::Receiver<String>,
    ) -> Result<(), JobStatus> {
        if artifacts.requests.is_empty() {
            return Ok(());
        }
        let job = JobDir::open(&self.dir)
            .map(Arc::new)
            .map_err(|e| failed(format!("cannot open the job's directory: {e}"), vec![]))?;
        let started = Instant::now();
        let all = async {
            for request in &artifacts.requests {
                if let Err(e) = request.check_destinations() {
                    return Err(format!("artifact {}: {e}", request.uri));
                }
                let provided = artifacts
                    .store
                    .provide(
                        request,
                        job.clone(),
                        artifacts.peers,
                        artifacts.admission.clone(),
                    )
                    .await
                    .map_err(|e| format!("artifact {}: {e}", request.uri))?;
                tracing::info!(
                    uri = %request.uri,
                    artifact = %provided.fetched.artifact,
                    files = provided.files.len(),
                    from_cache = provided.fetched.from_cache,
                    "artifact ready"
                );
            }
            Ok(())
        };
        tokio::select! {
            done = all => {
                done.map_err(|reason| failed(reason, vec![]))?;
                tracing::info!(elapsed = ?started.elapsed(), "artifacts ready; starting the executor");
                Ok(())
            }
            reason = cancel => Err(failed(
                format!(
                    "cancelled while fetching artifacts: {}",
                    reason.unwrap_or_else(|_| "the worker is shutting down".into())
                ),
                vec![],
            )),
        }
    }

    async fn run(
        &self,
        launch: Launch,
        job_json: &str,
        socket: &Path,
        cancel: oneshot::Receiver<String>,
    ) -> JobStatus {
        match launch {
            Launch::Process { cmd, args, env } => {
                let env = environment(&env, |name| std::env::var_os(name));
                self.run_process(&cmd, &args, &env, job_json, socket, cancel)
                    .await
            }
            Launch::ParameterServer(server) => {
                self.report(JobStatus::Running).await;
                server.run(cancel).await
            }
        }
    }

    async fn run_process(
        &self,
        cmd: &str,
        args: &[String],
        env: &[(String, OsString)],
        job_json: &str,
        socket: &Path,
        cancel: oneshot::Receiver<String>,
    ) -> JobStatus {
        let args = substitute(args, socket, &self.dir, job_json);
        let logs = File::create(self.dir.join("stdout.log"))
            .and_then(|out| Ok((out, File::create(self.dir.join("stderr.log"))?)));
        let (stdout, stderr) = match logs {
            Ok(files) => files,
            Err(e) => return failed(format!("cannot create the job's log files: {e}"), vec![]),
        };
        let program = match find_program(cmd, env, &self.dir) {
            Ok(program) => program,
            Err(e) => return failed(e, vec![]),
        };
        let mut command = tokio::process::Command::new(program);
        command
            .env_clear()
            .envs(env.iter().map(|(name, value)| (name, value)))
            .args(&args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                return failed(
                    format!("cannot start executor {cmd:?}: {e} (is it installed and in PATH?)"),
                    vec![],
                );
            }
        };
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .map(Pid::from_raw);
        tracing::info!(pid = ?pid, "executor started");
        self.report(JobStatus::Running).await;

        let exit = tokio::select! {
            exit = child.wait() => exit,
            reason = cancel => {
                let reason = reason.unwrap_or_else(|_| "the worker is shutting down".into());
                tracing::info!(%reason, "stopping executor");
                signal_group(pid, Signal::SIGTERM);
                let exit = match tokio::time::timeout(self.kill_grace, child.wait()).await {
                    Ok(exit) => exit,
                    Err(_) => {
                        tracing::warn!(grace = ?self.kill_grace, "executor ignored SIGTERM; killing it");
                        signal_group(pid, Signal::SIGKILL);
                        child.wait().await
                    }
                };
                // Whatever the leader did, nothing of the job may outlive it.
                signal_group(pid, Signal::SIGKILL);
                return failed(
                    format!("cancelled: {reason}{}", describe_exit(exit.ok())),
                    self.stderr_tail(),
                );
            }
        };
        signal_group(pid, Signal::SIGKILL);
        match exit {
            Ok(status) => match status.code() {
                Some(exit_code) => JobStatus::Finished {
                    exit_code,
                    stderr_tail: if exit_code == 0 {
                        Vec::new()
                    } else {
                        self.stderr_tail()
                    },
                },
                None => failed(
                    format!("executor{}", describe_exit(Some(status))),
                    self.stderr_tail(),
                ),
            },
            Err(e) => failed(
                format!("lost track of the executor: {e}"),
                self.stderr_tail(),
            ),
        }
    }

    fn stderr_tail(&self) -> Vec<String> {
        last_lines(&self.dir.join("stderr.log"), STDERR_TAIL_LINES)
    }

    async fn report(&self, status: JobStatus) {
        // Running is reported through the same channel as the end, so the scheduler sees
        // them in order.
        let _ = self
            .ended
            .send(Ended {
                job: self.job.clone(),
                lease: self.lease,
                scheduler: self.scheduler,
                status,
            })
            .await;
    }

    async fn finish(self, status: JobStatus) {
        match &status {
            JobStatus::Finished { exit_code, .. } => tracing::info!(exit_code, "job finished"),
            JobStatus::Failed { reason, .. } => tracing::warn!(%reason, "job failed"),
            JobStatus::Running => {}
        }
        metrics::job_ended(&status, self.started.elapsed());
        self.report(status).await;
    }
}

fn failed(reason: String, stderr_tail: Vec<String>) -> JobStatus {
    JobStatus::Failed {
        reason,
        stderr_tail,
    }
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!(" (exit code {code})"),
            (None, Some(signal)) => format!(
                " (killed by {})",
                Signal::try_from(signal)
                    .map_or_else(|_| format!("signal {signal}"), |s| s.to_string())
            ),
            (None, None) => String::new(),
        },
        None => String::new(),
    }
}

fn signal_group(pid: Option<Pid>, signal: Signal) {
    if let Some(pid) = pid {
        // ESRCH (the group is gone) is the expected outcome once the job has ended.
        let _ = nix::sys::signal::killpg(pid, signal);
    }
}

/// Writes a file of a new job's directory that only the worker's user may read.
///
/// Not fsynced: the executor reads it from the page cache right after, and a worker that
/// crashes loses its jobs anyway (a restarted worker starts none of them again), so durability
/// would only put a journal commit into every dispatch.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), hypha_files::Error> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(bytes))
        .map_err(|error| hypha_files::Error::Write {
            path: path.to_path_buf(),
            error,
        })
}

/// What an executor is told about its job (`{JOB_JSON}`, `job.json`): everything but the
/// secrets, with the executor's settings as a JSON value.
fn job_json(id: &str, spec: &JobSpec) -> String {
    let config = serde_json::from_str::<serde_json::Value>(&spec.config)
        .unwrap_or_else(|_| serde_json::Value::String(spec.config.clone()));
    let job = hypha_bridge::JobDescription::new(
        id,
        &spec.task,
        spec.lease,
        &spec.executor,
        config,
        !spec.secrets.is_empty(),
    );
    serde_json::to_string(&job).unwrap_or_default()
}

/// Replaces the seed's placeholders in executor arguments.
pub fn substitute(args: &[String], socket: &Path, work_dir: &Path, job_json: &str) -> Vec<String> {
    args.iter()
        .map(|a| {
            a.replace("{SOCKET_PATH}", &socket.to_string_lossy())
                .replace("{WORK_DIR}", &work_dir.to_string_lossy())
                .replace("{JOB_JSON}", job_json)
        })
        .collect()
}

/// The last `n` lines of a file, reading at most its last 64 KiB.
fn last_lines(path: &Path, n: usize) -> Vec<String> {
    const TAIL_BYTES: u64 = 64 * 1024;
    let Ok(mut file) = File::open(path) else {
        return Vec::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if file
        .seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))
        .is_err()
    {
        return Vec::new();
    }
    let lines: Vec<String> = BufReader::new(file)
        .split(b'\n')
        .filter_map(Result::ok)
        .map(|l| String::from_utf8_lossy(&l).into_owned())
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// The program an executor runs: `cmd` as `execvp` would find it in the executor's `PATH`.
///
/// Looked up here rather than in the child so that the standard library starts it with
/// `posix_spawn` (a `vfork`): a child that must search a `PATH` it is given is started with
/// `fork`, which copies the page tables of a worker that may hold gigabytes (a parameter
/// server's model) and makes every page it then writes fault. Measured in `hypha-bench
/// allocation` (64 workers in one process): forks were the largest cost of dispatching.
/// A `cmd` with a `/`, or an executor without a `PATH`, is left to the standard library.
fn find_program(cmd: &str, env: &[(String, OsString)], job_dir: &Path) -> Result<PathBuf, String> {
    let path = env.iter().find(|(name, _)| name == "PATH").map(|(_, v)| v);
    let Some(path) = path.filter(|_| !cmd.contains('/')) else {
        return Ok(PathBuf::from(cmd));
    };
    let mut found = std::env::split_paths(path).map(|dir| {
        // An empty entry is the working directory, the job's.
        if dir.as_os_str().is_empty() {
            job_dir.join(cmd)
        } else {
            job_dir.join(dir).join(cmd)
        }
    });
    found
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| {
            format!(
                "cannot start executor {cmd:?}: no executable {cmd:?} in the executor's PATH ({}); install it or give its absolute path",
                path.to_string_lossy()
            )
        })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_executor_is_found_in_its_own_path_as_execvp_would() -> std::io::Result<()> {
        let job = tempfile::tempdir()?;
        let bin = job.path().join("bin");
        std::fs::create_dir(&bin)?;
        let trainer = bin.join("trainer");
        std::fs::write(&trainer, "#!/bin/sh\n")?;
        let not_executable = bin.join("notes");
        std::fs::write(&not_executable, "")?;
        let env = |path: &str| vec![("PATH".to_string(), OsString::from(path))];

        // Only an executable file counts; a relative entry is the job's directory's.
        assert!(find_program("trainer", &env("/nonexistent:bin"), job.path()).is_err());
        std::fs::set_permissions(
            &trainer,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        assert_eq!(
            find_program("trainer", &env("/nonexistent:bin"), job.path()),
            Ok(trainer)
        );
        let missing = find_program("notes", &env("/nonexistent:bin"), job.path());
        assert!(
            missing
                .as_ref()
                .is_err_and(|e| e.contains("/nonexistent:bin")),
            "{missing:?}"
        );
        // A path, or an executor without PATH, is the standard library's to resolve.
        assert_eq!(
            find_program("./run.sh", &env("bin"), job.path()),
            Ok(PathBuf::from("./run.sh"))
        );
        assert_eq!(
            find_program("true", &[], job.path()),
            Ok(PathBuf::from("true"))
        );
        Ok(())
    }

    #[test]
    fn an_executor_gets_the_base_environment_and_what_its_env_allows() {
        let worker: HashMap<&str, &str> = [
            ("PATH", "/usr/bin"),
            ("HOME", "/home/worker"),
            ("HF_TOKEN", "hf_secret"),
            ("AWS_SECRET_ACCESS_KEY", "aws_secret"),
            ("FOO", "bar"),
        ]
        .into();
        let allowed = [
            EnvVar::Pass("FOO".into()),
            EnvVar::Set("MODE".into(), "fast".into()),
            EnvVar::Pass("MISSING".into()),
            EnvVar::Set("PATH".into(), "/opt/bin".into()),
        ];
        let env = environment(&allowed, |name| worker.get(name).map(OsString::from));
        let env: Vec<(&str, &str)> = env
            .iter()
            .map(|(name, value)| (name.as_str(), value.to_str().unwrap_or("")))
            .collect();
        assert_eq!(
            env,
            [
                ("HOME", "/home/worker"),
                ("FOO", "bar"),
                ("MODE", "fast"),
                ("PATH", "/opt/bin")
            ]
        );
    }
}
