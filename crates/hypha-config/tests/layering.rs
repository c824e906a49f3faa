#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::PathBuf;

use hypha_config::{DefaultValue, Key, Kind, Layers, Origin, Schema, network, telemetry};
use serde::Deserialize;

static RESOURCE_KEYS: [Key; 2] = [
    Key {
        name: "cpu",
        kind: Kind::Integer,
        default: DefaultValue::Value("4"),
        doc: "Cores.",
    },
    Key {
        name: "memory",
        kind: Kind::Integer,
        default: DefaultValue::Value("16"),
        doc: "GB.",
    },
];

fn schema() -> Schema {
    let mut keys = network::keys();
    keys.extend(telemetry::keys());
    keys.push(Key {
        name: "work_dir",
        kind: Kind::Path,
        default: DefaultValue::Value(r#""/var/hypha/work""#),
        doc: "Where jobs run.",
    });
    keys.push(Key {
        name: "resources",
        kind: Kind::Table(&RESOURCE_KEYS),
        default: DefaultValue::Value("{}"),
        doc: "What this node offers.",
    });
    Schema::new("hypha-test", keys)
}

const FILE: &str = r#"cert_pem = "certs/n.pem"
key_pem = "/abs/key.pem"
trust_pem = "certs/root.pem"
gateway_addresses = [
    "/ip4/203.0.113.7/tcp/4001",
    "/ip4/10.1.2.3/tcp/4001",
]
exclude_cidr = ["10.0.0.0/8"]
work_dir = "work"

[resources]
cpu = 8
"#;

#[derive(Debug, Deserialize)]
struct Worker {
    work_dir: PathBuf,
    resources: Resources,
}

#[derive(Debug, Deserialize)]
struct Resources {
    cpu: i64,
    memory: i64,
}

fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn file_then_environment_then_flags() {
    let schema = schema();
    let loaded = Layers::new(&schema)
        .file_text("/etc/hypha/worker.toml", FILE)
        .unwrap()
        .env(vars(&[
            ("HYPHA_RESOURCES__MEMORY", "64"),
            ("HYPHA_WORK_DIR", "/from/env"),
            ("PATH", "/bin"),
        ]))
        .unwrap()
        .flag("work_dir", "/from/flag", "--work-dir")
        .unwrap()
        .load()
        .unwrap();
    let w: Worker = loaded.section().unwrap();
    assert_eq!(
        w.work_dir,
        PathBuf::from("/from/flag"),
        "flags beat the environment"
    );
    assert_eq!(w.resources.cpu, 8, "the file beats defaults");
    assert_eq!(w.resources.memory, 64, "nested keys from HYPHA_A__B");
    assert_eq!(loaded.origin("work_dir"), Origin::Flag("--work-dir".into()));
    assert_eq!(
        loaded.origin("resources.memory"),
        Origin::Env("HYPHA_RESOURCES__MEMORY".into())
    );
    assert_eq!(
        loaded.origin("resources.cpu"),
        Origin::File {
            path: "/etc/hypha/worker.toml".into(),
            line: 12,
            column: 1
        }
    );
    assert_eq!(loaded.origin("telemetry_protocol"), Origin::Default);

    let net: network::NetworkConfig = loaded.section().unwrap();
    assert_eq!(
        net.cert_pem,
        PathBuf::from("/etc/hypha/certs/n.pem"),
        "relative to the file"
    );
    assert_eq!(net.key_pem, PathBuf::from("/abs/key.pem"));
    assert!(net.relay_circuit, "defaults fill what no layer sets");
}

#[test]
fn environment_lists_take_toml_arrays_or_commas() {
    let schema = schema();
    for value in [
        r#"["/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2"]"#,
        "/ip4/1.2.3.4/tcp/1, /ip4/5.6.7.8/tcp/2",
    ] {
        let loaded = Layers::new(&schema)
            .file_text("w.toml", FILE)
            .unwrap()
            .env(vars(&[("HYPHA_LISTEN_ADDRESSES", value)]))
            .unwrap()
            .load()
            .unwrap();
        let net: network::NetworkConfig = loaded.section().unwrap();
        assert_eq!(net.listen_addresses.len(), 2, "{value}");
    }
}

#[test]
fn unknown_key_names_its_position_and_a_suggestion() {
    let schema = schema();
    let text = "cert_pem = \"a\"\nkey_pem = \"b\"\ntrust_pem = \"c\"\n\n[resources]\ncpus = 3\n";
    let err = Layers::new(&schema).file_text("w.toml", text).unwrap_err();
    assert_eq!(err.key, "resources.cpus");
    assert_eq!(
        err.origin,
        Origin::File {
            path: "w.toml".into(),
            line: 6,
            column: 1
        }
    );
    assert!(err.fix.contains("did you mean cpu"), "{err}");
    assert_eq!(
        err.to_string(),
        "w.toml:6:1: resources.cpus: unknown key for hypha-test; fix: did you mean cpu? Otherwise remove it (`hypha-test init` lists every key)"
    );
}

/// One shell's variables reach every Hypha program: a variable that is no setting of this one
/// is ignored, and named with the closest setting where one is close (a typo).
#[test]
fn environment_variables_of_no_setting_are_ignored_and_typos_get_the_closest_setting() {
    let schema = schema();
    let loaded = Layers::new(&schema)
        .file_text("w.toml", FILE)
        .unwrap()
        .env(vars(&[
            ("HYPHA_WROK_DIR", "/x"),
            ("HYPHA_MIRROR", "x"),
            ("HYPHA_RESOURCES__MEMROY", "3"),
            ("HYPHA_WORK_DIR", "/from/env"),
        ]))
        .unwrap()
        .load()
        .unwrap();
    let w: Worker = loaded.section().unwrap();
    assert_eq!(w.work_dir, PathBuf::from("/from/env"));
    let ignored: Vec<(String, Option<String>)> = loaded
        .ignored_variables()
        .iter()
        .map(|i| (i.name.clone(), i.closest.clone()))
        .collect();
    assert_eq!(
        ignored,
        [
            ("HYPHA_MIRROR".to_string(), None),
            (
                "HYPHA_RESOURCES__MEMROY".to_string(),
                Some("HYPHA_RESOURCES__MEMORY".to_string())
            ),
            (
                "HYPHA_WROK_DIR".to_string(),
                Some("HYPHA_WORK_DIR".to_string())
            ),
        ]
    );
    assert_eq!(
        loaded.ignored_variables()[2].to_string(),
        "HYPHA_WROK_DIR names no setting of this program and is ignored; did you mean HYPHA_WORK_DIR?"
    );
}

#[test]
fn wrong_types_are_named_where_they_are_written() {
    let schema = schema();
    let text = "cert_pem = \"a\"\nkey_pem = \"b\"\ntrust_pem = \"c\"\nrelay_circuit = \"yes\"\n";
    let err = Layers::new(&schema).file_text("w.toml", text).unwrap_err();
    assert_eq!(err.key, "relay_circuit");
    assert_eq!(
        err.origin,
        Origin::File {
            path: "w.toml".into(),
            line: 4,
            column: 1
        }
    );
    assert!(
        err.problem.contains("expected true or false, found string"),
        "{err}"
    );

    let err = Layers::new(&schema)
        .env(vars(&[("HYPHA_RESOURCES__CPU", "many")]))
        .unwrap_err();
    assert!(
        err.to_string().starts_with(
            "environment variable HYPHA_RESOURCES__CPU: resources.cpu: \"many\" is not an integer"
        ),
        "{err}"
    );
}

#[test]
fn malformed_address_is_named_by_index_and_position() {
    let schema = schema();
    let text = "cert_pem = \"a\"\nkey_pem = \"b\"\ntrust_pem = \"c\"\nlisten_addresses = [\"/ip4/0.0.0.0/tcp/1\", \"not-an-address\"]\n";
    let err = Layers::new(&schema).file_text("w.toml", text).unwrap_err();
    assert_eq!(err.key, "listen_addresses[1]");
    assert_eq!(
        err.origin,
        Origin::File {
            path: "w.toml".into(),
            line: 4,
            column: 43
        }
    );
    assert!(
        err.problem
            .contains("\"not-an-address\" is not a multiaddr"),
        "{err}"
    );
    assert!(err.fix.contains("/ip4/203.0.113.7/tcp/4001"), "{err}");

    let err = Layers::new(&schema)
        .env(vars(&[("HYPHA_EXCLUDE_CIDR", "10.0.0.0/8,10.0.0.0/33")]))
        .unwrap_err();
    assert_eq!(err.key, "exclude_cidr[1]");
    assert_eq!(err.origin, Origin::Env("HYPHA_EXCLUDE_CIDR".into()));
}

#[test]
fn gateway_inside_exclude_cidr_names_both_places() {
    let schema = schema();
    let loaded = Layers::new(&schema)
        .file_text("w.toml", FILE)
        .unwrap()
        .load()
        .unwrap();
    let err = network::NetworkConfig::from_loaded(&loaded).unwrap_err();
    assert_eq!(err.key, "gateway_addresses[1]");
    assert_eq!(
        err.origin,
        Origin::File {
            path: "w.toml".into(),
            line: 6,
            column: 5
        }
    );
    assert!(
        err.problem
            .contains("inside exclude_cidr range 10.0.0.0/8 (set at w.toml:8:17)"),
        "{err}"
    );
    assert!(
        err.fix.contains("remove 10.0.0.0/8 from exclude_cidr"),
        "{err}"
    );
}

#[test]
fn missing_required_key_says_how_to_set_it() {
    let schema = schema();
    let err = Layers::new(&schema)
        .file_text("w.toml", "key_pem = \"b\"\ntrust_pem = \"c\"\n")
        .unwrap()
        .load()
        .unwrap_err();
    assert_eq!(err.key, "cert_pem");
    assert!(err.fix.contains("HYPHA_CERT_PEM"), "{err}");
}

#[test]
fn syntax_errors_point_at_the_position() {
    let schema = schema();
    let err = Layers::new(&schema)
        .file_text("w.toml", "cert_pem = \"a\"\nkey_pem = = 3\n")
        .unwrap_err();
    assert!(matches!(err.origin, Origin::File { line: 2, .. }), "{err}");
}

#[test]
fn template_lists_every_key_and_parses_back_to_the_defaults() {
    let schema = schema();
    let template = schema.template();
    for key in schema.keys() {
        assert!(template.contains(key.name), "template lacks {}", key.name);
    }
    assert!(
        template.contains("# crls_pem = "),
        "optional keys are commented out"
    );
    let loaded = Layers::new(&schema)
        .file_text("t.toml", &template)
        .unwrap()
        .load()
        .unwrap();
    let w: Worker = loaded.section().unwrap();
    assert_eq!(w.resources.cpu, 4);
    assert!(network::NetworkConfig::from_loaded(&loaded).is_ok());
}

static STORE_KEYS: [Key; 2] = [
    Key {
        name: "url",
        kind: Kind::String,
        default: DefaultValue::Required {
            example: r#""s3://bucket""#,
        },
        doc: "Where.",
    },
    Key {
        name: "options",
        kind: Kind::StringMap,
        default: DefaultValue::Value("{}"),
        doc: "How.",
    },
];

fn schema_with_stores() -> Schema {
    Schema::new(
        "hypha-test",
        vec![Key {
            name: "stores",
            kind: Kind::Map(&STORE_KEYS),
            default: DefaultValue::Value("{}"),
            doc: "Named stores.",
        }],
    )
}

#[derive(Debug, Deserialize)]
struct Stores {
    stores: std::collections::BTreeMap<String, Store>,
}

#[derive(Debug, Deserialize)]
struct Store {
    url: String,
    #[serde(default)]
    options: std::collections::BTreeMap<String, String>,
}

#[test]
fn named_tables_take_any_name_and_check_their_keys() {
    let schema = schema_with_stores();
    let text = "[stores.models]\nurl = \"s3://models\"\noptions = { region = \"eu-west-1\" }\n\n[stores.data]\nurl = \"gs://data\"\n";
    let loaded = Layers::new(&schema)
        .file_text("w.toml", text)
        .unwrap()
        .env(vars(&[(
            "HYPHA_STORES__DATA__OPTIONS__ENDPOINT",
            "http://x",
        )]))
        .unwrap()
        .load()
        .unwrap();
    let stores: Stores = loaded.section().unwrap();
    assert_eq!(stores.stores["models"].url, "s3://models");
    assert_eq!(stores.stores["models"].options["region"], "eu-west-1");
    assert_eq!(stores.stores["data"].url, "gs://data");
    assert_eq!(stores.stores["data"].options["endpoint"], "http://x");
    let template = schema.template();
    assert!(
        template.contains("# [stores.NAME]\n#   Where.\n# url = \"s3://bucket\" (required)\n"),
        "{template}"
    );
    Layers::new(&schema)
        .file_text("init.toml", &template)
        .unwrap()
        .load()
        .unwrap();

    let typo = "[stores.models]\nurl = \"s3://models\"\nregion = \"x\"\n";
    let err = Layers::new(&schema).file_text("w.toml", typo).unwrap_err();
    assert_eq!(err.key, "stores.models.region");
    assert_eq!(
        err.origin,
        Origin::File {
            path: "w.toml".into(),
            line: 3,
            column: 1
        }
    );

    let missing = "[stores.models]\noptions = {}\n";
    let err = Layers::new(&schema)
        .file_text("w.toml", missing)
        .unwrap()
        .load()
        .unwrap_err();
    assert_eq!(err.key, "stores.models.url");
    assert_eq!(err.problem, "required but not set");

    let not_string = "[stores.models]\nurl = \"s3://m\"\noptions = { retries = 3 }\n";
    let err = Layers::new(&schema)
        .file_text("w.toml", not_string)
        .unwrap_err();
    assert_eq!(err.key, "stores.models.options");
    assert!(err.problem.contains("a table of strings"), "{err}");
}
