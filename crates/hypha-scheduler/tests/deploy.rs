//! `docs/deploy.md`, run as written: every `sh` block of the guide runs on the machine its
//! `on=` names, each machine a network namespace of `hypha_testing::sites` (the gateway on the
//! public network, sites A, B and C behind NAT routers) with a directory of its own, the
//! programs on `PATH`, `scp HOST:` copying into that host's directory, and `203.0.113.7`, the
//! guide's stand-in for the gateway's public address, replaced by the testbed's. Blocks marked
//! `service` are started in the background and waited for (30 s at most) until they log their
//! `ready` text.
//! A `sh` block without `on=` fails the test: nothing in the guide goes untried.
//! Skipped, with a message, where network namespaces cannot be made.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{collections::BTreeMap, path::Path};

use common::*;
use hypha_testing::sites::{GATEWAY_IP, Nat, Site, Sites};

/// The guide's stand-in for the gateway's public address.
const PLACEHOLDER: &str = "203.0.113.7";

/// One `sh` block of the guide.
#[derive(Debug)]
struct Block {
    machine: String,
    script: String,
    /// Started in the background, ready once it logged this.
    service: Option<String>,
}

fn blocks(guide: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut lines = guide.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```sh") else {
            continue;
        };
        let script: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        let machine = info
            .split_whitespace()
            .find_map(|w| w.strip_prefix("on="))
            .unwrap_or_else(|| panic!("a sh block names no machine (on=…): {script:?}"));
        let service = info.contains(" service").then(|| {
            info.split("ready=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_else(|| panic!("a service block without ready=\"…\": {info}"))
                .to_string()
        });
        blocks.push(Block {
            machine: machine.to_string(),
            script: script.join("\n"),
            service,
        });
    }
    blocks
}

#[test]
fn every_command_of_the_deploy_guide_runs_across_sites_behind_nats() {
    let guide_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/deploy.md");
    let guide = std::fs::read_to_string(&guide_path).unwrap();
    let blocks = blocks(&guide);
    assert!(blocks.len() > 10, "{} blocks", blocks.len());

    let sites = [
        Site {
            nat: Nat::Cone,
            nodes: 3,
        },
        Site {
            nat: Nat::Cone,
            nodes: 2,
        },
        Site {
            nat: Nat::Cone,
            nodes: 1,
        },
    ];
    let sites = match Sites::new("hdg", &sites, 50) {
        Ok(sites) => sites,
        Err(e) => {
            eprintln!("skipped: cannot make the sites testbed ({e})");
            return;
        }
    };
    let places: BTreeMap<&str, Option<String>> = [
        ("admin", None),
        ("gateway.example.org", sites.gateway().netns),
        ("data.site-a", sites.node(0, 0).netns),
        ("scheduler.site-a", sites.node(0, 1).netns),
        ("laptop.site-a", sites.node(0, 2).netns),
        ("worker-1.site-b", sites.node(1, 0).netns),
        ("worker-2.site-b", sites.node(1, 1).netns),
        ("ps.site-c", sites.node(2, 0).netns),
    ]
    .into_iter()
    .collect();

    let root = tempfile::tempdir().unwrap();
    let machines = root.path().join("machines");
    for machine in places.keys() {
        std::fs::create_dir_all(machines.join(machine)).unwrap();
    }
    // The programs, and `scp` as a copy into the host's directory.
    let programs = bin("hypha-gateway").parent().unwrap().to_path_buf();
    for program in [
        "hypha-certutil",
        "hypha-data",
        "hypha-worker",
        "hypha-scheduler",
        "hypha-executor",
    ] {
        bin(program);
    }
    let shims = root.path().join("shims");
    std::fs::create_dir_all(&shims).unwrap();
    let scp = shims.join("scp");
    std::fs::write(
        &scp,
        format!(
            "#!/bin/sh\n# scp FILE... HOST: copies into the host's directory of the test.\nfor last; do :; done\nhost=${{last%%:*}}\nwhile [ \"$#\" -gt 1 ]; do cp \"$1\" {machines:?}/\"$host\"/; shift; done\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&scp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}:{}",
        shims.display(),
        programs.display(),
        std::env::var("PATH").unwrap_or_default()
    );

    let mut services: Vec<Proc> = Vec::new();
    for block in &blocks {
        let netns = places.get(block.machine.as_str()).unwrap_or_else(|| {
            panic!(
                "the guide names a machine the test lacks: {}",
                block.machine
            )
        });
        let script = block.script.replace(PLACEHOLDER, GATEWAY_IP);
        let dir = machines.join(&block.machine);
        let mut command = command_in(netns.as_deref(), "bash");
        command
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(&dir)
            .env("PATH", &path)
            .env("HOME", &dir)
            .env("RUST_LOG", "info");
        match &block.service {
            None => {
                let out = command.output().unwrap();
                assert!(
                    out.status.success(),
                    "on {}:\n{script}\nfailed: {}\n{}\n{}",
                    block.machine,
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr),
                );
            }
            Some(ready) => {
                let mut service = Proc::from_command(command, &block.machine);
                service.wait_for(ready);
                services.push(service);
            }
        }
    }
    // The job ran to its end above; its ledger is audited by the guide itself. What the
    // services logged must hold no error.
    for service in &mut services {
        while let Ok(line) = service.lines.try_recv() {
            service.seen.push(line);
        }
        let errors: Vec<&String> = service
            .seen
            .iter()
            .filter(|l| l.contains("ERROR"))
            .collect();
        assert!(errors.is_empty(), "{} logged {errors:#?}", service.name);
    }
}
