//! Exactly-once iteration with real processes: data nodes, workers whose executors take
//! slices through the job bridge, and a scheduler whose ledger hands them out, under failures.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{collections::HashMap, time::Duration};

use common::*;

/// An executor that takes slices through the bridge until the iteration is done, checks each
/// is a plain SafeTensors file, notes it in `used.txt` and reports it consumed into a round
/// that it then completes.
const ITERATE: &str = r#"D="$1"; S="$2"
DATA=$(sed -n 's/.*"data":\({[^}]*}\).*/\1/p' "$D/job.json")
round=0
while :; do
  curl -sf -o "$D/resp.json" --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"fetch":'"$DATA"',"out_dir":"slices"}' http://bridge/resources/fetch || exit 3
  grep -q '"path"' "$D/resp.json" || break
  E=$(sed -n 's/.*"epoch":\([0-9]*\).*/\1/p' "$D/resp.json")
  N=$(sed -n 's/.*"slice":\([0-9]*\).*/\1/p' "$D/resp.json")
  P=$(sed -n 's/.*"path":"\([^"]*\)".*/\1/p' "$D/resp.json")
  test -s "$D/$P" || exit 4
  echo "$E $N $P" >> "$D/used.txt"
  if grep -q '"provider":"cache"' "$D/resp.json"; then echo "$E $N" >> "$D/cached.txt"; fi
  curl -sf -o /dev/null --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"slices":[{"epoch":'$E',"slice":'$N'}],"round":'$round',"completed_round":'$round',"data":'"$DATA"'}' http://bridge/data/consumed || exit 5
  round=$((round+1))
done
exit 0"#;

#[test]
fn workers_iterate_the_schedulers_ledger_and_every_slice_is_used_once_per_epoch() {
    use hypha_dataset::slice::{self, Dtype, Encoding, Tensors};
    const SLICES: u64 = 12;
    let cluster = Cluster::new();
    let data = cluster.path("digits");
    std::fs::create_dir(&data).unwrap();
    let mut plain = Vec::new();
    for i in 0..SLICES {
        let tensors = Tensors::new()
            .with("x", Dtype::U8, vec![4, 8], vec![i as u8; 32])
            .unwrap();
        plain.push(slice::encode(&tensors, Encoding::Plain).unwrap());
        std::fs::write(
            data.join(format!("slice-{i}.safetensors")),
            slice::encode(&tensors, Encoding::Snappy).unwrap(),
        )
        .unwrap();
    }
    let config = cluster.config("data", &format!("dataset_path = {:?}\n", data));
    let mut data_node = Proc::start(&bin("hypha-data"), &["run", "--config"], &config, "data");
    data_node.wait_for("announced");

    let _workers: Vec<Proc> = (0..2)
        .map(|i| cluster.worker(&format!("w{i}"), "price = 10", "cpu = 1", ITERATE))
        .collect();
    let job = cluster.job(
        "iterate",
        "workers = 2\nbid = 50\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n[data]\ndataset = \"digits\"\nepochs = 2\nseed = 7\n",
    );
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, log) = scheduler.wait(Duration::from_secs(90));
    assert!(ok, "{}", log.join("\n"));
    assert!(
        !log.iter().any(|l| l.contains("ERROR")),
        "{}",
        log.join("\n")
    );

    // What the executors saw: every slice of every epoch once, as the plain file.
    let mut seen = HashMap::<(u32, u64), u32>::new();
    for i in 0..2 {
        let dir = job_dir(&cluster.path(&format!("w{i}-work")));
        let used = std::fs::read_to_string(dir.join("used.txt")).unwrap_or_default();
        for line in used.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let (epoch, slice) = (words[0].parse().unwrap(), words[1].parse::<u64>().unwrap());
            *seen.entry((epoch, slice)).or_default() += 1;
            assert_eq!(
                std::fs::read(dir.join(words[2])).unwrap(),
                plain[slice as usize],
                "{line}"
            );
        }
    }
    for epoch in 0..2 {
        for slice in 0..SLICES {
            assert_eq!(
                seen.get(&(epoch, slice)),
                Some(&1),
                "epoch {epoch} slice {slice}"
            );
        }
    }

    // What the ledger recorded: the same, each slice USED once.
    let audit = hypha_ledger::read_audit(&cluster.path("iterate-job.ledger")).unwrap();
    let mut used = HashMap::<(u32, u64), u32>::new();
    for record in &audit.records {
        if let hypha_ledger::Event::Used { .. } = record.event {
            *used
                .entry((record.key.epoch, record.key.slice))
                .or_default() += 1;
        }
    }
    assert_eq!(used.len() as u64, 2 * SLICES);
    assert!(used.values().all(|&n| n == 1), "{used:?}");
}
