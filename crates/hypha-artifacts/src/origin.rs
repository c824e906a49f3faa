//! Origins: where artifacts come from, through `object_store`.
//!
//! A [`Profile`] names a store by URL (`s3://bucket/path`, `gs://…`, `az://…`,
//! `https://host/path`, `file:///dir`) with its own options (credentials, endpoint, region).
//! Options not given fall back to the standard variables of each store (`AWS_*`, `GOOGLE_*`,
//! `AZURE_*`), and an option the store does not know is an error naming it, not silently
//! ignored.
//!
//! Reads are pinned: every ranged read carries the version the artifact was resolved at
//! (`If-Match` with the ETag, and the object version where the store has one), and the answer's
//! metadata is checked again, so an object replaced mid-way yields [`OriginError::Changed`]
//! rather than bytes of two versions.

use hypha_messages::artifact::{Kind, Request};
use std::{
    collections::BTreeMap,
    fmt,
    ops::Range,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt, stream::BoxStream};
use object_store::{
    GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreScheme, aws, azure, gcp, http,
    local::LocalFileSystem, path::Path as StorePath,
};
use serde::{Deserialize, Serialize};

pub use crate::error::OriginError;
use crate::{manifest::FileEntry, published::Publisher};

/// A named store and how to reach it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The store and the path under it that request URIs are relative to.
    pub url: String,
    /// Store options, as `object_store` names them: `aws_access_key_id`,
    /// `aws_secret_access_key`, `aws_region`, `aws_endpoint`, `allow_http`,
    /// `google_service_account`, `azure_storage_account_name`, ….
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

impl fmt::Debug for Profile {
    /// Option values are left out: they are mostly secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Profile")
            .field("url", &self.url)
            .field("options", &self.options.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The named origins a node may fetch from. Stores are built on first use and then shared.
#[derive(Debug, Default)]
pub struct Origins {
    profiles: BTreeMap<String, Profile>,
    built: Mutex<BTreeMap<String, Arc<Origin>>>,
}

impl Origins {
    pub fn new(profiles: BTreeMap<String, Profile>) -> Origins {
        Origins {
            profiles,
            built: Mutex::default(),
        }
    }

    /// The origin of `profile`, built once.
    pub fn get(&self, profile: &str) -> Result<Arc<Origin>, OriginError> {
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(origin) = built.get(profile) {
            return Ok(origin.clone());
        }
        let Some(config) = self.profiles.get(profile) else {
            return Err(OriginError::UnknownProfile {
                name: profile.to_string(),
                known: if self.profiles.is_empty() {
                    "none (add [artifacts.profiles.NAME] with a url)".into()
                } else {
                    self.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
                },
            });
        };
        let origin = Arc::new(Origin::new(profile, config)?);
        built.insert(profile.to_string(), origin.clone());
        Ok(origin)
    }
}

/// One store, with the path under it that URIs are relative to, or a peer that published
/// a file ([`crate::published`]).
pub struct Origin {
    url: String,
    source: Source,
}

enum Source {
    Store {
        store: Arc<dyn ObjectStore>,
        base: StorePath,
    },
    Publisher(Box<Publisher>),
}

impl fmt::Debug for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Origin").field("url", &self.url).finish()
    }
}

