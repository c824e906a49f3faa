//! Artifacts in jobs, with real processes: a job file's `[[artifacts]]` reach every worker's
//! job directory before its executor starts, each chunk read from the (in-process) S3 origin
//! once, and executors fetch more through the bridge's `{"type": "Artifact"}`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use hypha_certs::Role;
use std::{os::unix::fs::MetadataExt, process::Command, time::Duration};

use common::{Cluster, job_dir};
use hypha_testing::s3::{S3Server, pattern};
use sha2::{Digest, Sha256};

/// Calls the bridge's Artifact fetch for a prefix and records the answer in results.txt.
const EXECUTOR: &str = r#"D="$1"; S="$2"
code=$(curl -s -o "$D/resp.json" -w '%{http_code}' --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"fetch":{"type":"Artifact","uri":"tokenizer/","kind":"prefix"},"out_dir":"tok"}' http://bridge/resources/fetch)
echo "prefix $code $(cat "$D/resp.json")" >> "$D/results.txt"
code=$(curl -s -o "$D/resp.json" -w '%{http_code}' --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"fetch":{"type":"Artifact","profile":"nope","uri":"model.bin"},"out_dir":"x"}' http://bridge/resources/fetch)
echo "unknown-profile $code $(cat "$D/resp.json")" >> "$D/results.txt"
exit 0"#;

