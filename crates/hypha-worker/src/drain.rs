//! `hypha-worker drain`: a running worker stops taking work, lets its jobs leave, and exits.
//!
//! A worker holds an exclusive lock on `{work_dir}/worker.lock` while it runs, with its
//! process ID inside ([`WorkerLock`]). The lock keeps a second worker out of the same
//! `work_dir` (they would share job directories, the slice cache and the artifact store), and
//! it lets `drain` find the worker and know when it is gone: the kernel drops the lock when
//! the process ends, however it ends, so a stale file never names a live process.
//!
//! Draining is what SIGTERM does to a worker (what a service manager sends): it answers no
//! more advertisements and tells each job's executor to stop. A trainer then sends its
//! update if it is ready within the round, or hands its slices back, and the run goes on
//! without it (docs/jobs.md, "Leaving"). `drain` sends that signal and waits for the worker
//! to exit.

use std::{
    fs::{File, OpenOptions, TryLockError},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use hypha_node::{Error, RunArgs};
use nix::{sys::signal::Signal, unistd::Pid};

use crate::config::{WorkerConfig, schema};

/// The lock file's name in the worker's `work_dir`.
pub const LOCK_FILE: &str = "worker.lock";
/// How often `drain` looks whether the worker is gone.
const POLL: Duration = Duration::from_millis(100);

/// Tell the worker running with this config to drain: it takes no new jobs, its jobs hand
/// back their work (a trainer's update goes into the round if it is ready), then it exits.
#[derive(Debug, clap::Args)]
pub struct DrainArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Give up waiting after this many seconds (the worker goes on draining).
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub timeout: u64,
}

/// The lock a running worker holds on its `work_dir`; released when dropped or when the
/// process ends.
#[derive(Debug)]
pub struct WorkerLock {
    _file: File,
}

/// Why a worker could not take its `work_dir`.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another worker (pid {pid}) runs with this work_dir")]
    Taken { pid: String },
    #[error("cannot lock {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

impl WorkerLock {
    /// Takes `work_dir` for this process, or says which worker has it.
    pub fn acquire(work_dir: &Path) -> Result<Self, LockError> {
        let path = work_dir.join(LOCK_FILE);
        let io = |error| LockError::Io {
            path: path.clone(),
            error,
        };
        let mut file = open(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(LockError::Taken {
                    pid: read_pid(&mut file).map_or_else(|| "unknown".into(), |p| p.to_string()),
                });
            }
            Err(TryLockError::Error(error)) => return Err(io(error)),
        }
        file.set_len(0)
            .and_then(|()| file.write_all(std::process::id().to_string().as_bytes()))
            .map_err(io)?;
        Ok(Self { _file: file })
    }
}

fn open(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

fn read_pid(file: &mut File) -> Option<i32> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok().filter(|pid| *pid > 0)
}

/// `hypha-worker drain`: SIGTERM to the worker holding the config's `work_dir`, then waits
/// until it has exited.
pub async fn run(args: &DrainArgs) -> Result<(), Error> {
    let loaded = hypha_node::load_run_config(&schema(), &args.run)?;
    let config = WorkerConfig::from_loaded(&loaded)?;
    let path = config.work_dir.join(LOCK_FILE);
    let not_running = || {
        println!(
            "no worker is running with work_dir {}",
            config.work_dir.display()
        );
        Ok(())
    };
    let mut file = match File::options().read(true).write(true).open(&path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return not_running(),
        Err(error) => {
            return Err(Error::Failed(format!(
                "cannot open {}: {error}",
                path.display()
            )));
        }
    };
    if !running(&file, &path)? {
        return not_running();
    }
    // The worker writes its pid just after it takes the lock: give it that moment.
    let started = Instant::now();
    let pid = loop {
        if let Some(pid) = read_pid(&mut file) {
            break pid;
        }
        if started.elapsed() > Duration::from_secs(2) {
            return Err(Error::Failed(format!(
                "{} is locked but names no process; is a worker just starting?",
                path.display()
            )));
        }
        tokio::time::sleep(POLL).await;
    };
    nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM)
        .map_err(|error| Error::Failed(format!("cannot signal the worker (pid {pid}): {error}")))?;
    println!("worker {pid} is draining: it takes no new jobs, and its jobs hand back their work");
    let timeout = Duration::from_secs(args.timeout);
    let sent = Instant::now();
    // The lock is given back as the worker's run ends, a moment before its process does.
    while running(&file, &path)? || !exited(pid) {
        if sent.elapsed() >= timeout {
            return Err(Error::Failed(format!(
                "worker {pid} is still running after {} s; it goes on draining (its executors get kill_grace_ms after SIGTERM); run drain again to wait longer",
                args.timeout
            )));
        }
        tokio::time::sleep(POLL).await;
    }
    println!(
        "worker {pid} drained and exited in {:.1} s",
        sent.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet.
fn exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command's name, which is in parentheses and may hold any.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
    }
}

/// Whether a worker holds the lock; a lock taken here to look is given back at once.
fn running(file: &File, path: &Path) -> Result<bool, Error> {
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            Ok(false)
        }
        Err(TryLockError::WouldBlock) => Ok(true),
        Err(TryLockError::Error(error)) => Err(Error::Failed(format!(
            "cannot lock {}: {error}",
            path.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_worker_is_kept_out_of_a_work_dir_until_the_first_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let first = WorkerLock::acquire(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text, std::process::id().to_string());
        match WorkerLock::acquire(dir.path()) {
            Err(LockError::Taken { pid }) => assert_eq!(pid, std::process::id().to_string()),
            other => panic!("a second worker took the work_dir: {other:?}"),
        }
        drop(first);
        WorkerLock::acquire(dir.path()).unwrap();
    }
}