impl Origin {
    /// Builds the store a profile describes.
    pub fn new(name: &str, profile: &Profile) -> Result<Origin, OriginError> {
        let bad = |reason: String| OriginError::BadProfile {
            profile: name.to_string(),
            reason,
        };
        let url = url::Url::parse(&profile.url)
            .map_err(|e| bad(format!("url {:?}: {e}", profile.url)))?;
        let (scheme, base) = ObjectStoreScheme::parse(&url)
            .map_err(|e| bad(format!("url {:?}: {e}", profile.url)))?;
        let unknown = |key: &str, store: &str| {
            bad(format!(
                "option {key:?} is not a {store} option (see the object_store documentation for its config keys)"
            ))
        };
        let store: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::AmazonS3 => {
                let mut builder = aws::AmazonS3Builder::from_env().with_url(url.as_str());
                for (key, value) in &profile.options {
                    let key: aws::AmazonS3ConfigKey =
                        key.parse().map_err(|_| unknown(key, "S3"))?;
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(|e| bad(e.to_string()))?)
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                let mut builder = gcp::GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
                for (key, value) in &profile.options {
                    let key: gcp::GoogleConfigKey = key.parse().map_err(|_| unknown(key, "GCS"))?;
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(|e| bad(e.to_string()))?)
            }
            ObjectStoreScheme::MicrosoftAzure => {
                let mut builder = azure::MicrosoftAzureBuilder::from_env().with_url(url.as_str());
                for (key, value) in &profile.options {
                    let key: azure::AzureConfigKey =
                        key.parse().map_err(|_| unknown(key, "Azure"))?;
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(|e| bad(e.to_string()))?)
            }
            ObjectStoreScheme::Http => {
                let mut builder =
                    http::HttpBuilder::new().with_url(&url[..url::Position::BeforePath]);
                for (key, value) in &profile.options {
                    let key: object_store::ClientConfigKey =
                        key.parse().map_err(|_| unknown(key, "HTTP client"))?;
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(|e| bad(e.to_string()))?)
            }
            ObjectStoreScheme::Local => {
                if let Some(key) = profile.options.keys().next() {
                    return Err(unknown(key, "local file"));
                }
                Arc::new(LocalFileSystem::new())
            }
            other => return Err(bad(format!("{other:?} stores are not supported"))),
        };
        Ok(Origin {
            url: profile.url.clone(),
            source: Source::Store { store, base },
        })
    }

    /// The peer that published `published`, as an origin.
    pub(crate) fn publisher(
        network: hypha_network::Network,
        published: &hypha_messages::artifact::Published,
    ) -> Result<Origin, OriginError> {
        let publisher = Publisher::new(network, published)?;
        Ok(Origin {
            url: publisher.url(),
            source: Source::Publisher(Box::new(publisher)),
        })
    }

    /// The URL this origin was built from; artifacts of different origins never share a swarm.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Looks the request up: the object's metadata, or every object under the prefix with its
    /// path relative to the prefix, sorted by that path.
    pub async fn resolve(&self, request: &Request) -> Result<Vec<FileEntry>, OriginError> {
        let (store, base) = match &self.source {
            Source::Store { store, base } => (store, base),
            Source::Publisher(publisher) => return publisher.resolve().await,
        };
        let location: StorePath = base
            .parts()
            .chain(StorePath::from(request.uri.trim_matches('/')).parts())
            .collect();
        let store_error = |source| match source {
            object_store::Error::NotFound { .. } => OriginError::NotFound {
                uri: request.uri.clone(),
            },
            source => OriginError::Store {
                uri: request.uri.clone(),
                source,
            },
        };
        match request.kind {
            Kind::Object => {
                let meta = store.head(&location).await.map_err(store_error)?;
                Ok(vec![entry(String::new(), meta)])
            }
            Kind::Prefix => {
                let metas: Vec<ObjectMeta> = store
                    .list(Some(&location))
                    .try_collect()
                    .await
                    .map_err(store_error)?;
                let mut files = Vec::with_capacity(metas.len());
                for meta in metas {
                    let relative = meta
                        .location
                        .prefix_match(&location)
                        .map(|parts| parts.map(|p| p.as_ref().to_string()).collect::<Vec<_>>())
                        .unwrap_or_default();
                    if relative.is_empty()
                        || relative
                            .iter()
                            .any(|p| p.is_empty() || p == "." || p == ".." || p.contains('\\'))
                    {
                        return Err(OriginError::UnsafePath {
                            uri: request.uri.clone(),
                            path: meta.location.to_string(),
                        });
                    }
                    files.push(entry(relative.join("/"), meta));
                }
                if files.is_empty() {
                    return Err(OriginError::NotFound {
                        uri: request.uri.clone(),
                    });
                }
                files.sort_by(|a, b| a.relative.cmp(&b.relative));
                Ok(files)
            }
        }
    }

    /// Reads `range` of `file`, pinned to the version it was resolved at.
    pub async fn read(
        &self,
        file: &FileEntry,
        range: Range<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes, OriginError>>, OriginError> {
        let store = match &self.source {
            Source::Store { store, .. } => store,
            Source::Publisher(publisher) => return publisher.read(range).await,
        };
        let uri = file.location.clone();
        let location = StorePath::from(file.location.as_str());
        let options = GetOptions {
            if_match: file.e_tag.clone(),
            version: file.version.clone(),
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let result = store
            .get_opts(&location, options)
            .await
            .map_err(|source| match source {
                object_store::Error::Precondition { .. } | object_store::Error::NotFound { .. } => {
                    OriginError::Changed {
                        uri: uri.clone(),
                        expected: file.describe_version(),
                        found: "a different or no object".into(),
                    }
                }
                source => OriginError::Store {
                    uri: uri.clone(),
                    source,
                },
            })?;
        // Stores that ignore If-Match still say which version they served.
        let served = entry(String::new(), result.meta.clone());
        if served.size != file.size
            || (file.e_tag.is_some() && served.e_tag.is_some() && served.e_tag != file.e_tag)
            || (file.version.is_some() && served.version != file.version)
        {
            return Err(OriginError::Changed {
                uri,
                expected: file.describe_version(),
                found: served.describe_version(),
            });
        }
        if result.range != range {
            return Err(OriginError::Store {
                uri: uri.clone(),
                source: object_store::Error::Generic {
                    store: "origin",
                    source: format!("asked for bytes {range:?}, got {:?}", result.range).into(),
                },
            });
        }
        Ok(result
            .into_stream()
            .map_err(move |source| OriginError::Store {
                uri: uri.clone(),
                source,
            })
            .boxed())
    }
}

fn entry(relative: String, meta: ObjectMeta) -> FileEntry {
    FileEntry {
        relative,
        location: meta.location.to_string(),
        size: meta.size,
        e_tag: meta.e_tag,
        version: meta.version,
        last_modified_ms: meta.last_modified.timestamp_millis(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(url: &str, options: &[(&str, &str)]) -> Profile {
        Profile {
            url: url.into(),
            options: options
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn an_unknown_option_is_named() {
        let err = Origin::new(
            "models",
            &profile("s3://bucket", &[("aws_acces_key_id", "x")]),
        )
        .expect_err("typo");
        let text = err.to_string();
        assert!(
            text.contains("models") && text.contains("aws_acces_key_id"),
            "{text}"
        );
    }

    #[test]
    fn an_unknown_profile_lists_the_known_ones() {
        let origins = Origins::new([("models".to_string(), profile("file:///tmp", &[]))].into());
        let err = origins.get("data").expect_err("unknown");
        assert!(err.to_string().contains("known profiles: models"), "{err}");
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let p = profile("s3://b", &[("aws_secret_access_key", "hunter2")]);
        assert!(!format!("{p:?}").contains("hunter2"));
    }

    #[test]
    fn every_supported_scheme_builds() {
        for url in [
            "s3://bucket/models",
            "az://container/models",
            "https://example.invalid/models",
            "file:///tmp/models",
        ] {
            let options: &[(&str, &str)] = if url.starts_with("az") {
                &[("azure_storage_use_emulator", "true")]
            } else {
                &[]
            };
            let origin = Origin::new("p", &profile(url, options));
            assert!(origin.is_ok(), "{url}: {origin:?}");
        }
    }
}
