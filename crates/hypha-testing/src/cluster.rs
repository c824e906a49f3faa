//! Real processes for tests and benchmarks: building the workspace's
//! binaries, a cluster of them (gateway, workers, schedulers, data nodes) with real
//! certificates in a temporary directory, and reading what they leave behind (ledger audits,
//! events files).
//!
//! Everything here panics on failure: it is for tests and benchmark harnesses, which should
//! fail loudly at the step that went wrong.

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, OnceLock, mpsc},
    time::{Duration, Instant},
};

use hypha_certs::{
    Role, Roles,
    authority::{self, Authority, Validity},
};
use hypha_executor::{model::ModelSpec, synthetic::Synthetic};
use hypha_ledger::{Event, ReturnReason};

/// The path of one of the workspace's binaries, in the profile directory of the running
/// program (a test in `target/debug/deps`, a benchmark in `target/release`). `cargo test
/// --workspace` (the README's test command) builds them all before any test runs; a plain
/// `cargo test -p hypha-scheduler` does not, so a missing one is built here. (Building
/// unconditionally would re-resolve features for that one package and relink it on every
/// run.)
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    if !path.exists() && !built.contains(name) {
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "--quiet", "--package", name, "--bin", name]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().unwrap();
        assert!(status.success(), "building {name}");
        built.insert(name.to_string());
    }
    path
}

/// The `RUST_LOG` of the nodes a test starts: `info`, or `CLUSTER_RUST_LOG` where set (say
/// `info,hypha_network=debug` to see every connection).
fn node_log_filter() -> String {
    std::env::var("CLUSTER_RUST_LOG").unwrap_or_else(|_| "info".into())
}

/// `CLUSTER_KEEP`, where set: the folder where a test's clusters stay after it ends (their
/// configs, work folders, events and metrics), each node's log beside them, to read what a
/// flaky run did.
fn kept_in() -> Option<PathBuf> {
    std::env::var_os("CLUSTER_KEEP").map(PathBuf::from)
}

/// A gateway and the nodes a test starts beside it, in one temporary directory with one
/// certificate authority.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub org: Authority,
    pub gateway: Option<Proc>,
    pub gateway_address: String,
    /// The `[offer] lease_ms` of the workers it starts; `None`: the workers' default.
    pub worker_lease_ms: Option<u64>,
    /// The `prefetch_bytes` of the workers it starts; `None`: the workers' default.
    pub worker_prefetch_bytes: Option<u64>,
    /// Where the nodes it starts next run: 127.0.0.1 unless a benchmark puts them behind a
    /// slow link ([`netns`](crate::netns)).
    pub place: Place,
}

/// Where a node runs: the address others reach it at, the network namespace it runs in
/// (`None`: this process's), and whether it listens on every interface (`0.0.0.0`, as `init`
/// writes) rather than on `ip` alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub ip: String,
    pub netns: Option<String>,
    pub every_interface: bool,
    /// The port a node here listens on; 0: a free one.
    pub port: u16,
}

impl Place {
    pub fn loopback() -> Self {
        Self {
            ip: "127.0.0.1".into(),
            netns: None,
            every_interface: false,
            port: 0,
        }
    }

    /// The address a node here listens on.
    fn listen(&self) -> String {
        let ip = if self.every_interface {
            "0.0.0.0"
        } else {
            &self.ip
        };
        format!("/ip4/{ip}/tcp/{}", self.port)
    }
}

impl Cluster {
    pub fn new() -> Self {
        Self::at(Place::loopback())
    }

