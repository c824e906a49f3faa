//! What a person who starts a job sees when it cannot work: a job whose model does not fit the
//! dataset is refused before any worker is leased, an executor's own words reach the
//! scheduler's console and events, and a worker whose `work_dir` is too long for a Unix socket
//! path still serves its jobs a bridge. Real processes, real certificates, loopback TCP.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use hypha_certs::Role;
use std::time::Duration;

use common::{Cluster, Proc, bin, data_node, events, of_kind};

const DILOCO: &str = "workers = 1\nbid = 10\n[executor]\nclass = \"train\"\nname = \"diloco\"\n[data]\ndataset = \"digits\"\n[diloco]\nsamples_per_round = 64\nbatch_size = 16\n[diloco.parameter_server]\nbid = 10\nexecutor = { class = \"aggregate\", name = \"parameter-server\" }\n";

#[test]
fn a_job_whose_tensors_do_not_fit_is_refused_before_any_lease() {
    let cluster = Cluster::new();
    let data = cluster.path("datasets/digits");
    hypha_dataset::testing::seed_recipe_dataset(&data, 2, 32, 1);
    let _node = data_node(&cluster, "data", &data);
    // A worker that would take the job, so that a lease could happen if the check did not.
    let mut worker = cluster.worker_with_executors(
        "trainer",
        "price = 1.0",
        "cpu = 4\nmemory = 4",
        "[[executors]]\nclass = \"train\"\nname = \"diloco\"\nruntime = \"process\"\ncmd = \"true\"\n[[executors]]\nclass = \"aggregate\"\nname = \"parameter-server\"\nruntime = \"parameter-server\"\n",
        &[],
    );
    let job = cluster.job(
        "misfit",
        &format!(
            "{DILOCO}[config]\nmodel = {{ type = \"mlp\", inputs = 16, hidden = 8, classes = 10 }}\n"
        ),
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(
        !ok,
        "a job that cannot train must fail:\n{}",
        logs.join("\n")
    );
    let said = logs.join("\n");
    assert!(
        said.contains("tensor \"images\" is F32 [32, 1, 8, 8]")
            && said.contains("the mlp expects inputs = 16")
            && said.contains("set `inputs = 64`"),
        "the error names the tensor, the expectation and the fix:\n{said}"
    );
    assert!(
        of_kind(&events(&events_path), "leased").is_empty(),
        "nothing was leased"
    );
    assert!(
        !cluster.path("misfit-job.ledger").exists(),
        "no ledger was started for a job that cannot run"
    );
    // No advertisement went out, so the worker never offered.
    worker.kill();
    let (_, worker_logs) = worker.wait(Duration::from_secs(5));
    assert!(
        !worker_logs.iter().any(|l| l.contains("offering")),
        "{worker_logs:#?}"
    );

    // The same job with the fix named in the error is accepted by the check.
    let spec = hypha_scheduler::spec::JobFile::parse(
        "fixed.toml",
        &format!(
            "{DILOCO}[config]\nmodel = {{ type = \"mlp\", inputs = 64, hidden = 8, classes = 10 }}\n"
        ),
    )
    .unwrap();
    let manifest = hypha_dataset::Dataset::open(&data).unwrap();
    spec.check_dataset(manifest.manifest()).unwrap();
}

#[test]
fn an_executors_last_stderr_lines_reach_the_scheduler_and_its_events() {
    let cluster = Cluster::new();
    let _worker = cluster.worker(
        "worker",
        "price = 1.0",
        "cpu = 2\nmemory = 2",
        "echo 'loading the model' >&2; echo 'ValueError: labels must be integers' >&2; exit 3",
    );
    let job = cluster.job(
        "failing",
        "workers = 1\nbid = 10\nmax_attempts = 1\n[executor]\nclass = \"test\"\nname = \"sh\"\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(!ok);
    let console = logs.join("\n");
    assert!(
        console.contains("exit code 3")
            && console.contains("loading the model")
            && console.contains("ValueError: labels must be integers"),
        "the console shows the executor's own words:\n{console}"
    );
    let last_line = logs.iter().rposition(|l| l.starts_with("error:")).unwrap();
    assert!(
        logs[last_line..]
            .iter()
            .any(|l| l.contains("ValueError: labels must be integers")),
        "the final error carries them too:\n{console}"
    );
    let events = events(&events_path);
    let failed = of_kind(&events, "status")
        .into_iter()
        .find(|e| e["event"]["status"]["Finished"]["exit_code"] == 3)
        .unwrap_or_else(|| panic!("{events:#?}"));
    let tail: Vec<&str> = failed["event"]["status"]["Finished"]["stderr_tail"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert_eq!(
        tail,
        ["loading the model", "ValueError: labels must be integers"]
    );
    let done = of_kind(&events, "done");
    assert!(
        done[0]["event"]["message"]
            .as_str()
            .unwrap()
            .contains("ValueError"),
        "{done:#?}"
    );
}

#[test]
fn a_worker_with_a_long_work_dir_serves_its_jobs_a_bridge() {
    let cluster = Cluster::new();
    let long = cluster.path(&format!("{}/{}/work", "w".repeat(80), "x".repeat(80)));
    assert!(long.as_os_str().len() > 150);
    // The executor reaches the bridge at {SOCKET_PATH}, and through the job directory's
    // bridge.sock from inside it, as the README's curl example does.
    let script = r#"[ ${#2} -lt 108 ] || { echo "socket path too long: $2" >&2; exit 4; }
curl -sf --unix-socket "$2" http://bridge/openapi.json > /dev/null || exit 5
cd "$1" && curl -sf --unix-socket bridge.sock http://bridge/openapi.json > /dev/null || exit 6"#;
    let executors = format!(
        "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {script:?}, \"executor\", \"{{WORK_DIR}}\", \"{{SOCKET_PATH}}\"]\n"
    );
    let config = cluster.config(
        "worker",
        Role::Worker,
        &format!(
            "work_dir = {long:?}\n[resources]\ncpu = 2\nmemory = 2\n[offer]\nprice = 1.0\n{executors}"
        ),
    );
    let mut worker = Proc::start(
        &bin("hypha-worker"),
        &["run", "--config"],
        &config,
        "worker",
    );
    worker.wait_for("job bridge sockets go to a private directory");
    worker.wait_for("worker ready for advertisements");
    let job = cluster.job(
        "bridge",
        "workers = 1\nbid = 10\nmax_attempts = 1\n[executor]\nclass = \"test\"\nname = \"sh\"\n",
    );
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(ok, "{}", logs.join("\n"));
    let job_dir = common::job_dir(&long);
    assert!(
        !job_dir.join("bridge.sock").exists()
            && job_dir.join("bridge.sock").symlink_metadata().is_err(),
        "the socket and its link go with the job"
    );
}