#[test]
fn job_artifacts_reach_every_worker_with_each_chunk_read_once() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = tempfile::tempdir().unwrap();
    let s3 = runtime
        .block_on(S3Server::start(store.path(), Some(32 << 20)))
        .unwrap();
    let model = pattern(6 << 20, 7);
    let archive_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(archive_dir.path().join("env/bin")).unwrap();
    std::fs::write(archive_dir.path().join("env/bin/run.sh"), "echo hello\n").unwrap();
    let tar = Command::new("tar")
        .args(["czf", "env.tar.gz", "-C", "env", "."])
        .current_dir(archive_dir.path())
        .status()
        .unwrap();
    assert!(tar.success());
    let archive = std::fs::read(archive_dir.path().join("env.tar.gz")).unwrap();
    let vocab = b"hello\nworld\n".to_vec();
    let merges = b"h e\nl l\n".to_vec();
    runtime.block_on(async {
        s3.put("model.bin", model.clone()).await.unwrap();
        s3.put("env.tar.gz", archive.clone()).await.unwrap();
        s3.put("tokenizer/vocab.txt", vocab.clone()).await.unwrap();
        s3.put("tokenizer/merges/a.txt", merges.clone())
            .await
            .unwrap();
    });

    let cluster = Cluster::new();
    // The origin's bytes are counted exactly: no audit reads (they have their own test), and
    // no worker starts before the others are there (see `fetch`).
    let executors = format!(
        "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {EXECUTOR:?}, \"executor\", \"{{WORK_DIR}}\", \"{{SOCKET_PATH}}\"]\n\n[artifacts]\norigin_audit = 0.0\njoin_timeout_ms = 60000\n{}",
        s3.profile_toml("default")
    );
    let names = ["art-a", "art-b", "art-c"];
    let mut workers: Vec<_> = names
        .iter()
        .map(|name| cluster.worker_with_executors(name, "", "", &executors, &[]))
        .collect();
    let job = cluster.job(
        "artifacts",
        r#"workers = 3
bid = 100.0
[executor]
class = "test"
name = "sh"

[[artifacts]]
uri = "model.bin"
destination = "model/model.bin"

[[artifacts]]
uri = "env.tar.gz"
destination = "env.tar.gz"
unpack = { destination = "env" }

[[artifacts]]
uri = "model.bin"
destination = "model/model.bin"

[[artifacts]]
uri = "model.bin"
destination = "copy/same-object.bin"
"#,
    );
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(90));
    assert!(ok, "{}", logs.join("\n"));

    // Nothing in an honest run looks damaged: no cache hit is taken for a changed file.
    for worker in &mut workers {
        while let Ok(line) = worker.lines.try_recv() {
            worker.seen.push(line);
        }
        let damaged: Vec<&String> = worker
            .seen
            .iter()
            .filter(|l| l.contains("changed on disk") || l.contains("no longer matches"))
            .collect();
        assert!(damaged.is_empty(), "{}: {damaged:#?}", worker.name);
    }
    let prefix_bytes = (vocab.len() + merges.len()) as u64;
    for name in names {
        let dir = job_dir(&cluster.path(&format!("{name}-work")));
        let fetched = std::fs::read(dir.join("model/model.bin")).unwrap();
        assert!(fetched == model, "{name}: model.bin differs");
        assert!(
            std::fs::read(dir.join("copy/same-object.bin")).unwrap() == model,
            "{name}: the same object under another name"
        );
        let metadata = std::fs::metadata(dir.join("model/model.bin")).unwrap();
        assert_eq!(
            metadata.nlink(),
            1,
            "{name}: the job's own copy, not a link into the store"
        );
        assert_eq!(
            metadata.mode() & 0o200,
            0o200,
            "{name}: the job's copy is its own to write"
        );
        assert_eq!(std::fs::read(dir.join("env.tar.gz")).unwrap(), archive);
        assert_eq!(
            std::fs::read_to_string(dir.join("env/bin/run.sh")).unwrap(),
            "echo hello\n",
            "{name}: the archive is unpacked"
        );

        let results = std::fs::read_to_string(dir.join("results.txt")).unwrap();
        let line = |label: &str| {
            let line = results
                .lines()
                .find(|l| l.starts_with(&format!("{label} ")))
                .unwrap_or_else(|| panic!("{name}: no {label} in {results}"));
            let mut parts = line.splitn(3, ' ').skip(1);
            (
                parts.next().unwrap().to_string(),
                parts.next().unwrap_or("").to_string(),
            )
        };
        let (code, body) = line("prefix");
        assert_eq!(code, "200", "{name}: {body}");
        let mut entries: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        entries.sort_by_key(|e| e["path"].as_str().unwrap().to_string());
        let expected = [
            ("tok/tokenizer/merges/a.txt", &merges),
            ("tok/tokenizer/vocab.txt", &vocab),
        ];
        assert_eq!(entries.len(), expected.len(), "{name}: {body}");
        for (entry, (path, content)) in entries.iter().zip(expected) {
            assert_eq!(entry["path"], path, "{name}: {body}");
            assert_eq!(entry["size"], content.len(), "{name}");
            assert_eq!(
                entry["checksum"],
                format!("sha256:{}", hex::encode(Sha256::digest(content))),
                "{name}"
            );
            assert_eq!(entry["metadata"]["source"], "artifact");
            assert_eq!(&std::fs::read(dir.join(path)).unwrap(), content);
        }
        let (code, body) = line("unknown-profile");
        assert_eq!(code, "502", "{name}: {body}");
        assert!(body.contains("no origin profile named"), "{name}: {body}");
    }
    // The job's artifacts were read from the origin once in all (the duplicate request and
    // the same object under another name too); each executor's prefix fetch, made when it got there, at most once per worker.
    let once = (model.len() + archive.len()) as u64;
    let served = s3.bytes_served();
    let swarm_warnings: Vec<&String> = workers
        .iter()
        .flat_map(|w| &w.seen)
        .filter(|l| l.contains("WARN") && l.contains("artifact"))
        .collect();
    assert!(
        served >= once + prefix_bytes && served <= once + 3 * prefix_bytes,
        "S3 served {served} bytes; the job's artifacts are {once} bytes, the prefix {prefix_bytes}; the workers warned {swarm_warnings:#?}"
    );
}

