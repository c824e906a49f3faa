//! Hypha workers.
//!
//! So far the market side, as plain state machines with the clock passed in (so that every
//! decision is testable without waiting):
//!
//! - [`arbiter`]: which advertisements to answer and with what offer, under the `[offer]`
//!   settings (`price`, `floor`, `strategy = "whole" | "flexible"`).
//! - [`lease`]: reservations of the worker's resources: a short temporary lease per open offer
//!   (no double booking), a renewable lease once accepted, expiry on a monotonic clock.
//!
//! The node that drives them over the network, jobs, executors and the job bridge come next.

pub mod arbiter;
pub mod lease;
pub mod resources;
