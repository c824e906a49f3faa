"""A client of the Hypha job bridge: JSON over HTTP/1.1 on the job's Unix socket.

Standard library only. One connection per request: requests are few and some wait long (the
next slice, the next global model). Every method maps to one endpoint of the bridge's
``openapi.json`` (``Bridge.openapi()`` returns it); errors the bridge answers with are raised
as :class:`BridgeError`, with the bridge's ``code`` and ``message``.
"""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

__all__ = [
    "Bridge",
    "BridgeError",
    "FileEntry",
    "ReceivedFile",
    "uri",
    "huggingface",
    "peers",
    "artifact",
]

JSON = Dict[str, Any]


class BridgeError(Exception):
    """The bridge refused a request, or a receive stream carried an error event.

    ``status`` is the HTTP status (0 for an error event inside a stream that had started),
    ``code`` the bridge's machine-readable code (``bad_request``, ``path_refused``,
    ``data_wait``, ``send_failed``, ``scheduler_unreachable``, …), ``message`` what to do.
    """

    def __init__(self, endpoint: str, status: int, code: str, message: str) -> None:
        super().__init__(f"{endpoint}: {message} ({code}, HTTP {status})")
        self.endpoint = endpoint
        self.status = status
        self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        """A peer could not be reached or was busy: asking again later may work."""
        return self.status in (502, 503, 504) and self.code not in ("data_wait", "scheduler_answer")


@dataclass(frozen=True)
class FileEntry:
    """A file the bridge wrote or read for the job; ``path`` is relative to the job's
    directory, ``checksum`` is ``sha256:<hex>``."""

    path: str
    size: int
    checksum: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, entry: JSON) -> "FileEntry":
        return cls(
            path=entry["path"],
            size=entry["size"],
            checksum=entry["checksum"],
            metadata=entry.get("metadata") or {},
        )


@dataclass(frozen=True)
class ReceivedFile(FileEntry):
    """A file another job of the task sent: ``{out_dir}/{sequence}-{name}``."""

    from_peer: str = ""
    sequence: int = 0

    @classmethod
    def from_json(cls, entry: JSON) -> "ReceivedFile":
        file = FileEntry.from_json(entry)
        return cls(**vars(file), from_peer=entry["from_peer"], sequence=entry["sequence"])


def uri(url: str) -> JSON:
    """One HTTP(S) download."""
    return {"type": "Uri", "value": url}


def huggingface(
    repository: str,
    filenames: Sequence[str],
    revision: Optional[str] = None,
    token: Optional[str] = None,
) -> JSON:
    """Files of a Hugging Face repository (the job's secret ``hf_token`` is used when no
    ``token`` is given)."""
    reference: JSON = {"type": "HuggingFace", "repository": repository, "filenames": list(filenames)}
    if revision is not None:
        reference["revision"] = revision
    if token is not None:
        reference["token"] = token
    return reference


def peers(ids: Iterable[str] = (), strategy: str = "All") -> JSON:
    """Jobs of this job's task on other workers, by peer id; ``strategy`` is ``All``,
    ``One`` or ``Random``."""
    return {"type": "Peers", "peers": list(ids), "strategy": strategy}


