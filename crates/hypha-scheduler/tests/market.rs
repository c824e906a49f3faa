//! The market with real processes of the real binaries: a gateway, workers and schedulers on
//! loopback TCP with real certificates.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

mod common;

use common::*;

const FINISH: &str = "echo running in \"$1\"; test -S \"$2\" && test \"$(stat -c %a \"$1\")\" = 700 || exit 9; sleep 0.5; exit 0";

#[test]
fn the_cheapest_offers_per_unit_win_and_statuses_reach_the_scheduler() {
    let cluster = Cluster::new();
    // bid 100 for 1 core and 1 GB. Expected, by price per weighted unit (core = 1, 4 GB = 1):
    // cheap-whole offers 8 cores + 16 GB for 100 (8.3/unit), mid-whole 4 cores + 8 GB for 100
    // (16.7/unit), flexible mirrors the bid for exactly 1 core + 1 GB (80/unit); greedy asks
    // 150 (over the bid, declined) and picky's floor 120 is above the bid (no offer).
    let mut workers: Vec<Proc> = [
        (
            "cheap-whole",
            "strategy = \"whole\"\nprice = 50.0",
            "cpu = 8\nmemory = 16",
        ),
        (
            "mid-whole",
            "strategy = \"whole\"\nprice = 60.0",
            "cpu = 4\nmemory = 8",
        ),
        (
            "flexible",
            "strategy = \"flexible\"\nprice = 80.0",
            "cpu = 2\nmemory = 2",
        ),
        (
            "greedy",
            "strategy = \"whole\"\nprice = 150.0",
            "cpu = 16\nmemory = 64",
        ),
        (
            "picky",
            "strategy = \"flexible\"\nprice = 10.0\nfloor = 120.0",
            "cpu = 4\nmemory = 4",
        ),
    ]
    .into_iter()
    .map(|(name, offer, resources)| cluster.worker(name, offer, resources, FINISH))
    .collect();
    let job = cluster.job(
        "three",
        "workers = 3\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\nmemory = 1\n[config]\ngreeting = \"hello\"\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(ok, "the scheduler failed:\n{}", logs.join("\n"));
    let events = events(&events_path);
    // A scheduler that is done gives its leases back before it exits: its workers are free
    // at once instead of when the leases lapse.
    for winner in &mut workers[..3] {
        winner.wait_for("lease released");
    }

    let leased: HashSet<String> = of_kind(&events, "leased")
        .iter()
        .map(|e| e["event"]["peer"].as_str().unwrap().to_string())
        .collect();
    let expected: HashSet<String> = ["cheap-whole", "mid-whole", "flexible"]
        .iter()
        .map(|n| cluster.peer_id(n))
        .collect();
    assert_eq!(leased, expected, "the three cheapest per unit win");

    let finished: Vec<_> = of_kind(&events, "status")
        .into_iter()
        .filter(|e| e["event"]["status"]["Finished"]["exit_code"] == 0)
        .collect();
    assert_eq!(
        finished.len(),
        3,
        "three exit codes reached the scheduler: {events:#?}"
    );
    let done = of_kind(&events, "done");
    assert_eq!(done[0]["event"]["ok"], true);

    // The executor saw its work directory, socket and job; its output went to its log.
    let work = cluster.path("cheap-whole-work");
    let job_dir = job_dir(&work);
    let stdout = std::fs::read_to_string(job_dir.join("stdout.log")).unwrap();
    assert!(stdout.contains("running in"), "{stdout}");
    let job_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(job_dir.join("job.json")).unwrap()).unwrap();
    assert_eq!(job_json["config"]["greeting"], "hello");
    assert!(
        !job_dir.join("bridge.sock").exists(),
        "the socket goes with the job"
    );
}

