//! Why a run did not complete.

use crate::allocator::AllocationError;

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    #[error("slot {slot} failed {attempts} times; last: {last}")]
    Exhausted {
        slot: usize,
        attempts: u32,
        last: String,
    },
    #[error("stopped before the job completed")]
    Interrupted,
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// `reason`: how the server's job ended, as its worker reported it (a peer's words).
    #[error(
        "the parameter server on {peer} is gone ({reason}) and no checkpoint of its rounds reached the scheduler; the global model of the last round may be in its checkpoint there (parameter-server.safetensors in the job's directory)"
    )]
    ServerLost { peer: String, reason: String },
    #[error(transparent)]
    Record(#[from] crate::record::RecordError),
    #[error(
        "the run's checkpoint {path} cannot be read ({error}); the ledger counts the rounds in it as used, so the run cannot go on without it: put the file back, or start training afresh with a new ledger"
    )]
    Checkpoint {
        path: String,
        error: crate::checkpoint::CheckpointError,
    },
    #[error("the job file's [diloco] metrics file {path}: {error}")]
    Metrics { path: String, error: std::io::Error },
    /// `last`: the last one benched, when and why (the limits' words).
    #[error(
        "every trainer of the run was benched, so nothing can train ({count} in all; the last: {last}); the parameter server's log says what it refused, and `max_update_norm_ratio` / `bench_after_refusals` in [diloco] set the limits"
    )]
    EveryTrainerBenched { count: usize, last: String },
    #[error(
        "every executor exited, but the iteration still has slices that were never used; executors should fetch from their \"data\" reference until it answers that the data is done"
    )]
    Unfinished,
}