    /// A cluster whose gateway (and every node until [`place`](Self::place) changes) runs at
    /// `place`.
    pub fn at(place: Place) -> Self {
        let dir = match kept_in() {
            Some(keep) => {
                std::fs::create_dir_all(&keep).unwrap();
                let dir = tempfile::Builder::new()
                    .prefix("cluster-")
                    .disable_cleanup(true)
                    .tempdir_in(keep)
                    .unwrap();
                eprintln!("cluster kept in {}", dir.path().display());
                dir
            }
            None => tempfile::tempdir().unwrap(),
        };
        let root = authority::create_root("Market Root", Validity::days(5)).unwrap();
        let org = authority::create_org(&root, "Market Org", Validity::days(5)).unwrap();
        std::fs::write(dir.path().join("root.pem"), root.cert_pem()).unwrap();
        let mut cluster = Cluster {
            dir,
            org,
            gateway: None,
            gateway_address: String::new(),
            // Short, so that tests of lapsing leases are quick.
            worker_lease_ms: Some(3000),
            worker_prefetch_bytes: None,
            place,
        };
        let config = cluster.config("gateway", Role::Gateway, "");
        let mut gateway = cluster.run_node("hypha-gateway", &config, "gateway");
        // One line per address it listens on: the one others reach it at.
        let line = gateway.wait_for(&format!(
            "nodes can join with gateway_addresses = [\"/ip4/{}/",
            cluster.place.ip
        ));
        let start = line.find("[\"").unwrap() + 2;
        let end = line[start..].find('"').unwrap() + start;
        cluster.gateway_address = line[start..end].to_string();
        cluster.gateway = Some(gateway);
        cluster
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Certificates for `name` granting `roles` and a config joining the gateway, with
    /// `extra` appended. Returns the config's path.
    pub fn config(&self, name: &str, roles: impl Into<Roles>, extra: &str) -> PathBuf {
        let roles = roles.into();
        let node = authority::create_node(&self.org, name, &[], roles, Validity::days(1)).unwrap();
        std::fs::write(self.path(&format!("{name}-cert.pem")), node.chain_pem()).unwrap();
        std::fs::write(self.path(&format!("{name}-key.pem")), node.key_pem()).unwrap();
        let gateways = if self.gateway_address.is_empty() {
            String::new()
        } else {
            format!("gateway_addresses = [\"{}\"]\n", self.gateway_address)
        };
        let path = self.path(&format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "cert_pem = \"{name}-cert.pem\"\nkey_pem = \"{name}-key.pem\"\ntrust_pem = \"root.pem\"\nlisten_addresses = [\"{}\"]\n{gateways}{extra}",
                self.place.listen()
            ),
        )
        .unwrap();
        path
    }

    /// Starts node `name` with `start`; its peer id and process.
    pub fn peer_id_after(&self, name: &str, start: impl FnOnce(&Self) -> Proc) -> (String, Proc) {
        let proc = start(self);
        (self.peer_id(name), proc)
    }

    pub fn peer_id(&self, name: &str) -> String {
        let chain = std::fs::read(self.path(&format!("{name}-cert.pem"))).unwrap();
        let key = std::fs::read(self.path(&format!("{name}-key.pem"))).unwrap();
        hypha_certs::NodeIdentity::from_pem(&chain, &key)
            .unwrap()
            .peer_id()
            .to_string()
    }

    /// Starts a worker whose executor `sh` runs `script` in the job's directory.
    pub fn worker(&self, name: &str, offer: &str, resources: &str, script: &str) -> Proc {
        self.worker_with_env(name, offer, resources, script, &[])
    }

    /// [`worker`](Self::worker) with extra environment variables, which its executor gets
    /// too.
    pub fn worker_with_env(
        &self,
        name: &str,
        offer: &str,
        resources: &str,
        script: &str,
        env: &[(&str, String)],
    ) -> Proc {
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        let executors = format!(
            "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {script:?}, \"executor\", \"{{WORK_DIR}}\", \"{{SOCKET_PATH}}\"]\nenv = {names:?}\n"
        );
        self.worker_with_executors(name, offer, resources, &executors, env)
    }

