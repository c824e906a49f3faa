//! [`LedgerHandle`]: a [`Ledger`] run as an actor with pipelined group commit.
//!
//! The actor applies commands in memory as they arrive and commits their transitions in
//! batches on a blocking thread, one commit at a time and in order: while one commit is on its
//! way to disk, everything that arrives is applied and waits for the next. A caller is answered
//! only once the commit holding its transitions has returned, so no answer ever reports
//! something the file does not hold, and the state machine never waits for the disk. One
//! fsync thus serves every caller that arrived during the previous one. The queue holds
//! [`QUEUE`] commands and callers wait for room when it is full, so a flood of callers slows
//! down instead of growing memory. Once a second the actor returns the slices of lapsed
//! leases.
//!
//! A failed commit stops the actor: its memory may be ahead of its file, so it answers
//! [`Error::Stopped`] from then on, and a ledger reopened from the file continues from the
//! last commit that succeeded.

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

use crate::{CheckpointToken, Consumed, Error, Grant, IterationSpec, Ledger, Progress, SliceKey};

/// The most commands taken from the queue in one go.
const MAX_BATCH: usize = 4096;
/// Commands that may wait for the actor.
const QUEUE: usize = 8192;
/// How often lapsed leases are looked for.
const EXPIRY_TICK: Duration = Duration::from_secs(1);

/// A cloneable handle on a running ledger. The ledger stops, after committing what it has,
/// when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct LedgerHandle {
    commands: mpsc::Sender<Command>,
    token: CheckpointToken,
    spec: Arc<IterationSpec>,
}

type Reply<T> = oneshot::Sender<Result<T, Error>>;

#[derive(Debug)]
enum Command {
    Assign {
        worker: String,
        want: usize,
        cached: HashSet<u64>,
        reply: Reply<Grant>,
    },
    Consume {
        worker: String,
        keys: Vec<SliceKey>,
        round: u64,
        reply: Reply<Consumed>,
    },
    CommitRound {
        worker: String,
        round: u64,
        reply: Reply<Vec<SliceKey>>,
    },
    DropRound {
        worker: String,
        round: u64,
        reply: Reply<Vec<SliceKey>>,
    },
    ReleaseWorker {
        worker: String,
        reply: Reply<usize>,
    },
    ReleaseUnheld {
        worker: String,
        holding: HashSet<SliceKey>,
        reply: Reply<usize>,
    },
    ReleaseAssigned {
        worker: String,
        reply: Reply<usize>,
    },
    Renew {
        worker: String,
    },
    Progress {
        reply: Reply<Progress>,
    },
}

/// A command's result, held until the commit that makes it true has returned.
enum Answer {
    Grant(Reply<Grant>, Grant),
    Consumed(Reply<Consumed>, Consumed),
    Keys(Reply<Vec<SliceKey>>, Vec<SliceKey>),
    Count(Reply<usize>, usize),
    Progress(Reply<Progress>, Progress),
    Nothing,
}

impl Answer {
    fn send(self, committed: bool) {
        fn give<T>(reply: Reply<T>, value: T, committed: bool) {
            // A caller that gave up waiting no longer needs its answer.
            let _ = reply.send(if committed {
                Ok(value)
            } else {
                Err(Error::Stopped)
            });
        }
        match self {
            Self::Grant(reply, value) => give(reply, value, committed),
            Self::Consumed(reply, value) => give(reply, value, committed),
            Self::Keys(reply, value) => give(reply, value, committed),
            Self::Count(reply, value) => give(reply, value, committed),
            Self::Progress(reply, value) => give(reply, value, committed),
            Self::Nothing => {}
        }
    }
}

impl LedgerHandle {
    /// Runs `ledger` on the current tokio runtime.
    pub fn spawn(ledger: Ledger) -> (Self, tokio::task::JoinHandle<()>) {
        let (commands, receiver) = mpsc::channel(QUEUE);
        let handle = Self {
            commands,
            token: ledger.token(),
            spec: Arc::new(ledger.spec().clone()),
        };
        let task = tokio::spawn(run(ledger, receiver));
        (handle, task)
    }

    /// The iteration's checkpoint token.
    pub fn token(&self) -> &CheckpointToken {
        &self.token
    }

    pub fn spec(&self) -> &IterationSpec {
        &self.spec
    }

    /// See [`Ledger::assign`].
    pub async fn assign(
        &self,
        worker: &str,
        want: usize,
        cached: HashSet<u64>,
    ) -> Result<Grant, Error> {
        self.ask(|reply| Command::Assign {
            worker: worker.to_string(),
            want,
            cached,
            reply,
        })
        .await
    }

    /// See [`Ledger::consume`].
    pub async fn consume(
        &self,
        worker: &str,
        keys: Vec<SliceKey>,
        round: u64,
    ) -> Result<Consumed, Error> {
        self.ask(|reply| Command::Consume {
            worker: worker.to_string(),
            keys,
            round,
            reply,
        })
        .await
    }

    /// See [`Ledger::commit_round`].
    pub async fn commit_round(&self, worker: &str, round: u64) -> Result<Vec<SliceKey>, Error> {
        self.ask(|reply| Command::CommitRound {
            worker: worker.to_string(),
            round,
            reply,
        })
        .await
    }

    /// See [`Ledger::drop_round`].
    pub async fn drop_round(&self, worker: &str, round: u64) -> Result<Vec<SliceKey>, Error> {
        self.ask(|reply| Command::DropRound {
            worker: worker.to_string(),
            round,
            reply,
        })
        .await
    }