#[test]
fn a_killed_worker_is_replaced_and_a_killed_scheduler_frees_its_workers() {
    let cluster = Cluster::new();
    // Each executor records its pid, then works for a while.
    let script = "echo $$ > \"$1/pid\"; sleep 6; exit 0";
    let mut workers: HashMap<String, Proc> = ["w1", "w2", "w3"]
        .into_iter()
        .map(|name| {
            (
                cluster.peer_id_after(name, |c| {
                    c.worker(
                        name,
                        "strategy = \"whole\"\nprice = 10.0",
                        "cpu = 1\nmemory = 1",
                        script,
                    )
                }),
                name,
            )
        })
        .map(|((peer, proc), _)| (peer, proc))
        .collect();
    let job = cluster.job(
        "two",
        "workers = 2\nbid = 100.0\nmax_attempts = 2\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let dispatched = wait_for_events(&events_path, "dispatched", 2);
    let victim = dispatched[0]["event"]["peer"].as_str().unwrap().to_string();
    let killed_at = Instant::now();
    workers.get_mut(&victim).unwrap().kill();
    let redispatched = wait_for_events(&events_path, "dispatched", 3);
    let replaced_after = killed_at.elapsed();
    assert!(
        replaced_after < Duration::from_millis(3000 + 1500),
        "replaced after {replaced_after:?}, more than one lease period (3 s) and an allocation"
    );
    let replacement = redispatched[2]["event"]["peer"].as_str().unwrap();
    assert_ne!(replacement, victim);
    assert_eq!(
        redispatched[2]["event"]["slot"],
        dispatched[0]["event"]["slot"]
    );
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(ok, "the job goes on and completes:\n{}", logs.join("\n"));
    drop(workers);

    // A scheduler killed mid-job: its workers stop the job within a lease period.
    let cluster = Cluster::new();
    let script = "echo $$ > \"$1/pid\"; exec sleep 60";
    let mut workers: Vec<Proc> = ["v1", "v2"]
        .into_iter()
        .map(|name| {
            cluster.worker(
                name,
                "strategy = \"whole\"\nprice = 10.0",
                "cpu = 1\nmemory = 1",
                script,
            )
        })
        .collect();
    let job = cluster.job(
        "forever",
        "workers = 2\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"sh\"\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("doomed", &job);
    wait_for_events(&events_path, "dispatched", 2);
    let pids: Vec<i32> = ["v1", "v2"]
        .iter()
        .map(|name| wait_for_pid(&cluster.path(&format!("{name}-work"))))
        .collect();
    scheduler.kill();
    for worker in &mut workers {
        worker.wait_for("lease lapsed without renewal");
        worker.wait_for("job failed");
    }
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid),
            "executor {pid} outlived its lease"
        );
    }
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

