//! What the scheduler's process tests share: [`hypha_scheduler::testing`].

pub use hypha_testing::cluster::*;
