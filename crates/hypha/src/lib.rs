//! The `hypha` command, a newcomer's front door.
//!
//! - [`quickstart`]: a complete local training network (certificates, gateway, data node,
//!   parameter server, trainers, scheduler) as real processes of the real binaries, one
//!   command from nothing to a trained model.
//!
//! This crate drives the other programs from outside, as a user would; it knows their
//! configuration files, what they print for their user, and their health answers over the
//! network ([`readiness`]), not their insides.

pub mod quickstart;
pub mod readiness;