fn wait_for_pid(work: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for entry in std::fs::read_dir(work).into_iter().flatten().flatten() {
            if let Ok(text) = std::fs::read_to_string(entry.path().join("pid"))
                && let Ok(pid) = text.trim().parse()
            {
                return pid;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no executor wrote its pid under {}", work.display());
}

fn wait_for_events(path: &Path, kind: &str, count: usize) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let all = events(path);
        let matching: Vec<serde_json::Value> = of_kind(&all, kind).into_iter().cloned().collect();
        if matching.len() >= count {
            return matching;
        }
        assert!(
            Instant::now() < deadline,
            "fewer than {count} {kind} events: {all:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn competing_schedulers_never_share_a_worker() {
    let cluster = Cluster::new();
    let _workers: Vec<Proc> = ["c1", "c2", "c3"]
        .into_iter()
        .map(|name| {
            cluster.worker(
                name,
                "strategy = \"whole\"\nprice = 10.0",
                "cpu = 1\nmemory = 1",
                "sleep 1; exit 0",
            )
        })
        .collect();
    let job = "workers = 2\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"sh\"\n";
    let (mut a, a_events) = cluster.scheduler("a", &cluster.job("a", job));
    let (mut b, b_events) = cluster.scheduler("b", &cluster.job("b", job));
    let (a_ok, a_logs) = a.wait(Duration::from_secs(90));
    let (b_ok, b_logs) = b.wait(Duration::from_secs(90));
    assert!(a_ok, "{}", a_logs.join("\n"));
    assert!(b_ok, "{}", b_logs.join("\n"));

    // Each scheduler's hold on a worker runs from its lease to its job's end; no worker is
    // held by both at once.
    let holds = |path: &Path| -> Vec<(String, u64, u64)> {
        let all = events(path);
        of_kind(&all, "leased")
            .iter()
            .map(|leased| {
                let peer = leased["event"]["peer"].as_str().unwrap().to_string();
                let start = leased["time_ms"].as_u64().unwrap();
                let end = all
                    .iter()
                    .filter(|e| {
                        e["event"]["kind"] == "status"
                            && e["event"]["peer"] == peer.as_str()
                            && e["event"]["status"].get("Finished").is_some()
                            && e["time_ms"].as_u64().unwrap() >= start
                    })
                    .map(|e| e["time_ms"].as_u64().unwrap())
                    .min()
                    .unwrap();
                (peer, start, end)
            })
            .collect()
    };
    let (a_holds, b_holds) = (holds(&a_events), holds(&b_events));
    assert_eq!(
        a_holds.len() + b_holds.len(),
        4,
        "both got their two workers"
    );
    for (peer, a_start, a_end) in &a_holds {
        for (other, b_start, b_end) in &b_holds {
            if peer == other {
                assert!(
                    a_end <= b_start || b_end <= a_start,
                    "{peer} was held by both schedulers at once"
                );
            }
        }
    }
}

/// A tiny HTTP server standing in for the Hugging Face Hub and a plain web server: answers
/// `/org/model/resolve/main/config.json` and `/files/data.bin`, sends 10 of the 100 bytes of
/// `/files/stall.bin` and then nothing for a minute, records the Authorization headers it saw.
fn fake_hub() -> (u16, std::sync::Arc<Mutex<Vec<String>>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { break };
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let text = String::from_utf8_lossy(&request).to_string();
            for line in text.lines() {
                if line.to_ascii_lowercase().starts_with("authorization:") {
                    record.lock().unwrap().push(line.to_string());
                }
            }
            let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
            if path == "/files/stall.bin" {
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-length: 100\r\nconnection: close\r\n\r\n0123456789"
                );
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(60));
                    drop(stream);
                });
                continue;
            }
            let (status, body): (&str, &[u8]) = match path.as_str() {
                "/org/model/resolve/main/config.json" => ("200 OK", b"{\"hidden\": 8}"),
                "/files/data.bin" => ("200 OK", b"0123456789"),
                _ => ("404 Not Found", b"not here"),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(body);
        }
    });
    (port, seen)
}