    /// See [`Ledger::release_worker`].
    pub async fn release_worker(&self, worker: &str) -> Result<usize, Error> {
        self.ask(|reply| Command::ReleaseWorker {
            worker: worker.to_string(),
            reply,
        })
        .await
    }

    /// See [`Ledger::release_assigned`].
    pub async fn release_assigned(&self, worker: &str) -> Result<usize, Error> {
        self.ask(|reply| Command::ReleaseAssigned {
            worker: worker.to_string(),
            reply,
        })
        .await
    }

    /// See [`Ledger::release_unheld`].
    pub async fn release_unheld(
        &self,
        worker: &str,
        holding: HashSet<SliceKey>,
    ) -> Result<usize, Error> {
        self.ask(|reply| Command::ReleaseUnheld {
            worker: worker.to_string(),
            holding,
            reply,
        })
        .await
    }

    /// See [`Ledger::renew`]; does not wait for the actor.
    pub async fn renew(&self, worker: &str) -> Result<(), Error> {
        self.commands
            .send(Command::Renew {
                worker: worker.to_string(),
            })
            .await
            .map_err(|_| Error::Stopped)
    }

    /// See [`Ledger::progress`].
    pub async fn progress(&self) -> Result<Progress, Error> {
        self.ask(|reply| Command::Progress { reply }).await
    }

    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| Error::Stopped)?;
        answer.await.map_err(|_| Error::Stopped)?
    }
}

/// The handle's clock: Unix milliseconds, as the times callers pass the [`Ledger`]. Its own
/// (not `hypha_messages::unix_ms`): the ledger depends on nothing of Hypha's.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn execute(ledger: &mut Ledger, command: Command, now: u64) -> Answer {
    match command {
        Command::Assign {
            worker,
            want,
            cached,
            reply,
        } => Answer::Grant(reply, ledger.assign(&worker, want, &cached, now)),
        Command::Consume {
            worker,
            keys,
            round,
            reply,
        } => Answer::Consumed(reply, ledger.consume(&worker, &keys, round, now)),
        Command::CommitRound {
            worker,
            round,
            reply,
        } => Answer::Keys(reply, ledger.commit_round(&worker, round, now)),
        Command::DropRound {
            worker,
            round,
            reply,
        } => Answer::Keys(reply, ledger.drop_round(&worker, round, now)),
        Command::ReleaseWorker { worker, reply } => {
            Answer::Count(reply, ledger.release_worker(&worker, now))
        }
        Command::ReleaseUnheld {
            worker,
            holding,
            reply,
        } => Answer::Count(reply, ledger.release_unheld(&worker, &holding, now)),
        Command::ReleaseAssigned { worker, reply } => {
            Answer::Count(reply, ledger.release_assigned(&worker, now))
        }
        Command::Renew { worker } => {
            ledger.renew(&worker, now);
            Answer::Nothing
        }
        Command::Progress { reply } => Answer::Progress(reply, ledger.progress(now)),
    }
}

/// A commit on its way to disk, and the answers it will release.
type Committing = (JoinHandle<Result<(), Error>>, Vec<Answer>);

async fn run(mut ledger: Ledger, mut commands: mpsc::Receiver<Command>) {
    let store = ledger.store();
    let mut expiry = tokio::time::interval(EXPIRY_TICK);
    expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Answers whose transitions are applied in memory and wait for the next commit.
    let mut waiting: Vec<Answer> = Vec::new();
    let mut committing: Option<Committing> = None;
    let mut open = true;
    loop {
        tokio::select! {
            command = commands.recv(), if open => match command {
                Some(command) => {
                    let now = now_ms();
                    waiting.push(execute(&mut ledger, command, now));
                    while waiting.len() < MAX_BATCH {
                        let Ok(command) = commands.try_recv() else { break };
                        waiting.push(execute(&mut ledger, command, now));
                    }
                }
                None => open = false,
            },
            _ = expiry.tick(), if open => {
                let returned = ledger.expire(now_ms());
                if returned > 0 {
                    tracing::info!(returned, "slices of lapsed leases are available again");
                }
            }
            outcome = async { (&mut committing.as_mut()?.0).await.ok() }, if committing.is_some() => {
                let committed = matches!(outcome, Some(Ok(())));
                if let Some((_, answers)) = committing.take() {
                    for answer in answers {
                        answer.send(committed);
                    }
                }
                if !committed {
                    let error = match outcome {
                        Some(Err(error)) => error.to_string(),
                        _ => "the commit thread failed".to_string(),
                    };
                    tracing::error!(%error, "the ledger could not commit and stops; reopen it to continue from its last commit");
                    for answer in waiting.drain(..) {
                        answer.send(false);
                    }
                    return;
                }
            }
        }
        // One commit at a time, in order; whatever arrives meanwhile is applied in memory and
        // goes into the next one.
        if committing.is_none() {
            let writes = ledger.take_writes();
            if writes.is_empty() {
                // Nothing to make durable (progress, renewals, empty grants): answer now.
                for answer in waiting.drain(..) {
                    answer.send(true);
                }
            } else {
                let store = store.clone();
                let commit = tokio::task::spawn_blocking(move || store.commit(&writes));
                committing = Some((commit, std::mem::take(&mut waiting)));
            }
        }
        if !open && committing.is_none() && waiting.is_empty() {
            return;
        }
    }
}
