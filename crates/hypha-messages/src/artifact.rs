//! Artifact requests: an object or a prefix of a named origin, a destination, and optionally
//! an archive to unpack. Job files, job specs, the job bridge and `hypha-worker fetch` state
//! them this way; `hypha-artifacts` fetches them.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The profile a request uses when it names none.
pub const DEFAULT_PROFILE: &str = "default";

/// One artifact to fetch, as job specs, the job bridge and the command line state it.
///
/// ```toml
/// [[artifacts]]
/// profile = "models"                   # default: "default"
/// uri = "llama/pytorch_model.bin"      # a key under the profile's URL
/// destination = "models/model.bin"
///
/// [[artifacts]]
/// uri = "tokenizers/bert/"
/// kind = "prefix"                      # every object under it, the tree kept
/// destination = "tokenizer"
///
/// [[artifacts]]
/// uri = "envs/python.tar.gz"
/// destination = "envs/python.tar.gz"
/// unpack = { destination = "envs/python" }   # method: auto (default), tar, tar_gz, zip
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    #[serde(default = "default_profile")]
    pub profile: String,
    /// The object's key, or the prefix, relative to the profile's URL.
    pub uri: String,
    #[serde(default)]
    pub kind: Kind,
    /// Where the object is written; for a prefix, the directory that receives the tree.
    pub destination: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpack: Option<Unpack>,
}

fn default_profile() -> String {
    DEFAULT_PROFILE.to_string()
}

/// Whether a request names one object or everything under a prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    #[default]
    Object,
    Prefix,
}

/// Unpack the fetched archive into a directory of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unpack {
    pub destination: PathBuf,
    #[serde(default)]
    pub method: UnpackMethod,
}

/// How an archive is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UnpackMethod {
    /// By the file name (`.tar`, `.tar.gz`, `.tgz`, `.zip`), else by the first bytes.
    #[default]
    Auto,
    Tar,
    TarGz,
    Zip,
}

impl Request {
    /// The same request with relative destinations resolved against `base`.
    pub fn resolved_against(mut self, base: &std::path::Path) -> Request {
        if self.destination.is_relative() {
            self.destination = base.join(&self.destination);
        }
        if let Some(unpack) = &mut self.unpack
            && unpack.destination.is_relative()
        {
            unpack.destination = base.join(&unpack.destination);
        }
        self
    }
}

impl Request {
    /// Checks that the destinations stay inside the directory they are relative to: no
    /// absolute path, no `..`, not empty.
    pub fn check_destinations(&self) -> Result<(), String> {
        let unpack = self
            .unpack
            .as_ref()
            .map(|u| ("unpack.destination", &u.destination));
        for (key, path) in std::iter::once(("destination", &self.destination)).chain(unpack) {
            let inside = path.components().all(|c| {
                matches!(
                    c,
                    std::path::Component::Normal(_) | std::path::Component::CurDir
                )
            }) && path
                .components()
                .any(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(format!(
                    "{key} = {path:?} must be a relative path inside the job's directory (no leading /, no ..)"
                ));
            }
        }
        Ok(())
    }
}

/// Removes duplicates, keeping the first of each, so that several stages (or jobs) asking
/// for the same artifact fetch it once.
pub fn deduplicate(requests: impl IntoIterator<Item = Request>) -> Vec<Request> {
    let mut seen = std::collections::HashSet::new();
    requests
        .into_iter()
        .filter(|r| seen.insert(r.clone()))
        .collect()
}

/// A file one peer publishes for others to fetch in an artifact swarm whose origin is that
/// peer: each chunk leaves the publisher about once, and the fetchers pass chunks on to each
/// other (a parameter server's global model, when several trainers join at once). Fetchers
/// verify what they get as from any origin; the publisher serves it only to the peers it
/// admits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Published {
    /// The publishing peer's ID (base58).
    pub peer: String,
    /// The file's name at the publisher: random, one per publication.
    pub name: String,
    pub size: u64,
    /// The version the file was published at: reads of another version are refused.
    pub e_tag: String,
    /// SHA-256 of the file, hex: what a fetcher hands on must hash to it (the other fetchers'
    /// chunks are checked only against what they announced).
    pub sha256: String,
    /// How many peers were told to fetch it at the same moment (this one included); they
    /// wait a moment for each other before reading from the publisher, so that each chunk
    /// leaves it once. 0: not known, start at once.
    #[serde(default)]
    pub fetchers: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        #[derive(Deserialize)]
        struct Spec {
            artifacts: Vec<Request>,
        }
        let spec: Spec = toml::from_str(
            r#"
            [[artifacts]]
            uri = "a.bin"
            destination = "a.bin"
            [[artifacts]]
            profile = "models"
            uri = "tok/"
            kind = "prefix"
            destination = "tok"
            [[artifacts]]
            uri = "env.tgz"
            destination = "env.tgz"
            unpack = { destination = "env", method = "tar_gz" }
            "#,
        )
        .expect("valid");
        assert_eq!(spec.artifacts[0].profile, "default");
        assert_eq!(spec.artifacts[0].kind, Kind::Object);
        assert_eq!(spec.artifacts[1].kind, Kind::Prefix);
        assert_eq!(
            spec.artifacts[2].unpack.as_ref().map(|u| u.method),
            Some(UnpackMethod::TarGz)
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml::from_str::<Request>("uri = \"a\"\ndestination = \"a\"\nunpak = {}\n")
            .expect_err("typo");
        assert!(err.to_string().contains("unpak"), "{err}");
    }

    #[test]
    fn destinations_must_stay_inside() {
        let mut request: Request =
            toml::from_str("uri = \"a\"\ndestination = \"models/a.bin\"\n").expect("valid");
        assert_eq!(request.check_destinations(), Ok(()));
        for bad in ["/etc/passwd", "../a", "models/../../a", "", "."] {
            request.destination = bad.into();
            let err = request.check_destinations().expect_err(bad);
            assert!(err.starts_with("destination = "), "{err}");
        }
        request.destination = "a.tgz".into();
        request.unpack = Some(Unpack {
            destination: "/tmp/x".into(),
            method: UnpackMethod::Auto,
        });
        let err = request.check_destinations().expect_err("unpack outside");
        assert!(err.starts_with("unpack.destination"), "{err}");
    }

    #[test]
    fn duplicates_are_fetched_once() {
        let a = Request {
            profile: "default".into(),
            uri: "a".into(),
            kind: Kind::Object,
            destination: "a".into(),
            unpack: None,
        };
        let mut b = a.clone();
        b.uri = "b".into();
        assert_eq!(deduplicate([a.clone(), b.clone(), a.clone()]), vec![a, b]);
    }
}