#[test]
fn an_executor_uses_every_bridge_endpoint_and_path_attacks_are_refused() {
    let (port, authorizations) = fake_hub();
    let cluster = Cluster::new();
    // The executor: curl over the job's socket; one result line per call.
    let script = format!(
        r#"D="$1"; S="$2"; R="$D/results.txt"
call() {{ code=$(curl -s -o "$D/resp.json" -w '%{{http_code}}' --unix-socket "$S" -X POST -H 'content-type: application/json' --data "$3" "http://bridge$2"); echo "$1 $code $(cat "$D/resp.json")" >> "$R"; }}
call hf /resources/fetch '{{"fetch":{{"type":"HuggingFace","repository":"org/model","filenames":["config.json"]}},"out_dir":"models"}}'
call uri /resources/fetch '{{"fetch":{{"type":"Uri","value":"http://127.0.0.1:{port}/files/data.bin"}},"out_dir":"data"}}'
call missing /resources/fetch '{{"fetch":{{"type":"Uri","value":"http://127.0.0.1:{port}/nothing"}},"out_dir":"data"}}'
call stall /resources/fetch '{{"fetch":{{"type":"Uri","value":"http://127.0.0.1:{port}/files/stall.bin"}},"out_dir":"stalled"}}'
call status /status/send '{{"loss":1.5,"step":3}}'
call malformed /status/send 'not json'
ln -s /etc "$D/link"
mkdir "$D/swap"
call swap-before /resources/fetch '{{"fetch":{{"type":"Uri","value":"http://127.0.0.1:{port}/files/data.bin"}},"out_dir":"swap"}}'
rm -rf "$D/swap"; ln -s "$(dirname "$D")" "$D/swap"
for p in /etc ../x a/../../x .. %2e%2e/x x/%2E%2E/y 'a\\b' link link/sub swap ../hypha-other/in . ''; do
  call "attack:$p" /resources/fetch "{{\"fetch\":{{\"type\":\"Uri\",\"value\":\"http://127.0.0.1:{port}/files/data.bin\"}},\"out_dir\":\"$p\"}}"
done
code=$(curl -s -o "$D/openapi.json" -w '%{{http_code}}' --unix-socket "$S" http://bridge/openapi.json); echo "openapi $code" >> "$R"
exit 0"#
    );
    // Downloads that receive nothing for a second fail (the stalling one).
    let executors = format!(
        "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", {script:?}, \"executor\", \"{{WORK_DIR}}\", \"{{SOCKET_PATH}}\"]\n[bridge]\ndownload_read_timeout_ms = 1000\n"
    );
    let _worker = cluster.worker_with_executors(
        "bridge-worker",
        "",
        "",
        &executors,
        &[("HF_ENDPOINT", format!("http://127.0.0.1:{port}"))],
    );
    let job = cluster.job(
        "bridge",
        "workers = 1\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"sh\"\n[secrets]\nhf_token = \"hf_secret_token\"\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(60));
    assert!(ok, "{}", logs.join("\n"));

    let work = cluster.path("bridge-worker-work");
    let job_dir = job_dir(&work);
    let results = std::fs::read_to_string(job_dir.join("results.txt")).unwrap();
    let line = |name: &str| -> (String, String) {
        let l = results
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no result for {name}:\n{results}"));
        let mut parts = l.splitn(3, ' ');
        parts.next();
        (
            parts.next().unwrap().to_string(),
            parts.next().unwrap_or("").to_string(),
        )
    };

    let (code, body) = line("hf");
    assert_eq!(code, "200", "{body}");
    let entries: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(entries[0]["path"], "models/config.json");
    assert_eq!(entries[0]["size"], 13);
    assert!(
        entries[0]["checksum"]
            .as_str()
            .unwrap()
            .starts_with("sha256:")
    );
    assert_eq!(entries[0]["metadata"]["source"], "huggingface");
    assert_eq!(
        std::fs::read_to_string(job_dir.join("models/config.json")).unwrap(),
        "{\"hidden\": 8}"
    );
    assert!(
        authorizations
            .lock()
            .unwrap()
            .iter()
            .any(|a| a.ends_with("Bearer hf_secret_token")),
        "the job's hf_token secret reaches the Hub"
    );
    let job_json = std::fs::read_to_string(job_dir.join("job.json")).unwrap();
    assert!(
        !job_json.contains("hf_secret_token"),
        "secrets stay out of {{JOB_JSON}}"
    );

    let (code, body) = line("uri");
    assert_eq!(code, "200", "{body}");
    let entries: serde_json::Value = serde_json::from_str(&body).unwrap();
    // sha256("0123456789")
    assert_eq!(
        entries[0]["checksum"],
        "sha256:84d89877f0d4041efb6bf91a16f0248f2fd573e6af05c19f96bedb9f882f7882"
    );
    assert_eq!(line("missing").0, "502");
    let (code, body) = line("stall");
    assert_eq!(code, "502", "{body}");
    assert!(body.contains("stall.bin"), "{body}");
    assert!(
        !job_dir.join("stalled/stall.bin").exists(),
        "a download that broke off leaves no file"
    );
    let (code, body) = line("status");
    assert_eq!(code, "200");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer,
        serde_json::json!({"received": true, "type": "Ok"}),
        "the scheduler's answer comes back, with the upstream client's type"
    );
    let statuses = of_kind(&events(&events_path), "executor_status")
        .into_iter()
        .map(|e| e["event"]["payload"]["loss"].as_f64().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(statuses, vec![1.5], "the status reached the scheduler");
    assert_eq!(line("malformed").0, "400");
    assert_eq!(line("swap-before").0, "200");

    let attacks: Vec<&str> = results
        .lines()
        .filter(|l| l.starts_with("attack:"))
        .collect();
    assert!(attacks.len() >= 10, "{results}");
    for attack in &attacks {
        let code = attack.split(' ').nth(1).unwrap();
        assert!(code == "403" || code == "400", "not refused: {attack}");
        assert!(
            attack.contains("\"code\""),
            "errors are JSON with a code: {attack}"
        );
    }
    assert!(!work.join("data.bin").exists() && !Path::new("/etc/data.bin").exists());
    assert_eq!(line("openapi").0, "200");
    let openapi: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(job_dir.join("openapi.json")).unwrap())
            .unwrap();
    assert!(openapi["paths"]["/resources/fetch"].is_object());
}

/// The executor of [`jobs_of_a_task_exchange_files_and_other_jobs_see_none`]: `exchange` jobs
/// swap files with the peer named in `$C/peer-for-$ME` through every peer endpoint;
/// the `bystander` job, another task on the same worker, waits for files that never come.
const EXCHANGE: &str = r#"D="$1"; S="$2"; R="$D/results.txt"
call() { code=$(curl -s -o "$D/resp.json" -w '%{http_code}' --unix-socket "$S" -X POST -H 'content-type: application/json' --data "$3" "http://bridge$2"); echo "$1 $code $(cat "$D/resp.json")" >> "$R"; }
if grep -q '"role":"bystander"' "$D/job.json"; then
  touch "$C/go"
  curl -s -m 6 -o "$D/resp.json" --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"fetch":{"type":"Peers","peers":[]},"out_dir":"in"}' http://bridge/resources/fetch
  echo "bystander $?" >> "$R"
  call bystander-wait /resources/fetch '{"fetch":{"type":"Peers","peers":[]},"out_dir":"in","wait_ms":300}'
  exit 0
