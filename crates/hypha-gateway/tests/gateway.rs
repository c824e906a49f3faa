//! The `hypha-gateway` binary as a user runs it: real processes, real certificates, loopback TCP.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use hypha_certs::{
    Role, Roles,
    authority::{self, Authority, Validity},
};

const BIN: &str = env!("CARGO_BIN_EXE_hypha-gateway");

struct Fixture {
    dir: tempfile::TempDir,
    org: Authority,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = authority::create_root("GW Root", Validity::days(5)).unwrap();
        let org = authority::create_org(&root, "GW Org", Validity::days(5)).unwrap();
        std::fs::write(dir.path().join("root.pem"), root.cert_pem()).unwrap();
        let fixture = Fixture { dir, org };
        fixture.node("gateway", Roles::NONE.with(Role::Gateway));
        // A client that only probes health needs no role.
        fixture.node("prober", Roles::NONE);
        fixture
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn node(&self, name: &str, roles: Roles) {
        let node = authority::create_node(&self.org, name, &[], roles, Validity::days(1)).unwrap();
        std::fs::write(self.path(&format!("{name}-cert.pem")), node.chain_pem()).unwrap();
        std::fs::write(self.path(&format!("{name}-key.pem")), node.key_pem()).unwrap();
    }

    /// A gateway config listening on a free loopback port, with `extra` appended.
    fn config(&self, extra: &str) -> PathBuf {
        let path = self.path("gateway.toml");
        std::fs::write(
            &path,
            format!(
                "cert_pem = \"gateway-cert.pem\"\nkey_pem = \"gateway-key.pem\"\ntrust_pem = \"root.pem\"\nlisten_addresses = [\"/ip4/127.0.0.1/tcp/0\"]\n{extra}"
            ),
        )
        .unwrap();
        path
    }

    fn probe(&self, address: &str) -> Output {
        Command::new(BIN)
            .args(["probe", address, "--cert-pem"])
            .arg(self.path("prober-cert.pem"))
            .arg("--key-pem")
            .arg(self.path("prober-key.pem"))
            .arg("--trust-pem")
            .arg(self.path("root.pem"))
            .args(["--timeout", "10"])
            .output()
            .unwrap()
    }
}

/// A running gateway whose stderr is collected line by line.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(config: &Path) -> Self {
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a log line containing `needle` and returns it.
    fn wait_for(&mut self, needle: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("no line containing {needle:?}; saw {:#?}", self.seen));
            self.seen.push(line.clone());
            if line.contains(needle) {
                return line;
            }
        }
    }

    /// Sends SIGTERM, waits for exit, and returns the exit status and every log line.
    fn stop(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let status = self.child.wait().unwrap();
        let mut seen = std::mem::take(&mut self.seen);
        seen.extend(self.lines.try_iter());
        (status, seen)
    }
}

