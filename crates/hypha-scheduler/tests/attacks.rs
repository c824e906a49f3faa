//! Attacks by certified peers on a real run (issue 34, `docs/threat-model.md`): each test
//! starts an honest run with real processes, lets an attacker with a certificate of its own
//! try one thing, and checks that the run's outcome is what it would have been without it and
//! that the attacker was refused with a logged reason.
//!
//! Run them with `cargo test -p hypha-scheduler --test attacks`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A second scheduler that knows a run's task id (here read from the run's record; a leaked
/// screen or log would do) and leases a free slot of the run's parameter-server worker, then
/// dispatches a parameter server of its own under that task id, as a scheduler does that
/// resumes a run record naming the task. Were it taken, it would own the task on that worker:
/// name the task's peers (so the honest trainers' updates would be refused there) and receive
/// what is sent within the task. The worker refuses it, naming both schedulers, and the honest
/// run trains every slice once as if the thief had not been there.
#[test]
fn a_second_scheduler_cannot_take_over_a_task_on_a_worker() {
    let cluster = Cluster::new();
    let _data = cluster.blobs_data_node("data");
    // Room for two parameter servers: the run's, and a slot the thief can lease.
    let mut ps = cluster.worker_with_executors(
        "ps",
        "price = 5\nstrategy = \"flexible\"\n",
        "cpu = 2\nmemory = 2\n",
        "[[executors]]\nclass = \"aggregate\"\nname = \"parameter-server\"\nruntime = \"parameter-server\"\n",
        &[],
    );
    let _trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job("victim", 2, 3, "");
    let (mut victim, _) = cluster.scheduler("victim", &job);

    // The run is under way: its record names the task, and a round was applied.
    let record = cluster.path("victim-job.run.json");
    let metrics = cluster.path("victim-job.metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(60);
    let task = loop {
        let task = std::fs::read_to_string(&record)
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|record| record["task"].as_str().map(str::to_string));
        let trained = std::fs::read_to_string(&metrics).is_ok_and(|m| m.contains("\"round\""));
        match task {
            Some(task) if trained => break task,
            _ => {
                assert!(Instant::now() < deadline, "the run never applied a round");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };

    // The thief: a scheduler of its own certificate, resuming a record that names the task,
    // with a trainer worker of its own and a higher bid for the parameter-server slot.
    let _thief_trainer = cluster.trainer_worker("thief-trainer", "");
    let thief_job = cluster.diloco_job("thief", 1, 1, "");
    let thief_toml = std::fs::read_to_string(&thief_job)
        .unwrap()
        .replace("bid = 20", "bid = 200");
    std::fs::write(&thief_job, thief_toml).unwrap();
    std::fs::write(
        cluster.path("thief-job.run.json"),
        serde_json::json!({ "task": task, "jobs": [], "uncommitted": [] }).to_string(),
    )
    .unwrap();
    let (mut thief, _) = cluster.scheduler("thief", &thief_job);
    let thief_id = cluster.peer_id("thief");
    let victim_id = cluster.peer_id("victim");

    let refusal = ps.wait_for("refused a job of a task another scheduler owns");
    assert!(
        refusal.contains(&thief_id) && refusal.contains(&victim_id) && refusal.contains(&task),
        "the refusal names both schedulers and the task: {refusal}"
    );

    let (ok, lines) = victim.wait(Duration::from_secs(180));
    thief.kill();
    assert!(ok, "the honest run failed:\n{}", lines.join("\n"));
    let errors: Vec<&String> = lines.iter().filter(|l| l.contains("ERROR")).collect();
    assert!(
        errors.is_empty(),
        "the honest scheduler logged errors: {errors:#?}"
    );
    assert_audit_passes(&cluster.path("victim-job.ledger"), 3, DILOCO_SLICES);
    while let Ok(line) = ps.lines.try_recv() {
        ps.seen.push(line);
    }
    let taken: Vec<&String> = ps
        .seen
        .iter()
        .filter(|l| l.contains("job dispatched") && l.contains(&thief_id))
        .collect();
    assert!(taken.is_empty(), "the thief's job ran: {taken:#?}");
}

/// What the attacking job does: writes into every artifact file of its directory in place,
/// and into every file of the worker's artifact store it can reach by walking up from there
/// (it runs as the worker's user, so it makes each writable first). Records the store files it
/// wrote in `attacked.txt` beside the job directories.
const SCRIBBLE: &str = r#"
import os, sys
job = sys.argv[1]
def scribble(path):
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"EVIL")
scribble(os.path.join(job, "model.bin"))
scribble(os.path.join(job, "env", "bin", "run.sh"))
store = os.path.join(os.path.dirname(job), ".artifacts", "store")
written = []
for base, _, names in os.walk(store):
    for name in names:
        scribble(os.path.join(base, name))
        written.append(name)
open(os.path.join(os.path.dirname(job), "attacked.txt"), "w").write("\n".join(written))
"#;

/// What a later job does: copies what it was given beside the job directories.
const READ: &str = r#"
import os, shutil, sys
job = sys.argv[1]
shutil.copy(os.path.join(job, "model.bin"), os.path.join(os.path.dirname(job), "later-model.bin"))
shutil.copy(os.path.join(job, "env", "bin", "run.sh"), os.path.join(os.path.dirname(job), "later-run.sh"))
"#;

/// A Python job writes into its artifacts in place (`open('r+b')`), and into the worker's
/// artifact store itself, as a hostile executor would to plant code in an environment that
/// later jobs of every task on that worker unpack and run. Each job gets its own copy of an
/// artifact, so the first write stays in the attacker's directory; the store's own files are
/// stamped, so the second is found at the next job's cache hit, and the damaged chunks and the
/// unpacked tree are fetched and unpacked again. The later job gets the origin's bytes.
/// (Checked by trusting the store's files without their stamps: the later job does not get
/// the origin's bytes; its damaged archive no longer unpacked.)
#[test]
fn a_job_cannot_change_what_later_jobs_get_from_the_artifact_store() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let origin = tempfile::tempdir().unwrap();
    let s3 = runtime
        .block_on(hypha_testing::s3::S3Server::start(origin.path(), None))
        .unwrap();
    let model = hypha_testing::s3::pattern(3 << 20, 7);
    let script = b"#!/bin/sh\necho hello\n".to_vec();
    let archive = hypha_testing::s3::tar_gz(&[("bin/run.sh", &script)]).unwrap();
    runtime.block_on(async {
        s3.put("model.bin", model.clone()).await.unwrap();
        s3.put("env.tar.gz", archive).await.unwrap();
    });

    let cluster = Cluster::new();
    let python = |name: &str, code: &str| {
        format!(
            "[[executors]]\nclass = \"test\"\nname = \"{name}\"\nruntime = \"process\"\ncmd = \"python3\"\nargs = [\"-c\", {code:?}, \"{{WORK_DIR}}\"]\n"
        )
    };
    let executors = format!(
        "{}{}[artifacts]\norigin_audit = 0.0\n{}",
        python("scribble", SCRIBBLE),
        python("read", READ),
        s3.profile_toml("default")
    );
    let mut worker = cluster.worker_with_executors("shared", "", "", &executors, &[]);
    let job = |name: &str, executor: &str| {
        cluster.job(
            name,
            &format!(
                "workers = 1\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"{executor}\"\n\n[[artifacts]]\nuri = \"model.bin\"\ndestination = \"model.bin\"\n\n[[artifacts]]\nuri = \"env.tar.gz\"\ndestination = \"env.tar.gz\"\nunpack = {{ destination = \"env\" }}\n"
            ),
        )
    };
    for (name, executor) in [("attacker", "scribble"), ("later", "read")] {
        let (mut scheduler, _) = cluster.scheduler(name, &job(name, executor));
        let (ok, lines) = scheduler.wait(Duration::from_secs(90));
        assert!(ok, "{name}: {}", lines.join("\n"));
    }

    let work = cluster.path("shared-work");
    let attacked = std::fs::read_to_string(work.join("attacked.txt")).unwrap();
    assert!(
        attacked.contains("model.bin") && attacked.contains("run.sh"),
        "the attack reached the store's files: {attacked}"
    );
    assert!(
        std::fs::read(work.join("later-model.bin")).unwrap() == model,
        "the later job got the attacker's model"
    );
    assert_eq!(
        std::fs::read(work.join("later-run.sh")).unwrap(),
        script,
        "the later job got the attacker's environment"
    );
    worker.wait_for("changed on disk since they were fetched");
}