fi
while [ ! -f "$C/go" ]; do sleep 0.1; done
PEER=$(cat "$C/peer-for-$ME")
echo "hello from $ME" > "$D/mine.txt"
curl -s -N -m 30 --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"receive":{"type":"Peers","peers":["'$PEER'"],"strategy":"One"},"out_dir":"in"}' http://bridge/resources/receive > "$D/events.txt" &
call send /resources/send '{"send":{"type":"Peers","peers":["'$PEER'"],"strategy":"All"},"path":"mine.txt"}'
wait
echo "round two from $ME" > "$D/second.txt"
call send2 /resources/send '{"send":{"type":"Peers","peers":["'$PEER'"],"strategy":"Random"},"path":"second.txt"}'
call fetch /resources/fetch '{"fetch":{"type":"Peers","peers":["'$PEER'"],"strategy":"All"},"out_dir":"in"}'
call bad-peer /resources/send '{"send":{"type":"Peers","peers":["not-a-peer"]},"path":"mine.txt"}'
call no-peers /resources/send '{"send":{"type":"Peers","peers":[]},"path":"mine.txt"}'
call send-up /resources/send '{"send":{"type":"Peers","peers":["'$PEER'"]},"path":"../job.json"}'
call send-absolute /resources/send '{"send":{"type":"Peers","peers":["'$PEER'"]},"path":"/etc/passwd"}'
call receive-up /resources/receive '{"receive":{"type":"Peers"},"out_dir":"../x"}'
exit 0"#;

/// Every result line of a job's `results.txt` whose name is `name`: (HTTP code, body).
fn result(job_dir: &Path, name: &str) -> (String, String) {
    let results = std::fs::read_to_string(job_dir.join("results.txt")).unwrap_or_default();
    let line = results
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no result for {name} in {}:\n{results}", job_dir.display()));
    let mut parts = line.splitn(3, ' ');
    parts.next();
    (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    )
}