/// A `hypha-worker fetch` process; its JSON summary goes to `{name}.json`, its log to
/// `{name}.log`. It waits up to a minute for the others it expects: on a loaded machine a
/// process may take more than the default 10 s to find them, and one that joins after the
/// others started takes the chunks whose claims it saw made out of turn from the origin.
fn fetch(cluster: &Cluster, s3: &S3Server, name: &str, args: &[&str]) -> std::process::Child {
    let extra = format!(
        "work_dir = \"{name}-work\"\n[artifacts]\nchunk_bytes = {CHUNK}\norigin_audit = 0.0\njoin_timeout_ms = 60000\n{}",
        s3.profile_toml("default")
    );
    let config = cluster.config(name, Role::Worker, &extra);
    Command::new(common::bin("hypha-worker"))
        .arg("fetch")
        .arg("--config")
        .arg(&config)
        .args(args)
        .current_dir(cluster.dir.path())
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(cluster.path(&format!("{name}.json"))).unwrap())
        .stderr(std::fs::File::create(cluster.path(&format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap()
}

const CHUNK: usize = 1 << 20;

#[test]
fn a_node_killed_mid_way_costs_at_most_its_chunks_in_flight() {
    const NODES: usize = 4;
    const SIZE: usize = 24 * CHUNK;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = tempfile::tempdir().unwrap();
    // 8 MiB/s: the origin alone needs 3 s for the object.
    let s3 = runtime
        .block_on(S3Server::start(store.path(), Some(8 << 20)))
        .unwrap();
    let object = pattern(SIZE, 11);
    runtime
        .block_on(s3.put("big/weights.bin", object.clone()))
        .unwrap();
    let cluster = Cluster::new();
    let expect = NODES.to_string();
    let mut nodes: Vec<(String, std::process::Child)> = (0..NODES)
        .map(|i| {
            let name = format!("fetch-{i}");
            let destination = format!("{name}-weights.bin");
            let args = [
                "--expect",
                expect.as_str(),
                "--linger",
                "10",
                "big/weights.bin",
                destination.as_str(),
            ];
            let child = fetch(&cluster, &s3, &name, &args);
            (name, child)
        })
        .collect();
    // Kill the last node once a third of the object has left the origin: it is pulling its
    // share then.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while s3.bytes_served() < (SIZE / 3) as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the origin is not read"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (killed, mut victim) = nodes.pop().unwrap();
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    assert!(
        !cluster.path(&format!("{killed}-weights.bin")).exists(),
        "the killed node never finished"
    );

    let mut from_peers = 0;
    for (name, mut child) in nodes {
        let status = child.wait().unwrap();
        let log = std::fs::read_to_string(cluster.path(&format!("{name}.log"))).unwrap();
        assert!(status.success(), "{name} failed:\n{log}");
        assert!(
            !log.contains(" ERROR "),
            "a successful fetch logs no errors:\n{log}"
        );
        let fetched = std::fs::read(cluster.path(&format!("{name}-weights.bin"))).unwrap();
        assert!(fetched == object, "{name}: the file differs");
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(cluster.path(&format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["complete"], true, "{summary}");
        assert_eq!(summary["chunks"], 24, "{summary}");
        from_peers += summary["peer_chunks"].as_u64().unwrap();
    }
    assert!(from_peers > 0, "the survivors shared chunks");
    // Each of the 4 nodes reads at most max(1, origin_connections / 4) = 4 chunks from the
    // origin at once, and a read that ended starts the next while its chunk's announcement
    // may still be queued to the peers: the killed node can have had 4 reads in flight and
    // one chunk read whose announcement never left it (measured once: 4.25 MiB re-read).
    let in_flight = 5 * CHUNK as u64;
    let served = s3.bytes_served();
    assert!(
        served >= SIZE as u64 && served <= SIZE as u64 + in_flight,
        "the origin served {served} bytes for a {SIZE}-byte object; at most {in_flight} more may be re-read"
    );
}
