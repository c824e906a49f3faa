//! The body of every error answer.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// An error the bridge answers with (and sends as a receive stream's error event), beside an
/// HTTP status that fits it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// Stable and machine-readable: `bad_request`, `path_refused`, `not_found`, `too_large`,
    /// `data_wait`, `send_failed`, `scheduler_unreachable`, `job_ending`, …
    pub code: String,
    /// For the person reading the executor's log: what went wrong and what to do.
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorBody {
            code: code.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}
