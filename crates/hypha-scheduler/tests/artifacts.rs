//! Artifacts in jobs, with real processes: a job file's `[[artifacts]]` reach every worker's
//! job directory before its executor starts, each chunk read from the (in-process) S3 origin
//! once, and executors fetch more through the bridge's `{"type": "Artifact"}`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{os::unix::fs::MetadataExt, process::Command, time::Duration};

use common::{Cluster, job_dir};
use hypha_artifacts::testing::S3Server;
use sha2::{Digest, Sha256};

/// Bytes that differ at every offset, so that a misplaced chunk shows.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

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
    let executors = format!(
        "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {EXECUTOR:?}, \"executor\", \"{{WORK_DIR}}\", \"{{SOCKET_PATH}}\"]\n\n{}",
        s3.profile_toml("default")
    );
    let names = ["art-a", "art-b", "art-c"];
    let _workers: Vec<_> = names
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
"#,
    );
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(90));
    assert!(ok, "{}", logs.join("\n"));

    let prefix_bytes = (vocab.len() + merges.len()) as u64;
    for name in names {
        let dir = job_dir(&cluster.path(&format!("{name}-work")));
        let fetched = std::fs::read(dir.join("model/model.bin")).unwrap();
        assert!(fetched == model, "{name}: model.bin differs");
        let metadata = std::fs::metadata(dir.join("model/model.bin")).unwrap();
        assert!(
            metadata.nlink() >= 2,
            "{name}: a hard link into the store, not a copy"
        );
        assert_eq!(
            metadata.mode() & 0o222,
            0,
            "{name}: store files are read-only"
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
    // The job's artifacts were read from the origin once in all (the duplicate request
    // too); each executor's prefix fetch, made when it got there, at most once per worker.
    let once = (model.len() + archive.len()) as u64;
    let served = s3.bytes_served();
    assert!(
        served >= once + prefix_bytes && served <= once + 3 * prefix_bytes,
        "S3 served {served} bytes; the job's artifacts are {once} bytes, the prefix {prefix_bytes}"
    );
}
