use std::{fmt, path::PathBuf};

/// Where a setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The schema's default.
    Default,
    /// A config file, at a 1-based line and column.
    File {
        path: PathBuf,
        line: usize,
        column: usize,
    },
    /// An environment variable.
    Env(String),
    /// A command-line flag.
    Flag(String),
    /// Nowhere: a required key that no layer set.
    Unset,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("default"),
            Origin::File { path, line, column } => {
                write!(f, "{}:{line}:{column}", path.display())
            }
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::Flag(flag) => write!(f, "flag {flag}"),
            Origin::Unset => f.write_str("not set"),
        }
    }
}

/// A setting that is missing, malformed or inconsistent.
///
/// Displays as one line: where, which key, what is wrong, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key's dotted path, with indices for arrays: `gateway_addresses[0]`, `resources.cpu`.
    pub key: String,
    pub origin: Origin,
    pub problem: String,
    pub fix: String,
}

impl ConfigError {
    pub fn new(
        key: impl Into<String>,
        origin: Origin,
        problem: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        ConfigError {
            key: key.into(),
            origin,
            problem: problem.into(),
            fix: fix.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.origin == Origin::Unset {
            write!(f, "{}: {}", self.key, self.problem)?;
        } else {
            write!(f, "{}: {}: {}", self.origin, self.key, self.problem)?;
        }
        if !self.fix.is_empty() {
            write!(f, "; fix: {}", self.fix)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}