/// The job directories under `work` whose job.json has `config.role == role`.
fn job_dirs_with_role(work: &Path, role: &str) -> Vec<PathBuf> {
    std::fs::read_dir(work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            std::fs::read_to_string(p.join("job.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .is_some_and(|j| j["config"]["role"] == role)
        })
        .collect()
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[test]
fn jobs_of_a_task_exchange_files_and_other_jobs_see_none() {
    let cluster = Cluster::new();
    let c = cluster.path("").display().to_string();
    // a has room for one job, b for two: the exchange task takes both, the bystander task
    // then lands next to it on b.
    let start = |name: &str, cpu: &str| {
        cluster.worker_with_env(
            name,
            "strategy = \"flexible\"\nprice = 1.0",
            &format!("cpu = {cpu}"),
            EXCHANGE,
            &[("C", c.clone()), ("ME", name.to_string())],
        )
    };
    let (a_id, _a) = cluster.peer_id_after("a", |_| start("a", "1"));
    let (b_id, _b) = cluster.peer_id_after("b", |_| start("b", "2"));
    std::fs::write(cluster.path("peer-for-a"), &b_id).unwrap();
    std::fs::write(cluster.path("peer-for-b"), &a_id).unwrap();

    let job = |name: &str, workers: u32, role: &str| {
        cluster.job(
            name,
            &format!(
                "workers = {workers}\nbid = 100.0\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n[config]\nrole = \"{role}\"\n"
            ),
        )
    };
    let (mut exchange, exchange_events) =
        cluster.scheduler("exchange-scheduler", &job("exchange", 2, "exchange"));
    wait_for_events(&exchange_events, "dispatched", 2);
    let (mut bystander, _) =
        cluster.scheduler("bystander-scheduler", &job("bystander", 1, "bystander"));
    let (ok, logs) = exchange.wait(Duration::from_secs(60));
    assert!(ok, "{}", logs.join("\n"));
    let (ok, logs) = bystander.wait(Duration::from_secs(60));
    assert!(ok, "{}", logs.join("\n"));

    for (me, peer) in [("a", &b_id), ("b", &a_id)] {
        let dirs = job_dirs_with_role(&cluster.path(&format!("{me}-work")), "exchange");
        assert_eq!(dirs.len(), 1, "one exchange job on {me}");
        let dir = &dirs[0];
        let other = if me == "a" { "b" } else { "a" };

        let (code, body) = result(dir, "send");
        assert_eq!(code, "200", "{me} send: {body}");
        let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
        let text = format!("hello from {me}\n");
        assert_eq!(sent["path"], "mine.txt");
        assert_eq!(sent["size"], text.len());
        assert_eq!(
            sent["checksum"],
            format!(
                "sha256:{}",
                hex::encode(<sha2::Sha256 as sha2::Digest>::digest(text.as_bytes()))
            )
        );
        assert_eq!(sent["metadata"]["peers"], serde_json::json!([peer]));

        // The event stream: one event with the sequence as its id, the file in out_dir.
        let events = std::fs::read_to_string(dir.join("events.txt")).unwrap();
        assert!(events.contains("id: 0"), "{me} events: {events}");
        let data = events
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("{me} got no event: {events:?}"));
        let event: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(event["path"], "in/0-mine.txt");
        assert_eq!(event["from_peer"], peer.as_str());
        assert_eq!(event["sequence"], 0);
        assert_eq!(
            std::fs::read_to_string(dir.join("in/0-mine.txt")).unwrap(),
            format!("hello from {other}\n")
        );

        assert_eq!(result(dir, "send2").0, "200");
        let (code, body) = result(dir, "fetch");
        assert_eq!(code, "200", "{me} fetch: {body}");
        let fetched: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(fetched[0]["path"], "in/1-second.txt");
        assert_eq!(fetched[0]["metadata"]["from_peer"], peer.as_str());
        assert_eq!(
            std::fs::read_to_string(dir.join("in/1-second.txt")).unwrap(),
            format!("round two from {other}\n")
        );

        for (name, expected) in [
            ("bad-peer", "400"),
            ("no-peers", "400"),
            ("send-up", "403"),
            ("send-absolute", "403"),
            ("receive-up", "403"),
        ] {
            let (code, body) = result(dir, name);
            assert_eq!(code, expected, "{me} {name}: {body}");
            assert!(body.contains("\"code\""), "{me} {name}: {body}");
        }
    }

    // The bystander shared worker b with an exchange job the whole time, yet its fetch
    // waited in vain (curl's exit code 28: timed out) and nothing reached its directory.
    let bystanders = job_dirs_with_role(&cluster.path("b-work"), "bystander");
    assert_eq!(bystanders.len(), 1, "the bystander ran on b");
    let results = std::fs::read_to_string(bystanders[0].join("results.txt")).unwrap();
    assert!(results.starts_with("bystander 28\n"), "{results}");
    // With wait_ms, the same fetch answers, with nothing, once the wait is over.
    assert_eq!(
        result(&bystanders[0], "bystander-wait"),
        ("200".to_string(), "[]".to_string())
    );
    for file in files_under(&bystanders[0]) {
        let bytes = std::fs::read(&file).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&bytes).contains("from a"),
            "{} holds what a sent to another task",
            file.display()
        );
    }
}