    /// Starts a worker with `executors` (`[[executors]]` tables) and extra environment.
    pub fn worker_with_executors(
        &self,
        name: &str,
        offer: &str,
        resources: &str,
        executors: &str,
        env: &[(&str, String)],
    ) -> Proc {
        let work = self.path(&format!("{name}-work"));
        let lease = self
            .worker_lease_ms
            .map_or(String::new(), |ms| format!("lease_ms = {ms}\n"));
        let prefetch = self
            .worker_prefetch_bytes
            .map_or(String::new(), |bytes| format!("prefetch_bytes = {bytes}\n"));
        let extra = format!(
            "work_dir = \"{}\"\nkill_grace_ms = 1000\n{prefetch}[resources]\n{resources}\n[offer]\n{lease}{offer}\n{executors}",
            work.display()
        );
        let config = self.config(name, Role::Worker, &extra);
        let mut command_env: Vec<(&str, &str)> =
            env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let log = node_log_filter();
        command_env.push(("RUST_LOG", &log));
        let args = ["run".as_ref(), "--config".as_ref(), config.as_os_str()];
        let mut worker = Proc::spawn_in(
            self.place.netns.as_deref(),
            &bin("hypha-worker"),
            &args,
            &command_env,
            name,
        );
        worker.wait_for("worker ready for advertisements");
        worker
    }

    /// Starts node `name` of program `bin_name` again with the config and identity it had, as
    /// after its machine restarted, and waits until it logged `ready`.
    pub fn restart(&self, name: &str, bin_name: &str, ready: &str) -> Proc {
        let config = self.path(&format!("{name}.toml"));
        let mut node = self.run_node(bin_name, &config, name);
        node.wait_for(ready);
        node
    }

    /// Starts `bin_name run --config CONFIG` at the cluster's [`place`](Self::place).
    pub fn run_node(&self, bin_name: &str, config: &Path, name: &str) -> Proc {
        self.run_at_place(
            bin_name,
            &["run".as_ref(), "--config".as_ref(), config.as_os_str()],
            name,
        )
    }

    /// Starts `bin_name` with `args` at the cluster's [`place`](Self::place), logging at
    /// info.
    pub fn run_at_place(&self, bin_name: &str, args: &[&std::ffi::OsStr], name: &str) -> Proc {
        Proc::spawn_in(
            self.place.netns.as_deref(),
            &bin(bin_name),
            args,
            &[("RUST_LOG", &node_log_filter())],
            name,
        )
    }

