//! DiLoCo's outer loop, as a parameter server computes it.
//!
//! Each round, every worker trains its copy of the global model θ for some inner steps and
//! sends a *pseudo-gradient* Δᵢ = θ − θᵢ together with the number of samples nᵢ it trained on.
//! The parameter server averages them weighted by samples, Δ = Σ nᵢΔᵢ / Σ nᵢ, which is right
//! for any number of workers (the reference system's pairwise `(a + b) / 2` is not beyond two),
//! and applies Δ as the gradient of an outer SGD step with Nesterov momentum, with exactly the
//! arithmetic of `torch.optim.SGD(nesterov=True, dampening=0, weight_decay=0)`:
//!
//! ```text
//! b₁ = g,  bₜ = μ·bₜ₋₁ + g          (the momentum buffer)
//! θ ← θ − η·(g + μ·bₜ)
//! ```
//!
//! - [`Accumulator`]: checks updates as they arrive ([`Update::from_source`], a chunk at a
//!   time) and keeps them where they are (their files), summing them a range of values at a
//!   time when the round closes: the server holds no sum the size of the model, whatever the
//!   number of workers.
//! - [`OuterOptimizer`]: the Nesterov step and its momentum buffers.
//! - [`Tensors`]: named f32 tensors read from and written to SafeTensors (F32, F64 and BF16
//!   in; each tensor written back in the dtype it came in).
//!
//! - [`codec`]: compressed updates (`bf16`, blockwise `int8`, `topk`, chunked `sparse`) and
//!   their wire format; [`ErrorFeedback`] carries what a codec dropped into the next update;
//!   [`Update`] reads every codec and the [`Accumulator`] sums them without decoding a copy.
//! - [`server`]: the parameter server's state: global model, round, what arrived, checkpoint;
//!   a round closes in place, a chunk at a time, each chunk's updates summed as it steps.
//! - [`file`]: SafeTensors read ([`file::Source`], [`file::Layout`]) and written
//!   ([`file::Writer`]) a piece at a time, for models of gigabytes.
//! - [`Fingerprint`]: the model's BLAKE3 fingerprint, taken as its values go by.
//! - [`robust`]: how far one round's updates may move the model: refused only when absurd,
//!   clipped against the round's own updates, the run's past and the model's size.
//!
//! This crate knows tensors, files and rounds; it knows nothing of networks or schedulers.

mod accumulate;
pub mod codec;
mod feedback;
pub mod file;
mod optimizer;
pub mod robust;
pub mod server;
mod tensors;

pub use accumulate::{Accumulator, Update};
pub use codec::Codec;
pub use feedback::ErrorFeedback;
pub use optimizer::OuterOptimizer;
pub use tensors::{
    Fingerprint, MAX_HEADER, MAX_UPDATE_VALUE, Metadata, Tensor, Tensors, metadata, read_metadata,
    read_metadata_within, with_metadata,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What is wrong with a file that is read as SafeTensors, found by this crate's own
    /// checks (sizes, offsets, the metadata it needs), described.
    #[error("not a SafeTensors file: {0}")]
    Format(String),
    #[error("not a SafeTensors file: {0}")]
    SafeTensors(safetensors::SafeTensorError),
    #[error("not a SafeTensors file: cannot read the header: {0}")]
    HeaderRead(std::io::Error),
    #[error("not a SafeTensors file: the header is not SafeTensors JSON: {0}")]
    HeaderJson(serde_json::Error),
    #[error("cannot encode a SafeTensors header: {0}")]
    HeaderEncode(serde_json::Error),
    #[error("tensor {name:?} is {dtype}; pseudo-gradients and models must be F32, F64 or BF16")]
    Dtype { name: String, dtype: String },
    /// A tensor that does not match the model's (shape, count, size), described.
    #[error("tensor {name:?}: {problem}")]
    Mismatch { name: String, problem: String },
    #[error("weight {0} is not a positive number of samples")]
    Weight(f64),
    #[error(
        "tensor {name:?} holds a NaN, an infinite value or one beyond ±1e9 (no round moves a parameter that far)"
    )]
    NotFinite { name: String },
    #[error("it claims {samples} samples; an update may count for at most {max}")]
    Samples { samples: u64, max: u64 },
    /// An update no honest trainer sends ([`robust::Limits::refuses`]).
    #[error("{0}")]
    Norm(robust::Absurd),
    #[error(
        "{clips} clips for {held} updates held{}: clips are given for every update of a sum that keeps them all",
        if *folded { " and a folded sum" } else { "" }
    )]
    Clips {
        clips: usize,
        held: usize,
        folded: bool,
    },
    #[error("no update was added")]
    Empty,
    /// An update folded into the round's sum as it arrived could not be read whole (it was
    /// checked, then its file failed): the round's sum is lost, the model is as it was.
    #[error(
        "an update could not be read while it was added to the round's sum ({0}): the round is lost"
    )]
    SumLost(std::sync::Arc<Error>),
    /// The server's model is gone: restore the server from its checkpoint.
    #[error(
        "an update held for the round could not be read again at its close ({0}): the model took part of the round's step and was dropped"
    )]
    RoundBroken(Box<Error>),
    #[error(transparent)]
    File(#[from] hypha_files::Error),
    #[error("cannot write the file: {0}")]
    Write(std::io::Error),
}
