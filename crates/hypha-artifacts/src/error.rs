//! Why an origin could not be used: shared by the stores behind artifacts ([`crate::origin`])
//! and the peers that publish a file and serve as its origin ([`crate::published`]).

/// An origin could not be used.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    #[error("no origin profile named {name:?}; known profiles: {known}")]
    UnknownProfile { name: String, known: String },
    /// What of the profile's settings is wrong, found by our checks, for the person who
    /// wrote them.
    #[error("profile {profile:?}: {reason}")]
    BadProfile { profile: String, reason: String },
    #[error("{uri}: not found at the origin")]
    NotFound { uri: String },
    #[error(
        "{uri} changed at the origin while it was being fetched (expected {expected}, found {found})"
    )]
    Changed {
        uri: String,
        expected: String,
        found: String,
    },
    #[error("{uri}: the origin has a path that cannot be written safely: {path:?}")]
    UnsafePath { uri: String, path: String },
    #[error("{uri}: {source}")]
    Store {
        uri: String,
        #[source]
        source: object_store::Error,
    },
}