    pub fn job(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(&format!("{name}-job.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Starts a scheduler running `job`; its events go to `<name>-events.jsonl`.
    pub fn scheduler(&self, name: &str, job: &Path) -> (Proc, PathBuf) {
        self.config(name, Role::Scheduler, "");
        self.restart_scheduler(name, job)
    }

    /// Starts scheduler `name` again, with the identity and config it had.
    pub fn restart_scheduler(&self, name: &str, job: &Path) -> (Proc, PathBuf) {
        let config = self.path(&format!("{name}.toml"));
        let events = self.path(&format!("{name}-events.jsonl"));
        let proc = self.run_at_place(
            "hypha-scheduler",
            &[
                "run".as_ref(),
                "--job".as_ref(),
                job.as_os_str(),
                "--events".as_ref(),
                events.as_os_str(),
                "--config".as_ref(),
                config.as_os_str(),
            ],
            name,
        );
        (proc, events)
    }

    /// What `hypha-scheduler progress --json` says of scheduler `name`, which logged the
    /// `listening` line, to an operator (a peer of its own with the `operator` role).
    pub fn progress(&self, name: &str, listening: &str) -> serde_json::Value {
        if !self.path("operator.toml").exists() {
            self.config("operator", Role::Operator, "");
        }
        self.progress_as(name, listening, "operator")
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// What `hypha-scheduler progress --json` says of scheduler `name` to node `asker` (whose
    /// config [`config`](Self::config) wrote), or what it printed when it failed.
    pub fn progress_as(
        &self,
        name: &str,
        listening: &str,
        asker: &str,
    ) -> Result<serde_json::Value, String> {
        let address = listening
            .split("address=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {listening:?}"));
        let out = Command::new(bin("hypha-scheduler"))
            .args([
                "progress",
                &format!("{address}/p2p/{}", self.peer_id(name)),
                "--json",
                "--config",
            ])
            .arg(self.path(&format!("{asker}.toml")))
            .output()
            .unwrap();
        if out.status.success() {
            Ok(serde_json::from_slice(&out.stdout).unwrap())
        } else {
            Err(format!("{out:?}"))
        }
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("dir", &self.dir.path())
            .field("gateway_address", &self.gateway_address)
            .finish_non_exhaustive()
    }
}

/// `program`, to run in the network namespace `netns` (`None`: this process's).
pub fn command_in(netns: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match netns {
        Some(netns) => {
            let mut command = Command::new("ip");
            command.args(["netns", "exec", netns]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// A running program whose stderr is collected line by line; killed when dropped.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
    pub name: String,
}

impl Proc {
    pub fn start(bin: &Path, args: &[&str], config: &Path, name: &str) -> Self {
        let mut all: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
        all.push(config.as_os_str());
        Self::start_with(bin, &all, name)
    }

    pub fn start_with(bin: &Path, args: &[&std::ffi::OsStr], name: &str) -> Self {
        Self::spawn(bin, args, &[("RUST_LOG", &node_log_filter())], name)
    }

    pub fn spawn(bin: &Path, args: &[&std::ffi::OsStr], env: &[(&str, &str)], name: &str) -> Self {
        Self::spawn_in(None, bin, args, env, name)
    }

    /// [`spawn`](Self::spawn) in the network namespace `netns` (`ip netns exec`, which execs
    /// the program: the child is the program itself).
    pub fn spawn_in(
        netns: Option<&str>,
        bin: &Path,
        args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        name: &str,
    ) -> Self {
        let mut command = command_in(netns, bin);
        command.args(args).envs(env.iter().copied());
        Self::from_command(command, name)
    }

    /// Starts `command` (its stdout discarded, its stderr collected).
    pub fn from_command(mut command: Command, name: &str) -> Self {
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        let mut kept_log = kept_in().map(|keep| {
            std::fs::File::create(keep.join(format!("{name}-{}.log", child.id()))).unwrap()
        });
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(log) = kept_log.as_mut() {
                    let _ = writeln!(log, "{line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            lines,
            seen: Vec::new(),
            name: name.to_string(),
        }
    }

    pub fn wait_for(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        panic!(
            "{} never logged {needle:?}; it logged:\n{}",
            self.name,
            self.seen.join("\n")
        );
    }

    /// Waits for the process to exit; returns its success and everything it logged. A
    /// process still running at the limit is killed and reported as failed.
    pub fn wait(&mut self, limit: Duration) -> (bool, Vec<String>) {
        let deadline = Instant::now() + limit;
        loop {
            if Instant::now() >= deadline {
                self.kill();
                self.seen
                    .push(format!("(killed: still running after {limit:?})"));
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(line);
                }
                return (status.success(), self.seen.clone());
            }
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Everything it logged so far, without waiting.
    pub fn logged(&mut self) -> &[String] {
        self.seen.extend(self.lines.try_iter());
        &self.seen
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The one job directory a worker made under its work_dir.
pub fn job_dir(work: &Path) -> PathBuf {
    std::fs::read_dir(work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("hypha-")
        })
        .unwrap()
}

/// A data node serving `dataset_path`, announced.
pub fn data_node(cluster: &Cluster, name: &str, dataset_path: &Path) -> Proc {
    let config = cluster.config(
        name,
        Role::Data,
        &format!(
            "dataset_path = {dataset_path:?}
"
        ),
    );
    let mut node = cluster.run_node("hypha-data", &config, name);
    node.wait_for("announced");
    node
}

/// How often the ledger at `path` recorded each (epoch, slice) USED, and the reasons slices
/// went back to AVAILABLE.
pub fn audit(path: &Path) -> (HashMap<(u32, u64), u32>, Vec<ReturnReason>) {
    let audit = hypha_ledger::read_audit(path).unwrap();
    let mut used = HashMap::new();
    let mut returned = Vec::new();
    for record in &audit.records {
        match &record.event {
            Event::Used { .. } => {
                *used
                    .entry((record.key.epoch, record.key.slice))
                    .or_default() += 1;
            }
            Event::Returned { reason, .. } => returned.push(*reason),
            _ => {}
        }
    }
    (used, returned)
}

/// Runs `hypha-scheduler audit LEDGER --finished --json` as an operator would, asserts that
/// it passed (exit 0) with every slice of `epochs` epochs of `slices` slices used, and returns
/// its report.
pub fn assert_audit_passes(ledger: &Path, epochs: u32, slices: u64) -> serde_json::Value {
    let output = Command::new(bin("hypha-scheduler"))
        .arg("audit")
        .arg(ledger)
        .args(["--finished", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "audit of {ledger:?} failed: {stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["exactly_once"], true, "{report:#}");
    assert_eq!(report["slices"], slices, "{report:#}");
    let used: Vec<u64> = report["epochs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["used"].as_u64().unwrap())
        .collect();
    assert_eq!(used, vec![slices; epochs as usize], "{report:#}");
    report
}

pub fn assert_each_used_once(used: &HashMap<(u32, u64), u32>, epochs: u32, slices: u64) {
    for epoch in 0..epochs {
        for slice in 0..slices {
            assert_eq!(
                used.get(&(epoch, slice)),
                Some(&1),
                "epoch {epoch} slice {slice}"
            );
        }
    }
    assert_eq!(used.len() as u64, u64::from(epochs) * slices);
}

/// The events in a scheduler's events file; a last line still being written is left out.
pub fn events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_inclusive('\n')
        .filter(|line| line.ends_with('\n'))
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

pub fn of_kind<'a>(events: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    events
        .iter()
        .filter(|e| e["event"]["kind"] == kind)
        .collect()
}

/// The model the DiLoCo dataset `blobs` is made for.
pub const DILOCO_MODEL: ModelSpec = ModelSpec::Mlp {
    inputs: 16,
    hidden: 32,
    classes: 4,
};
/// The repository's Python SDK and its examples and tests (`python/`).
pub fn python_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
    dir.canonicalize().unwrap_or(dir)
}

/// Whether `python3` runs and imports `modules`; where it does not, the test that asked says
/// it skipped. `ci_installs`: CI installs them (`.ci/run`), so where `CI` is set their absence
/// fails the test instead.
pub fn python_with(modules: &[&str], ci_installs: bool) -> bool {
    let imports = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let found = std::process::Command::new("python3")
        .args(["-c", &format!("{imports}\n")])
        .output()
        .is_ok_and(|out| out.status.success());
    if !found {
        let what = format!("python3 with {modules:?}");
        assert!(
            !ci_installs || std::env::var_os("CI").is_none(),
            "{what} is missing; .ci/run installs it"
        );
        eprintln!("SKIPPED: {what} is not installed");
    }
    found
}

/// The slices of `blobs` (64 samples each).
pub const DILOCO_SLICES: u64 = 24;

/// DiLoCo on a cluster: the learnable dataset `blobs`, parameter-server and trainer workers,
/// a job that trains on them.
impl Cluster {
    /// A data node serving `blobs` (written under `data/`): learnable by [`DILOCO_MODEL`].
    pub fn blobs_data_node(&self, name: &str) -> Proc {
        Synthetic::for_model(&DILOCO_MODEL)
            .write(&self.path("data/blobs"), DILOCO_SLICES as usize, 64, 0)
            .unwrap();
        data_node(self, name, &self.path("data"))
    }

    /// A worker that runs the built-in parameter server.
    pub fn server_worker(&self, name: &str) -> Proc {
        self.worker_with_executors(
            name,
            "price = 5\n",
            "cpu = 1\nmemory = 1\n",
            "[[executors]]\nclass = \"aggregate\"\nname = \"parameter-server\"\nruntime = \"parameter-server\"\n",
            &[],
        )
    }

    /// A worker whose executor `train/diloco` is the reference trainer (`hypha-executor
    /// train`); it also offers `executors`.
    pub fn trainer_worker(&self, name: &str, executors: &str) -> Proc {
        self.trainer_worker_with_args(name, &[], executors)
    }

    /// [`trainer_worker`](Self::trainer_worker), with `args` after the trainer's usual ones
    /// (`--synthetic-updates`).
    pub fn trainer_worker_with_args(&self, name: &str, args: &[&str], executors: &str) -> Proc {
        let args: String = args.iter().map(|arg| format!(", {arg:?}")).collect();
        let executor = format!(
            "[[executors]]\nclass = \"train\"\nname = \"diloco\"\nruntime = \"process\"\ncmd = {:?}\nargs = [\"train\", \"--socket\", \"{{SOCKET_PATH}}\", \"--work-dir\", \"{{WORK_DIR}}\", \"--job\", \"{{JOB_JSON}}\"{args}]\n{executors}",
            bin("hypha-executor").display().to_string()
        );
        self.worker_with_executors(name, "price = 10\n", "cpu = 1\n", &executor, &[])
    }

    /// A worker whose executor `class`/`name` is the Python script `script` (relative to the
    /// repository's `python/`), started as the SDK's executors are (`--socket`,
    /// `--work-dir`, `--job`), with the SDK on its `PYTHONPATH` and `env` in its environment.
    pub fn python_worker(
        &self,
        name: &str,
        class: &str,
        executor: &str,
        script: &str,
        env: &[(&str, String)],
    ) -> Proc {
        let python = python_dir();
        let mut env = env.to_vec();
        env.push(("PYTHONPATH", python.display().to_string()));
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        let executors = format!(
            "[[executors]]\nclass = {class:?}\nname = {executor:?}\nruntime = \"process\"\ncmd = \"python3\"\nargs = [{:?}, \"--socket\", \"{{SOCKET_PATH}}\", \"--work-dir\", \"{{WORK_DIR}}\", \"--job\", \"{{JOB_JSON}}\"]\nenv = {names:?}\n",
            python.join(script).display().to_string()
        );
        self.worker_with_executors(name, "price = 10\n", "cpu = 1\n", &executors, &env)
    }

    /// A DiLoCo job file `name` on `blobs`: `workers` trainers, `epochs` epochs, `extra` lines
    /// in its `[diloco]` table (`round_seconds` there replaces the default of 5 s). Rounds of
    /// 768 samples: 8 inner steps each for 3 trainers, which the model needs to halve its loss
    /// in the 2 epochs of a test (with 4 steps it does not).
    pub fn diloco_job(
        &self,
        name: &str,
        workers: impl std::fmt::Display,
        epochs: u32,
        extra: &str,
    ) -> PathBuf {
        self.job(name, &diloco_job_text(workers, epochs, 32, extra))
    }
}

/// The text of a DiLoCo job of `workers` trainers of the reference MLP (two hidden layers of
/// width `hidden`, about `hidden²` parameters) on the `blobs` dataset for `epochs`, with
/// `extra` lines in its `[diloco]` table (`round_seconds = 5` and `samples_per_round = 768`
/// unless they set them).
pub fn diloco_job_text(
    workers: impl std::fmt::Display,
    epochs: u32,
    hidden: usize,
    extra: &str,
) -> String {
    let round_seconds = if extra.contains("round_seconds") {
        ""
    } else {
        "round_seconds = 5\n"
    };
    let samples_per_round = if extra.contains("samples_per_round") {
        ""
    } else {
        "samples_per_round = 768\n"
    };
    format!(
        "workers = {workers}\nbid = 50\nmax_attempts = 3\n\
         [executor]\nclass = \"train\"\nname = \"diloco\"\n\
         [resources]\ncpu = 1\n\
         [config]\nseed = 1\nmodel = {{ type = \"mlp\", inputs = 16, hidden = {hidden}, classes = 4 }}\n\
         [data]\ndataset = \"blobs\"\nepochs = {epochs}\nseed = 3\n\
         [diloco]\n{samples_per_round}batch_size = 32\n{round_seconds}\
         inner = {{ learning_rate = 0.003, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999 }}\n{extra}\
         [diloco.parameter_server]\nbid = 20\nexecutor = {{ class = \"aggregate\", name = \"parameter-server\" }}\n"
    )
}