def artifact(
    uri: str,
    profile: str = "default",
    kind: str = "object",
    unpack: Optional[str] = None,
) -> JSON:
    """An object (``kind="prefix"``: a tree) of one of the worker's artifact origins."""
    reference: JSON = {"type": "Artifact", "profile": profile, "uri": uri, "kind": kind}
    if unpack is not None:
        reference["unpack"] = unpack
    return reference


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("bridge", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not None:
            sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Bridge:
    """The job bridge of one job, at ``socket_path`` (``{SOCKET_PATH}``).

    ``timeout`` bounds every socket operation in seconds (``None``: wait as long as the
    bridge does, which for a slice or a peer's file may be long; give ``wait_ms`` to those
    requests instead).
    """

    def __init__(self, socket_path: str, timeout: Optional[float] = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    # --- endpoints ---------------------------------------------------------------------

    def fetch(
        self, reference: JSON, out_dir: str = "artifacts", wait_ms: Optional[int] = None
    ) -> List[FileEntry]:
        """``POST /resources/fetch``: brings ``reference`` into ``out_dir`` (relative to the
        job's directory) and returns the files written. For a ``Scheduler`` reference (the
        job's ``data``) that is the next slice, ``[]`` when the iteration is done; for
        ``Peers``, files other jobs sent (with ``wait_ms``: those that came by then)."""
        body: JSON = {"fetch": reference, "out_dir": out_dir}
        if wait_ms is not None:
            body["wait_ms"] = int(wait_ms)
        return [FileEntry.from_json(e) for e in self._post("/resources/fetch", body)]

    def next_slice(
        self, data: JSON, out_dir: str = "slices", wait_ms: Optional[int] = None
    ) -> Optional[FileEntry]:
        """The next slice of the job's dataset (``data`` is the job config's ``data``), with
        ``epoch``, ``slice`` and ``samples`` in its metadata.

        ``None``: the iteration is over for this job, every slice of every epoch used or
        held by jobs still running. While slices are held by others and may come back, the
        request waits; with ``wait_ms``, at most that long, then a :class:`BridgeError` with
        code ``data_wait`` says to ask again later."""
        entries = self.fetch(data, out_dir=out_dir, wait_ms=wait_ms)
        return entries[0] if entries else None

    def send(
        self,
        path: str,
        to: Iterable[str],
        strategy: str = "All",
        patience_ms: Optional[int] = None,
    ) -> FileEntry:
        """``POST /resources/send``: sends the job's file ``path`` to the jobs of its task on
        the workers ``to``; ``metadata["peers"]`` of the answer names who took it."""
        body: JSON = {"send": peers(to, strategy), "path": path}
        if patience_ms is not None:
            body["patience_ms"] = int(patience_ms)
        return FileEntry.from_json(self._post("/resources/send", body))

    def receive(
        self,
        from_peers: Iterable[str] = (),
        strategy: str = "All",
        out_dir: str = "incoming",
    ) -> Iterator[ReceivedFile]:
        """``POST /resources/receive``: the files peers send, as they arrive (from anyone
        when ``from_peers`` is empty). ``All`` goes on until the job ends or the iterator is
        closed; ``One`` and ``Random`` end after the first file. An error event is raised
        as :class:`BridgeError`."""
        body = {"receive": peers(from_peers, strategy), "out_dir": out_dir}
        connection = self._connection()
        try:
            response = self._request(
                connection, "/resources/receive", body, accept="text/event-stream"
            )
            if response.status != 200:
                raise self._refused("/resources/receive", response.status, response.read())
            for event, data in _events(response):
                payload = json.loads(data)
                if event == "error" or "error" in payload:
                    error = payload.get("error") or payload
                    raise BridgeError(
                        "/resources/receive",
                        0,
                        error.get("code", "unknown"),
                        error.get("message", data),
                    )
                yield ReceivedFile.from_json(payload)
        finally:
            connection.close()

    def consumed(
        self,
        slices: Iterable[Mapping[str, int]],
        round: int,
        data: JSON,
        completed_round: Optional[int] = None,
    ) -> List[JSON]:
        """``POST /data/consumed``: the slices (``{"epoch": …, "slice": …}``) read to their
        end went into ``round``. A job without a parameter server also says which round
        reached the model with ``completed_round`` (its slices are then used for good).
        Returns the slices refused: the job held them too long and another job has them
        now."""
        body: JSON = {"slices": [dict(s) for s in slices], "round": int(round), "data": data}
        if completed_round is not None:
            body["completed_round"] = int(completed_round)
        return list(self._post("/data/consumed", body)["refused"])

    def status(self, payload: Any) -> JSON:
        """``POST /status/send``: ``payload`` (any JSON) to the job's scheduler; returns its
        answer: a DiLoCo order (``{"action": "train", …}``) for a trainer's status,
        ``{"received": true}`` for any other. Every answer also has a ``type`` (``Ok``,
        ``Continue``, ``ScheduleUpdate``, ``Done``) for clients of the upstream dialect."""
        return self._post("/status/send", payload)

    def openapi(self) -> JSON:
        """The bridge's OpenAPI document."""
        connection = self._connection()
        try:
            connection.request("GET", "/openapi.json", headers={"Host": "bridge"})
            response = connection.getresponse()
            body = response.read()
            if response.status != 200:
                raise self._refused("/openapi.json", response.status, body)
            return json.loads(body)
        finally:
            connection.close()

    # --- plumbing ----------------------------------------------------------------------

    def _connection(self) -> _UnixConnection:
        return _UnixConnection(self.socket_path, self.timeout)

    def _request(
        self, connection: _UnixConnection, path: str, body: Any, accept: str = "application/json"
    ) -> http.client.HTTPResponse:
        try:
            encoded = json.dumps(body, allow_nan=False).encode()
        except ValueError as error:
            raise ValueError(f"{path}: {error} (JSON has no NaN or infinity: send None)") from None
        connection.request(
            "POST",
            path,
            body=encoded,
            headers={"Content-Type": "application/json", "Accept": accept},
        )
        return connection.getresponse()

    def _post(self, path: str, body: Any) -> Any:
        connection = self._connection()
        try:
            response = self._request(connection, path, body)
            raw = response.read()
            if response.status != 200:
                raise self._refused(path, response.status, raw)
            return json.loads(raw)
        finally:
            connection.close()

    @staticmethod
    def _refused(path: str, status: int, raw: bytes) -> BridgeError:
        text = raw.decode("utf-8", "replace")
        # A refused receive answers with an event stream; everything else with JSON.
        for line in text.splitlines():
            if line.startswith("data:"):
                text = line[5:].strip()
                break
        try:
            error = json.loads(text)
            error = error.get("error", error)
            return BridgeError(path, status, error["code"], error["message"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return BridgeError(path, status, "unknown", text)


def _events(response: http.client.HTTPResponse) -> Iterator[tuple]:
    """``(event, data)`` of each Server-Sent Event; comments (keep-alives) are skipped."""
    event, data = "message", []
    while True:
        line = response.readline()
        if not line:
            return
        line = line.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
