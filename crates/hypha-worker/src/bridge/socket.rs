//! Where each job's bridge socket is bound.
//!
//! A Unix socket's path may hold at most [`MAX_SOCKET_PATH`] bytes (`sun_path` is 108 bytes
//! with its terminating NUL), and `work_dir/hypha-{uuid}/bridge.sock` spends 55 of them on
//! its own: any `work_dir` longer than 52 bytes (a deep home directory is enough) cannot hold
//! job sockets. Such a worker binds its sockets in a short private directory it makes at start
//! (mode 0700, under `$TMPDIR`, else `/tmp`; removed when the worker stops) as
//! `{uuid}.sock` (mode 0600), and points `{SOCKET_PATH}` there; the job directory keeps a
//! `bridge.sock` symlink to it, so the socket is found where docs/jobs.md says (connecting
//! through a relative `bridge.sock` from the job's directory works). A worker whose sockets
//! can go nowhere says so when it starts, with the fix.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

/// The longest path a Unix socket may be bound at on Linux.
pub const MAX_SOCKET_PATH: usize = 107;

/// The socket's name inside a job's directory.
pub const SOCKET_NAME: &str = "bridge.sock";

/// A job directory's name: `hypha-` and a hyphenated UUID.
const JOB_DIR_NAME_LEN: usize = "hypha-".len() + 36;

/// Where the sockets of this worker's jobs go.
#[derive(Debug)]
pub enum SocketPlace {
    /// `work_dir/hypha-{uuid}/bridge.sock`.
    InJobDir,
    /// `{dir}/{uuid}.sock`, with a symlink from the job's directory.
    Short(tempfile::TempDir),
}

/// Why no job socket can be created.
#[derive(Debug, thiserror::Error)]
#[error(
    "job bridge sockets cannot be created: {reason}; point TMPDIR at a short writable directory (e.g. TMPDIR=/tmp), or use a shorter work_dir"
)]
pub struct SocketError {
    reason: String,
}

impl SocketPlace {
    /// Decides where the sockets of jobs under `work_dir` go, and proves it by binding one.
    pub fn for_work_dir(work_dir: &Path) -> Result<Self, SocketError> {
        let in_job_dir = work_dir.as_os_str().len() + 1 + JOB_DIR_NAME_LEN + 1 + SOCKET_NAME.len();
        let place = if in_job_dir <= MAX_SOCKET_PATH {
            Self::InJobDir
        } else {
            Self::Short(short_dir(work_dir)?)
        };
        place.probe(work_dir)?;
        Ok(place)
    }

    /// The socket path of job `id` whose directory is `job_dir`.
    pub fn socket(&self, job_dir: &Path, id: &str) -> PathBuf {
        match self {
            Self::InJobDir => job_dir.join(SOCKET_NAME),
            Self::Short(dir) => dir.path().join(format!("{id}.sock")),
        }
    }

    /// A `bridge.sock` link in the job's directory to its socket when the socket lives
    /// elsewhere (made before the socket is bound: a dangling link until then).
    pub fn link(&self, job_dir: &Path, socket: &Path) -> std::io::Result<()> {
        match self {
            Self::InJobDir => Ok(()),
            Self::Short(_) => std::os::unix::fs::symlink(socket, job_dir.join(SOCKET_NAME)),
        }
    }

    /// Removes a job's socket (and its link) when the job ends.
    pub fn remove(&self, job_dir: &Path, socket: &Path) {
        // NotFound is fine: the job may have ended before its socket was made.
        let _ = std::fs::remove_file(socket);
        if let Self::Short(_) = self {
            let _ = std::fs::remove_file(job_dir.join(SOCKET_NAME));
        }
    }

    /// Binds and removes one socket where job sockets will go, so that a worker that could
    /// not serve a bridge fails at start rather than at every dispatch.
    fn probe(&self, work_dir: &Path) -> Result<(), SocketError> {
        let dir = match self {
            Self::InJobDir => work_dir,
            Self::Short(dir) => dir.path(),
        };
        std::fs::create_dir_all(dir).map_err(|e| SocketError {
            reason: format!("cannot create {}: {e}", dir.display()),
        })?;
        let probe = dir.join(format!(".probe-{}.sock", std::process::id()));
        let bound = std::os::unix::net::UnixListener::bind(&probe);
        let _ = std::fs::remove_file(&probe);
        bound.map(drop).map_err(|e| SocketError {
            reason: format!("cannot bind a socket in {}: {e}", dir.display()),
        })
    }
}

/// A new private directory for sockets, short enough for `{uuid}.sock` inside it.
fn short_dir(work_dir: &Path) -> Result<tempfile::TempDir, SocketError> {
    let socket_len = 1 + 36 + ".sock".len();
    let mut tried = Vec::new();
    for base in [std::env::temp_dir(), PathBuf::from("/tmp")] {
        // "hypha-" and tempfile's six random characters.
        if base.as_os_str().len() + 1 + 12 + socket_len > MAX_SOCKET_PATH {
            tried.push(format!("{} is too long", base.display()));
            continue;
        }
        match tempfile::Builder::new()
            .prefix("hypha-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(&base)
        {
            Ok(dir) => {
                tracing::info!(
                    work_dir = %work_dir.display(),
                    sockets = %dir.path().display(),
                    "work_dir is too long for Unix socket paths; job bridge sockets go to a private directory, linked from each job's bridge.sock"
                );
                return Ok(dir);
            }
            Err(e) => tried.push(format!("{}: {e}", base.display())),
        }
    }
    Err(SocketError {
        reason: format!(
            "{}/hypha-{{uuid}}/{SOCKET_NAME} would be longer than the {MAX_SOCKET_PATH} bytes a socket path may have, and no short directory could be made ({})",
            work_dir.display(),
            tried.join("; ")
        ),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn short_work_dirs_keep_sockets_in_job_directories_and_long_ones_get_a_private_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let id = "0b6f9f46-8a4f-4d5e-9a55-0f1d2c3b4a59";
        let short = tmp.path().join("w");
        let place = SocketPlace::for_work_dir(&short).unwrap();
        let job = short.join(format!("hypha-{id}"));
        assert_eq!(place.socket(&job, id), job.join(SOCKET_NAME));

        let long = tmp.path().join("d".repeat(120));
        let place = SocketPlace::for_work_dir(&long).unwrap();
        let job = long.join(format!("hypha-{id}"));
        let socket = place.socket(&job, id);
        assert!(socket.as_os_str().len() <= MAX_SOCKET_PATH, "{socket:?}");
        let SocketPlace::Short(dir) = &place else {
            panic!("expected a private directory");
        };
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        // The job's bridge.sock leads to the socket, and goes with it.
        std::fs::create_dir_all(&job).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        place.link(&job, &socket).unwrap();
        assert_eq!(std::fs::read_link(job.join(SOCKET_NAME)).unwrap(), socket);
        place.remove(&job, &socket);
        assert!(job.join(SOCKET_NAME).symlink_metadata().is_err());
        assert!(!socket.exists());
    }

    #[test]
    fn a_worker_that_cannot_make_sockets_says_so_with_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let err = SocketPlace::for_work_dir(&file.join("work"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("job bridge sockets cannot be created")
                && err.contains("a-file")
                && err.contains("TMPDIR"),
            "{err}"
        );
    }
}
