//! What a job may not learn from the worker that runs it: the worker's environment (its
//! `HF_TOKEN`, cloud credentials) beyond what the executor's config allows, and its secrets
//! once it has ended. Real processes, real certificates, loopback TCP.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::time::Duration;

use common::Cluster;

#[test]
fn an_executor_sees_only_the_environment_its_config_allows_and_its_secrets_go_with_it() {
    let cluster = Cluster::new();
    // The executor copies what it can see: its environment, and its secrets while it runs.
    let script = r#"env > "$1/env.txt"; cp "$1/secrets.json" "$1/seen-secrets.json""#;
    let executors = format!(
        "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {script:?}, \"executor\", \"{{WORK_DIR}}\"]\nenv = [\"FOO\", \"MODE=fast\"]\n"
    );
    let _worker = cluster.worker_with_executors(
        "worker",
        "price = 1.0",
        "cpu = 1",
        &executors,
        &[
            ("HF_TOKEN", "hf_worker_secret".into()),
            ("AWS_SECRET_ACCESS_KEY", "aws_worker_secret".into()),
            ("FOO", "bar".into()),
        ],
    );
    let job = cluster.job(
        "leaky",
        "workers = 1\nbid = 10\nmax_attempts = 1\n[executor]\nclass = \"test\"\nname = \"sh\"\n[secrets]\nwandb = \"job_secret\"\n",
    );
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(ok, "{}", logs.join("\n"));

    let job_dir = std::fs::read_dir(cluster.path("worker-work"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("hypha-"))
        .unwrap()
        .path();
    let env = std::fs::read_to_string(job_dir.join("env.txt")).unwrap();
    let names: Vec<&str> = env
        .lines()
        .filter_map(|line| line.split_once('=').map(|(name, _)| name))
        .collect();
    assert!(!env.contains("worker_secret"), "{env}");
    assert!(
        env.lines().any(|l| l == "FOO=bar") && env.lines().any(|l| l == "MODE=fast"),
        "{env}"
    );
    assert!(names.contains(&"PATH"), "{env}");
    // Nothing else of the worker's (its RUST_LOG, the test runner's variables) got through;
    // `sh` itself adds PWD, SHLVL and `_`.
    let allowed = [
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR", "FOO", "MODE", "PWD",
        "SHLVL", "_", "OLDPWD",
    ];
    let extra: Vec<&&str> = names.iter().filter(|n| !allowed.contains(n)).collect();
    assert!(extra.is_empty(), "{extra:?} in\n{env}");
    // The secrets were there for the executor, and are gone with the job.
    assert!(
        std::fs::read_to_string(job_dir.join("seen-secrets.json"))
            .unwrap()
            .contains("job_secret")
    );
    assert!(!job_dir.join("secrets.json").exists());
}
