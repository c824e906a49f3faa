//! Resources sent between the jobs of one task on different workers: the receiving end of
//! the resource protocol ([`hypha_transfer`]) on a worker, and each job's inbox.
//!
//! A transfer is addressed to a **task**, never to a job or a path: the sending job's task
//! comes from its job spec, not from the executor, so a job can only ever reach the jobs of
//! its own task, and the receiving worker delivers into the inboxes of exactly those jobs.
//! Other jobs on the worker never see the file.
//!
//! **Only the task's peers are heard.** Knowing a task's id is not enough to send into it: a
//! transfer is taken only from the task's scheduler and the workers that run the task's jobs,
//! as the scheduler said with the dispatch and says again whenever they change
//! ([`Inboxes::set_peers`]). A peer of no task here is refused `not_in_task` before its header
//! is read; one of another task than the header names, after it, before a byte of the file.
//!
//! **A task belongs to its scheduler.** Task ids are not secret (a run record names one, and
//! every job of the task carries it), so the task's entry here is owned by the scheduler that
//! dispatched its first job on this worker, for as long as a job of the task runs here: a job
//! of the same task id from any other scheduler is refused ([`ForeignTask`]) before anything
//! changes, and only the owner names the task's peers. A scheduler restarted with its
//! certificate's key is the same peer, so it adopts its jobs as before.
//!
//! The bytes are staged in the job's directory under [`STAGING_DIR`] (opened beneath the job
//! directory like every other path, so an executor cannot redirect them), checked against the
//! sender's SHA-256, fsynced, and only then queued. The executor takes them with
//! `/resources/receive` or `/resources/fetch` (type `Peers`), which rename them into its
//! `out_dir` as `{sequence}-{name}`: the sequence number makes names from several peers, or
//! several rounds, distinct.
//!
//! Limits, and what happens at them: a peer that is neither the scheduler nor a named peer of
//! any task here is refused `not_in_task` at once, before its header is read, so that it holds
//! nothing; at most [`MAX_HANDSHAKES`] transfers are being asked for at once (their headers
//! read and their task checked; more are refused `busy`), at most
//! [`MAX_HANDSHAKES_PER_PEER`] of them by one peer and [`MAX_HANDSHAKES_PER_SCHEDULER`] by a
//! scheduler and the peers it named together (more are refused `busy`: a hostile scheduler
//! that names many certificates leaves the other schedulers' tasks half); only a
//! transfer a task's job takes then gets one of the [`MAX_CONCURRENT`] slots, at most
//! [`MAX_PER_PEER`] of them from one peer (more are refused `busy`, so one peer never takes
//! every slot, and a peer of no task takes none); at most [`MAX_WAITING`] files wait in one
//! inbox (more are refused `inbox_full`); a file must fit the disk beside every transfer
//! under way, with [`DISK_RESERVE`] to spare (else `too_large`; files waiting in inboxes are
//! on the disk already); the protocol's own limits (size, deadlines, the slowest rate) are
//! [`hypha_transfer`]'s.
//!
//! The parts: [`registry`] holds the tasks and their jobs' inboxes and decides who may send
//! to whom; [`inbox`] is one job's queue of arrived files; [`receive`] is the protocol's
//! receiving end, with its limits and the disk room it promises.

mod inbox;
mod receive;
mod registry;

use hypha_network::{Network, PeerId};

pub use inbox::{Arrived, Inbox};
pub use receive::serve;
pub use registry::{ForeignTask, Inboxes, Registration};

use crate::metrics;

/// Where received files wait, relative to the job's directory.
pub const STAGING_DIR: &str = ".hypha/inbox";
/// Transfers whose header is being read and task checked at the same time; more are refused
/// `busy`. Each takes at most the protocol's header timeout.
pub const MAX_HANDSHAKES: usize = 64;
/// Transfers one peer may be asking for at the same time (headers being read); more are refused
/// `busy`, so that a task peer that opens streams and sends no header leaves the others room.
pub const MAX_HANDSHAKES_PER_PEER: usize = 8;
/// Transfers a scheduler and the peers its tasks here name may be asking for at the same time,
/// all together; more are refused `busy`.
pub const MAX_HANDSHAKES_PER_SCHEDULER: usize = MAX_HANDSHAKES / 2;
/// Transfers received at the same time; more are refused `busy`.
pub const MAX_CONCURRENT: usize = 32;
/// Transfers received from one peer at the same time; more are refused `busy`.
pub const MAX_PER_PEER: usize = 8;
/// Disk space a received file must leave free.
pub const DISK_RESERVE: u64 = 1024 * 1024 * 1024;
/// Files waiting in one job's inbox; more are refused `inbox_full` until the job takes some.
pub const MAX_WAITING: usize = 256;
pub use hypha_transfer::{Header, PROTOCOL, SEND_PATIENCE, SendError};
/// [`hypha_transfer::send`], counted in the worker's metrics.
pub async fn send(
    network: &Network,
    peer: PeerId,
    header: &Header,
    file: std::fs::File,
    patience: std::time::Duration,
) -> Result<String, SendError> {
    let sent = hypha_transfer::send(network, peer, header, file, patience).await?;
    metrics::resource_bytes("sent", header.size);
    Ok(sent)
}
