//! A blocking client of the job bridge: JSON over HTTP/1.1 on the job's Unix socket, with the
//! standard library alone (an executor needs no async runtime to talk to its worker).
//!
//! One connection per request (`Connection: close`): requests are few and some wait long
//! (the next slice, the next global model), so there is nothing to gain from keeping one open.

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
};

use serde::{Serialize, de::DeserializeOwned};

use crate::{ConsumedAnswer, ConsumedRequest, ErrorBody, FetchRequest, FileEntry, SendRequest};

/// Why a bridge request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the job bridge at {socket}: {error}")]
    Connect {
        socket: PathBuf,
        error: std::io::Error,
    },
    /// The bridge's answer is not HTTP: where our parser stopped, described.
    #[error("the job bridge's answer to {path} is not HTTP: {detail}")]
    Malformed { path: String, detail: String },
    #[error("the job bridge answered {path} with {status}: {error}")]
    Refused {
        path: String,
        status: u16,
        error: ErrorBody,
    },
    #[error("the job bridge's answer to {path} is not the expected JSON: {error}")]
    Json {
        path: String,
        error: serde_json::Error,
    },
}

impl ClientError {
    /// The error code the bridge answered with, if it answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Refused { error, .. } => Some(&error.code),
            _ => None,
        }
    }

    /// The HTTP status the bridge answered with, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// The job bridge of one job.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

impl Client {
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
        }
    }

    /// `POST /resources/fetch`: the files the reference brought into the job's directory.
    pub fn fetch(&self, request: &FetchRequest) -> Result<Vec<FileEntry>, ClientError> {
        self.post("/resources/fetch", request)
    }

    /// `POST /resources/send`: the file as sent, `metadata.peers` naming who took it.
    pub fn send(&self, request: &SendRequest) -> Result<FileEntry, ClientError> {
        self.post("/resources/send", request)
    }

    /// `POST /data/consumed`: the slices refused (held too long; another job has them).
    pub fn consumed(&self, request: &ConsumedRequest) -> Result<ConsumedAnswer, ClientError> {
        self.post("/data/consumed", request)
    }

    /// `POST /status/send`: the scheduler's answer, read as `A`.
    pub fn status<A: DeserializeOwned>(&self, status: &impl Serialize) -> Result<A, ClientError> {
        self.post("/status/send", status)
    }

    /// `POST path` with `body` as JSON; the answer read as `R`.
    fn post<R: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<R, ClientError> {
        let connect = |error| ClientError::Connect {
            socket: self.socket.clone(),
            error,
        };
        let body = serde_json::to_vec(body).map_err(|error| ClientError::Json {
            path: path.to_string(),
            error,
        })?;
        let mut stream = UnixStream::connect(&self.socket).map_err(connect)?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: bridge\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).map_err(connect)?;
        stream.write_all(&body).map_err(connect)?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).map_err(connect)?;
        let (status, body) =
            parse_response(&response).map_err(|detail| ClientError::Malformed {
                path: path.to_string(),
                detail,
            })?;
        if status != 200 {
            // An answer that is not the bridge's error JSON (a proxy, a crash) still says
            // what it was.
            let error = serde_json::from_slice(&body).unwrap_or_else(|_| {
                ErrorBody::new("unknown", String::from_utf8_lossy(&body).into_owned())
            });
            return Err(ClientError::Refused {
                path: path.to_string(),
                status,
                error,
            });
        }
        serde_json::from_slice(&body).map_err(|error| ClientError::Json {
            path: path.to_string(),
            error,
        })
    }
}

/// The status code and the body (de-chunked) of a whole HTTP/1.1 response.
fn parse_response(response: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&response[..end]).map_err(|_| "headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or("no status code")?;
    let chunked = lines.any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    let body = &response[end + 4..];
    if !chunked {
        return Ok((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without its size line")?;
        let size = std::str::from_utf8(&rest[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .ok_or("a chunk size that is not hexadecimal")?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok((status, out));
        }
        let chunk = rest.get(..size).ok_or("a chunk shorter than its size")?;
        out.extend_from_slice(chunk);
        rest = rest.get(size + 2..).ok_or("a chunk without its line end")?;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn plain_and_chunked_bodies_are_read_whole() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]";
        assert_eq!(parse_response(plain).unwrap(), (200, b"[]".to_vec()));
        let chunked =
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n2\r\n\"}\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (404, b"{\"a\"}".to_vec()));
        assert!(parse_response(b"garbage").is_err());
    }
}
