use std::path::PathBuf;

/// Everything that can go wrong issuing, loading or verifying certificates.
///
/// Each variant says what to do about it; errors about files name the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file exists and the caller did not allow overwriting it.
    #[error("{path} already exists; pass --force to overwrite it")]
    Exists { path: PathBuf },
    /// A PEM document holds something other than what was expected.
    #[error("{what}: {reason}")]
    Malformed { what: String, reason: String },
    /// The private key does not belong to the certificate.
    #[error(
        "{what}: the private key does not match the certificate's public key; use the key file generated together with this certificate"
    )]
    KeyMismatch { what: String },
    /// rcgen refused to produce a certificate or CRL.
    #[error("cannot issue {what}: {error}")]
    Issue { what: String, error: rcgen::Error },
}

impl Error {
    /// Attaches the file a malformed document came from.
    pub(crate) fn malformed(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Malformed {
            what: what.into(),
            reason: reason.into(),
        }
    }
}
