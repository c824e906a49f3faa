/// Everything that can go wrong issuing, loading or verifying certificates.
///
/// Each variant says what to do about it; errors about files name the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error(transparent)]
    File(#[from] hypha_files::Error),
    /// A PEM document holds something other than what was expected: what, described by
    /// our checks or the PEM and X.509 parsers (whose errors borrow the input).
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
