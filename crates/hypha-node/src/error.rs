use std::process::ExitCode;

use hypha_config::ConfigError;

/// Why a node program stopped: the report at the programs' edge, as `anyhow` would be in a
/// binary. Its two variants are the exit codes; each holds the message shown to the user,
/// with the cause and the fix already in it (nothing branches on a report's cause, and the
/// libraries below keep their errors typed).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The user's input is wrong: config, certificate files, addresses. Exit code 2.
    #[error("{0}")]
    BadInput(String),
    /// Anything else: the network could not start, a peer is unreachable. Exit code 1.
    #[error("{0}")]
    Failed(String),
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::BadInput(e.to_string())
    }
}

impl Error {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Error::BadInput(_) => ExitCode::from(2),
            Error::Failed(_) => ExitCode::FAILURE,
        }
    }
}

/// Prints the outcome of a program as one line on stderr and returns its exit code.
pub fn report(result: Result<(), Error>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