impl Drop for Running {
    /// A failing test must not leave a gateway running (it would hold the test's output open).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn init_writes_every_key_and_never_overwrites_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let out = Command::new(BIN)
        .args(["init", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&path).unwrap();
    for key in [
        "cert_pem",
        "key_pem",
        "trust_pem",
        "crls_pem",
        "gateway_addresses",
        "listen_addresses",
        "external_addresses",
        "exclude_cidr",
        "relay_circuit",
        "telemetry_endpoint",
        "telemetry_sampler",
        "telemetry_sample_ratio",
    ] {
        assert!(text.contains(key), "init output lacks {key}");
    }
    std::fs::write(&path, "edited").unwrap();
    let out = Command::new(BIN)
        .args(["init", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "edited");
    let out = Command::new(BIN)
        .args(["init", "--force", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
}

#[test]
fn running_gateway_answers_probes_and_stops_cleanly() {
    let fixture = Fixture::new();
    let mut gateway = Running::start(&fixture.config(""));
    let line = gateway.wait_for("nodes can join with gateway_addresses");
    let address = line.split('"').nth(1).unwrap().to_string();

    let out = fixture.probe(&address);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "probe failed: {out:?}");
    assert!(
        stdout.contains("gateway") && stdout.contains("healthy"),
        "{stdout}"
    );

    // A probe from outside the CA is refused during the handshake: unreachable, exit 1.
    let stranger_root = authority::create_root("Stranger", Validity::days(1)).unwrap();
    let stranger_org =
        authority::create_org(&stranger_root, "Stranger Org", Validity::days(1)).unwrap();
    let stranger = authority::create_node(
        &stranger_org,
        "stranger",
        &[],
        Roles::NONE,
        Validity::days(1),
    )
    .unwrap();
    std::fs::write(fixture.path("prober-cert.pem"), stranger.chain_pem()).unwrap();
    std::fs::write(fixture.path("prober-key.pem"), stranger.key_pem()).unwrap();
    let out = fixture.probe(&address);
    assert_eq!(out.status.code(), Some(1), "{out:?}");

    let (status, lines) = gateway.stop();
    assert!(status.success(), "SIGTERM is a clean shutdown: {status:?}");
    assert!(
        !lines.iter().any(|l| l.contains("ERROR")),
        "a successful run logs no ERROR line: {lines:#?}"
    );
}

#[test]
fn probe_of_a_dead_address_exits_1() {
    let fixture = Fixture::new();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let out = fixture.probe(&format!("/ip4/127.0.0.1/tcp/{port}"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}

/// Runs `hypha-gateway run` with a config and expects exit 2 with one error line containing
/// every `needle`, and no file written.
fn assert_bad_input(fixture: &Fixture, config: &Path, needles: &[&str]) {
    let before: Vec<_> = std::fs::read_dir(fixture.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let out = Command::new(BIN)
        .args(["run", "--config"])
        .arg(config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one clear line: {stderr}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "{needle:?} missing from: {stderr}"
        );
    }
    let after: Vec<_> = std::fs::read_dir(fixture.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(before, after, "nothing written");
}

#[test]
fn bad_input_gets_one_line_naming_the_file_and_the_fix_and_exit_2() {
    let fixture = Fixture::new();

    // A missing certificate.
    std::fs::rename(fixture.path("gateway-cert.pem"), fixture.path("moved.pem")).unwrap();
    let config = fixture.config("");
    assert_bad_input(
        &fixture,
        &config,
        &["cert_pem", "gateway-cert.pem", "hypha-certutil node"],
    );
    std::fs::rename(fixture.path("moved.pem"), fixture.path("gateway-cert.pem")).unwrap();

    // A key that belongs to another certificate.
    std::fs::copy(
        fixture.path("prober-key.pem"),
        fixture.path("gateway-key.pem"),
    )
    .unwrap();
    assert_bad_input(
        &fixture,
        &config,
        &["key_pem", "does not match", "hypha-certutil node"],
    );
    fixture.node("gateway", Roles::NONE.with(Role::Gateway));

    // A certificate that grants other roles than the gateway's.
    fixture.node("gateway", Roles::NONE.with(Role::Worker));
    assert_bad_input(
        &fixture,
        &config,
        &["cert_pem", "not the gateway role", "--role gateway"],
    );
    fixture.node("gateway", Roles::NONE.with(Role::Gateway));

    // A typo in a key: the position and a suggestion.
    let config = fixture.config("relay_circut = false\n");
    assert_bad_input(
        &fixture,
        &config,
        &[
            "gateway.toml:5:1",
            "relay_circut",
            "did you mean relay_circuit",
        ],
    );

    // A malformed address.
    let config = fixture.config("external_addresses = [\"127.0.0.1:4001\"]\n");
    assert_bad_input(
        &fixture,
        &config,
        &["gateway.toml:5:", "external_addresses[0]", "fix:"],
    );

    // A gateway inside exclude_cidr.
    let config = fixture.config(
        "gateway_addresses = [\"/ip4/10.0.0.1/tcp/4001\"]\nexclude_cidr = [\"10.0.0.0/8\"]\n",
    );
    assert_bad_input(
        &fixture,
        &config,
        &["gateway_addresses[0]", "exclude_cidr", "gateway.toml:6:"],
    );

    // Malformed TOML.
    let config = fixture.config("listen_addresses = [\n");
    assert_bad_input(&fixture, &config, &["gateway.toml:", "TOML"]);
}

/// Writes a CRL revoking `revoked` (names of fixture nodes) into `crl.pem`.
fn write_crl(fixture: &Fixture, revoked: &[&str]) {
    let mut crl: Option<String> = None;
    for name in revoked {
        let cert = std::fs::read(fixture.path(&format!("{name}-cert.pem"))).unwrap();
        crl = Some(
            authority::revoke(
                &fixture.org,
                crl.as_deref().map(str::as_bytes),
                &cert,
                authority::Reason::KeyCompromise,
                30,
            )
            .unwrap(),
        );
    }
    std::fs::write(fixture.path("crl.pem"), crl.unwrap()).unwrap();
}

fn probe_as(fixture: &Fixture, name: &str, address: &str) -> Output {
    for ext in ["cert", "key"] {
        std::fs::copy(
            fixture.path(&format!("{name}-{ext}.pem")),
            fixture.path(&format!("prober-{ext}.pem")),
        )
        .unwrap();
    }
    fixture.probe(address)
}

/// Waits until probing as `name` fails (exit 1), for at most `limit`.
fn refused_within(fixture: &Fixture, name: &str, address: &str, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if probe_as(fixture, name, address).status.code() == Some(1) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// An operator revokes a certificate while the gateway runs: the new CRL is in force within
/// seconds of the file changing; SIGHUP reloads too; a CRL file that does not parse is named in
/// a warning and the one in force stays. (Checked by not spawning the watcher in
/// `Node::start_with`: the revoked probe keeps getting in.)
#[test]
fn a_revocation_list_changed_on_disk_or_signalled_takes_effect_without_a_restart() {
    let fixture = Fixture::new();
    for name in ["old", "first", "second"] {
        fixture.node(name, Roles::NONE);
    }
    write_crl(&fixture, &["old"]);
    let config = fixture.config("crls_pem = \"crl.pem\"\n");
    let mut gateway = Running::start(&config);
    let line = gateway.wait_for("nodes can join with gateway_addresses");
    let address = line.split('"').nth(1).unwrap().to_string();
    assert!(probe_as(&fixture, "first", &address).status.success());
    assert_eq!(probe_as(&fixture, "old", &address).status.code(), Some(1));

    // The file changes: `first` is refused from then on, `second` still gets in.
    write_crl(&fixture, &["old", "first"]);
    assert!(
        refused_within(&fixture, "first", &address, Duration::from_secs(15)),
        "the revoked certificate still gets in"
    );
    gateway.wait_for("trust store reloaded");
    assert!(probe_as(&fixture, "second", &address).status.success());

    // SIGHUP reloads whether or not a file changed.
    let pid = gateway.child.id().to_string();
    Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    let line = gateway.wait_for("trust store reloaded");
    assert!(line.contains("SIGHUP"), "{line}");
    assert_eq!(probe_as(&fixture, "first", &address).status.code(), Some(1));

    // A broken file: named in a warning, the CRL in force stays.
    std::fs::write(
        fixture.path("crl.pem"),
        "-----BEGIN X509 CRL-----\ngarbage\n",
    )
    .unwrap();
    let line = gateway.wait_for("cannot reload the trust store");
    assert!(
        line.contains("crl.pem"),
        "the warning names the file: {line}"
    );
    assert_eq!(probe_as(&fixture, "first", &address).status.code(), Some(1));
    assert!(probe_as(&fixture, "second", &address).status.success());

    let (status, lines) = gateway.stop();
    assert!(status.success(), "{status:?}");
    assert!(!lines.iter().any(|l| l.contains("ERROR")), "{lines:#?}");
}