/// Leases are told apart by id, not by the scheduler that holds them: a restarted scheduler
/// (same identity) that leases the same worker anew keeps its job when the lease of its killed
/// earlier process lapses there.
#[test]
fn a_lapsed_lease_of_an_earlier_process_never_stops_a_job_of_a_later_one() {
    let cluster = Cluster::new();
    // Room for two jobs at once: the earlier process's, still held, and the later one's.
    let mut worker = cluster.worker(
        "w",
        "strategy = \"flexible\"\nprice = 10.0",
        "cpu = 2\nmemory = 1",
        "echo $$ > \"$1/pid\"; sleep 8; exit 0",
    );
    // No ledger: the restarted scheduler has no record to take the earlier lease over from.
    let job = cluster.job(
        "sleepy",
        "workers = 1\nbid = 100.0\nmax_attempts = 1\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n",
    );
    let (mut first, events_path) = cluster.scheduler("scheduler", &job);
    let earlier = wait_for_events(&events_path, "dispatched", 1);
    first.kill();
    let (mut second, _) = cluster.restart_scheduler("scheduler", &job);
    let later = wait_for_events(&events_path, "dispatched", 2);
    assert_ne!(earlier[0]["event"]["job"], later[1]["event"]["job"]);
    let leases = wait_for_events(&events_path, "leased", 2);
    assert_ne!(
        leases[0]["event"]["lease"], leases[1]["event"]["lease"],
        "the later process leased the worker anew"
    );
    // The earlier lease lapses while the later job runs; only the earlier job stops.
    worker.wait_for("lease lapsed without renewal");
    let (ok, lines) = second.wait(Duration::from_secs(60));
    assert!(
        ok,
        "the later job ran to its end:\n{}\nworker:\n{}",
        lines.join("\n"),
        worker.seen.join("\n")
    );
    let finished: Vec<serde_json::Value> = of_kind(&events(&events_path), "status")
        .into_iter()
        .filter(|e| e["event"]["job"] == later[1]["event"]["job"])
        .cloned()
        .collect();
    assert!(
        finished
            .iter()
            .any(|e| e["event"]["status"]["Finished"]["exit_code"] == 0),
        "{finished:#?}"
    );
}

/// The Python SDK's tests (`python/tests`, run by `in_job.py`) and the upstream Hypha client's
/// request shapes, inside two jobs of one task on two real workers: fetch, send and receive
/// between the jobs, status, slices and `/data/consumed`, error events raised. Each job writes
/// what passed; the job fails if a test does.
#[test]
fn the_python_sdk_and_the_upstream_client_work_against_real_bridges() {
    if !python_with(&["json"], true) {
        return;
    }
    let numpy = python_with(&["numpy"], true);
    let cluster = Cluster::new();
    let _data = cluster.blobs_data_node("data");
    let shared = cluster.path("python-shared");
    std::fs::create_dir_all(&shared).unwrap();
    let start = |name: &'static str| {
        let env = [
            ("SDK_TEST_DIR", shared.display().to_string()),
            ("SDK_TEST_NAME", name.to_string()),
        ];
        move |cluster: &Cluster| {
            cluster.python_worker(name, "test", "python-sdk", "tests/in_job.py", &env)
        }
    };
    let (a_id, mut a) = cluster.peer_id_after("a", start("a"));
    let (b_id, mut b) = cluster.peer_id_after("b", start("b"));
    std::fs::write(shared.join("peer-for-a"), &b_id).unwrap();
    std::fs::write(shared.join("peer-for-b"), &a_id).unwrap();
    let job = cluster.job(
        "sdk",
        "workers = 2\nbid = 100.0\nmax_attempts = 1\n[executor]\nclass = \"test\"\nname = \"python-sdk\"\n[resources]\ncpu = 1\n[data]\ndataset = \"blobs\"\nepochs = 1\nseed = 3\n",
    );
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, logs) = scheduler.wait(Duration::from_secs(180));
    let logs_of = |name: &str| {
        let dir = job_dir(&cluster.path(&format!("{name}-work")));
        std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
    };
    assert!(
        ok,
        "{}\n--- a\n{}\n--- b\n{}",
        logs.join("\n"),
        logs_of("a"),
        logs_of("b")
    );

    let mut slices = 0;
    for name in ["a", "b"] {
        let dir = job_dir(&cluster.path(&format!("{name}-work")));
        let results: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap())
                .unwrap();
        assert_eq!(results["failed"], serde_json::json!([]), "{name}");
        let passed: Vec<&str> = results["passed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        for test in [
            "test_bridge.BridgeEndpoints.test_a_fetch_downloads_a_url_into_the_job_directory",
            "test_bridge.BridgeEndpoints.test_a_status_reaches_the_scheduler_and_its_answer_comes_back",
            "test_bridge.Peers.test_files_go_both_ways_between_the_jobs_of_the_task",
            "test_bridge.Peers.test_an_error_event_in_a_stream_is_raised",
            "test_bridge.Peers.test_a_receive_refused_before_its_stream_raises",
            "test_bridge.Slices.test_every_slice_taken_is_read_and_reported_consumed",
            "test_upstream_dialect.UpstreamClient.test_its_fetch_posts_a_bare_reference",
            "test_upstream_dialect.UpstreamClient.test_its_send_resource_and_receive_exchange_files",
            "test_upstream_dialect.UpstreamClient.test_its_send_status_reads_the_answers_type",
            "test_upstream_dialect.UpstreamClient.test_a_refused_receive_is_an_event_it_tells_from_a_file",
            "test_upstream_dialect.UpstreamClient.test_its_job_json_has_job_id_and_executor_config",
        ]
        .into_iter()
        // The sparse codec's tests need numpy (.ci/run installs it).
        .chain(numpy.then_some([
            "test_codec.Sparse.test_it_keeps_the_largest_of_each_chunk_and_decodes_what_it_says_it_sent",
            "test_codec.Sparse.test_error_feedback_carries_what_was_not_sent",
            "test_codec.Sparse.test_hostile_records_are_refused",
            "test_codec.Sparse.test_a_change_moves_only_the_values_it_keeps_and_refuses_another_models",
            "test_config_schema.TrainerConfigSchema.test_every_key_the_sdk_reads_is_described",
            "test_config_schema.TrainerConfigSchema.test_sparse_keys_mean_what_the_schema_says_and_other_codecs_send_float32",
            "test_config_schema.TrainerConfigSchema.test_the_sdk_defaults_are_the_described_ones_and_it_refuses_what_is_out_of_range",
            "test_config_schema.FailsClosed.test_the_loop_refuses_to_start_where_it_cannot_check_a_models_fingerprint",
        ]).into_iter().flatten())
        {
            assert!(
                passed.contains(&test),
                "{name}: {test} did not pass: {results}"
            );
        }
        slices += std::fs::read_to_string(shared.join(format!("slices-{name}.txt")))
            .unwrap()
            .parse::<u64>()
            .unwrap();
    }
    // The two jobs read every slice once between them, and the ledger agrees.
    assert_eq!(slices, DILOCO_SLICES);
    assert_audit_passes(&cluster.path("sdk-job.ledger"), 1, DILOCO_SLICES);
    a.kill();
    b.kill();
}
