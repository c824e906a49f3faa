"""The DiLoCo trainer protocol, as a loop you give a model.

A Hypha DiLoCo job has trainers and a parameter server; its scheduler drives the rounds. A
trainer (this loop) does what the scheduler's orders say, through the job bridge:

1. Ask (``/status/send`` with a trainer status). ``join``: offer the model it holds to the
   parameter server, then take the global model the server answers with.
2. ``train``: run inner steps (your ``train_step``) on batches of the job's slices
   (``/resources/fetch`` with the job's ``data``) until the round's batch target; report batch
   times and loss every ``report_every`` seconds and take the new target.
3. At the target, finish the slice being read (each slice's samples go into one round), tell
   the ledger which slices the round consumed (``/data/consumed``), send the pseudo-gradient
   θ_global − θ_local with its round and sample count to the parameter server, and wait for
   the next global model.
4. ``done``: return.

Told to stop (SIGTERM: its worker leaving, or the job cancelled), the loop finishes its part
of the round it holds and sends it (the round keeps it, and its slices count), or after
``FINISH_WITHIN`` seconds sends what it trained so far (the slice being read read to its end
first), and returns. The worker kills the process after its ``kill_grace_ms`` (default 5 s).

Your model provides three methods (see :class:`Model`): ``parameters()`` and ``load()`` as
numpy float32 arrays by name (names and shapes as the job's other trainers use them: a job
can mix Python and Rust trainers), and ``train_step(batch)``, one optimiser step on a batch
(a dict of numpy arrays, one per tensor of the slice, rows ``[i, i + batch_size)``) that
returns the loss. Keep your optimiser's state across rounds, as DiLoCo does.

Needs numpy.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
import math
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

from . import codec, safetensors
from .client import Bridge, BridgeError, peers
from .job import Job

__all__ = ["Model", "Trainer", "Settings", "read_settings", "KIND", "ROUND", "SAMPLES"]

# SafeTensors metadata keys of a DiLoCo job's files.
KIND = "hypha.kind"
ROUND = "hypha.round"
SAMPLES = "hypha.samples"
KIND_MODEL = "model"
KIND_MODEL_REQUEST = "model_request"
KIND_PSEUDO_GRADIENT = "pseudo_gradient"
MODEL_HASH = "hypha.model_hash"
KIND_MODEL_DELTA = "model_delta"
BASE_ROUND = "hypha.base_round"
BASE_HASH = "hypha.base_hash"
ACCEPTS = "hypha.accepts"
# Whole models of this size or more are offered again less and less often while joining.
BACK_OFF_FROM_BYTES = 64 * 1024 * 1024

# How long a trainer told to stop goes on with its part of the round before it sends what it
# has: within the worker's default kill_grace_ms of 5 s, with time to send.
FINISH_WITHIN = 3.0


class Model(Protocol):
    """What the loop needs of a model.

    Its parameters must have exactly the names and shapes of the job's global model (the
    other trainers' and the model the job file describes); the loop checks and stops with a
    :class:`ProtocolError` naming the differences.
    """

    def parameters(self) -> Mapping[str, Any]:
        """The model's parameters now, as numpy float32 arrays by name (copies or not: the
        loop copies what it keeps)."""

    def load(self, parameters: Mapping[str, Any]) -> None:
        """Replaces the parameters with ``parameters``, a new global model with every name
        :meth:`parameters` has. Keep the optimiser's state: DiLoCo carries it across rounds."""

    def train_step(self, batch: Mapping[str, Any]) -> float:
        """One optimiser step on ``batch`` (the slice's tensors by name, numpy arrays with
        up to ``batch_size`` rows: a slice's last batch may be smaller); returns its loss."""


class ProtocolError(RuntimeError):
    """A peer answered something the protocol does not allow."""


@dataclass
class _RoundStats:
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    batch_ms: Optional[float] = None
    consumed: List[Dict[str, int]] = field(default_factory=list)
    syncing: bool = False
    sent: bool = False

    def fresh(self) -> "_RoundStats":
        """The stats of a new round: the pace carries over."""
        return _RoundStats(batch_ms=self.batch_ms)


@dataclass
class _Slice:
    tensors: Dict[str, Any]
    rows: int
    id: Dict[str, int]
    next: int = 0


class _Reader:
    """The job's slices, batch by batch, never a batch across two slices."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.current: Optional[_Slice] = None
        self.finished: List[Dict[str, int]] = []
        self.done = False
        self.waiting = False

    def out_of_data(self) -> bool:
        return (self.done or self.waiting) and not self.in_slice()

    def in_slice(self) -> bool:
        return self.current is not None and self.current.next < self.current.rows

    def rewind(self) -> None:
        if self.in_slice():
            self.current.next = 0  # type: ignore[union-attr]

    def next_batch(self, size: int) -> Optional[Tuple[Dict[str, Any], int]]:
        """The next batch of at most ``size`` rows and its row count; ``None`` when the data
        is done (for now)."""
        while not self.in_slice():
            self.current = self._fetch()
            if self.current is None:
                return None
            if self.current.rows == 0:
                self.finished.append(self.current.id)
        current = self.current
        assert current is not None
        take = max(1, min(size, current.rows - current.next))
        # Tensors of one row per sample are cut into batches; any other tensor of the slice
        # (a vocabulary, a scalar) comes whole with every batch.
        batch = {
            name: array[current.next : current.next + take]
            if getattr(array, "ndim", 0) > 0 and len(array) == current.rows
            else array
            for name, array in current.tensors.items()
        }
        current.next += take
        if current.next == current.rows:
            self.finished.append(current.id)
        return batch, take

    def _fetch(self) -> Optional[_Slice]:
        if self.done:
            return None
        trainer = self.trainer
        try:
            entry = trainer.bridge.next_slice(
                trainer.data, out_dir="slices", wait_ms=int(trainer.data_wait * 1000)
            )
        except BridgeError as error:
            if error.code == "data_wait":
                self.waiting = True
                return None
            raise
        self.waiting = False
        if entry is None:
            self.done = True
            return None
        try:
            slice_id = {"epoch": int(entry.metadata["epoch"]), "slice": int(entry.metadata["slice"])}
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"the slice {entry.path} has no epoch and slice in its metadata")
        tensors, _ = safetensors.loads(trainer.take(entry.path))
        arrays = {name: tensor.to_numpy() for name, tensor in tensors.items()}
        try:
            rows = int(entry.metadata["samples"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"the slice {entry.path} has no samples in its metadata")
        return _Slice(arrays, rows, slice_id)


@dataclass
class Settings:
    """What the SDK reads of a trainer's ``config["diloco"]``, described in the bridge's
    ``openapi.json`` as ``TrainerConfig`` (``tests/test_config_schema.py`` checks this
    reading against it). The inner optimiser (``inner``) is the model's own business."""

    batch_size: int
    #: The job asks trainers to train on while their update travels (this SDK does not).
    overlap: bool
    #: Error feedback for ``sparse`` pseudo-gradients; ``None``: float32 is sent.
    feedback: Optional["codec.ErrorFeedback"]


def read_settings(diloco: Mapping[str, Any]) -> Settings:
    """The :class:`Settings` of a trainer's ``config["diloco"]``."""
    return Settings(
        batch_size=int(diloco.get("batch_size") or 32),
        overlap=bool(diloco.get("overlap")),
        feedback=codec.from_config(diloco),
    )


class Trainer:
    """Trains ``model`` in the DiLoCo job ``job`` until its scheduler says training is over.

    ``batch_size`` defaults to the job's ``[diloco] batch_size``. The timings mirror the
    reference executor's: report every ``report_every`` s, wait ``data_wait`` s for a free
    slice and ``model_wait`` s for a global model before asking the scheduler again, keep
    trying an unreachable parameter server ``send_patience`` s, offer the model again after
    ``offer_again`` s while joining (for a model of 64 MiB or more twice as long each time,
    up to a minute: it may still be on its way), ask again every ``retry`` s after a peer was away.
    """

    def __init__(
        self,
        job: Job,
        model: Model,
        batch_size: Optional[int] = None,
        report_every: float = 0.2,
        data_wait: float = 1.0,
        model_wait: float = 1.0,
        send_patience: float = 1.0,
        offer_again: float = 5.0,
        retry: float = 0.5,
        log=None,
    ) -> None:
        import numpy  # noqa: F401  (fail now, not in the middle of a round)

        if not safetensors.can_fingerprint():
            # Fail closed: a global model whose fingerprint cannot be checked is not trained on.
            raise RuntimeError(
                "the DiLoCo loop checks every global model against the parameter server's "
                "BLAKE3 fingerprint and needs the blake3 package: pip install blake3 (the "
                "hypha-sdk extras numpy and torch bring it)"
            )

        self.job = job
        self.bridge: Bridge = job.bridge
        self.model = model
        settings = read_settings(job.config.get("diloco") or {})
        self.batch_size = int(batch_size or settings.batch_size)
        if "data" not in job.config:
            raise ValueError("the job's config has no \"data\": is it a DiLoCo job with a dataset?")
        self.data = job.config["data"]
        self.report_every = report_every
        self.data_wait = data_wait
        self.model_wait = model_wait
        self.send_patience = send_patience
        self.offer_again = offer_again
        self.retry = retry
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.global_parameters = {k: _f32(v) for k, v in model.parameters().items()}
        self.round: Optional[int] = None
        self.last_model: Optional[int] = None
        # The fingerprint of the global model it holds, once checked against the server's:
        # reported, so that the run's record shows which model each trainer trained from.
        self.global_hash: Optional[str] = None
        self.stats = _RoundStats()
        self.reader = _Reader(self)
        self.rounds_trained = 0
        self.server: Optional[str] = None
        self.stopping: Optional[float] = None
        # With compression = "sparse", pseudo-gradients go sparse with error feedback, as
        # the Rust trainers send them; otherwise float32 (the server reads both).
        self.feedback = settings.feedback
        if settings.overlap:
            self.log("the job asks for overlap; this SDK trains without it, a round at a time")
        # Such a trainer takes the server's sparse changes of the model instead of whole models,
        # checking the model they lead to against the server's fingerprint.
        self.takes_changes = self.feedback is not None

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        """Trains until the scheduler says ``done``; returns the rounds whose
        pseudo-gradient this trainer sent."""
        order: Optional[Dict[str, Any]] = None
        reported = time.monotonic()
        unreachable = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._told_to_stop)
        stop_said = False
        while True:
            if self.stopping is not None:
                if not stop_said:
                    stop_said = True
                    held = f"in round {self.round}" if self.round is not None else "holding no round"
                    self.log(f"told to stop {held}: finishing its part of the round first")
                finished = self.round is None or self.stats.sent
                if finished or time.monotonic() - self.stopping >= FINISH_WITHIN:
                    self._leave()
                    return self.rounds_trained
            began = time.monotonic()
            try:
                order, reported = self._step(order, reported)
                if order is not None and order.get("action") == "done":
                    if self.stopping is not None:
                        self._leave()
                    return self.rounds_trained
                unreachable = False
            except BridgeError as error:
                if not error.transient:
                    raise
                if not unreachable:
                    self.log(f"{error}; asking again (at most every {self.retry} s)")
                unreachable = True
                order = None
                # A try that spent its own patience (a send to a server that is gone) asks
                # the scheduler at once: it may have named a new server meanwhile.
                time.sleep(max(0.0, self.retry - (time.monotonic() - began)))

    def _step(self, order: Optional[Dict[str, Any]], reported: float):
        target_reached = (
            order is not None
            and order.get("action") == "train"
            and self.stats.batches >= order["batches"]
        )
        if order is None or target_reached or time.monotonic() - reported >= self.report_every:
            order = self._report()
            reported = time.monotonic()
        action = order.get("action")
        if action == "done":
            return order, reported
        if action == "wait":
            time.sleep(min(max(order.get("retry_ms", 100), 10), 5000) / 1000)
            return None, reported
        if action == "join":
            return self._join(order["parameter_server"]), reported
        if action != "train":
            raise ProtocolError(f"the scheduler answered an unknown order: {order}")
        if self.round != order["round"]:
            return None, reported
        if self.server != order["parameter_server"] and self.feedback is not None:
            # What compression dropped was measured against the model of a server that is gone.
            self.feedback.reset()
        self.server = order["parameter_server"]
        wants_more = self.stats.batches < order["batches"] or self.reader.in_slice()
        if wants_more and not self.stats.syncing:
            if self._train_batch():
                return order, reported
            if self.stats.samples == 0:
                # Nothing trained and nothing free: wait for slices to come back or the end.
                time.sleep(self.report_every)
                return None, reported
        return self._sync(order["parameter_server"]), reported

    def _report(self) -> Dict[str, Any]:
        self._report_consumed()
        stats = self.stats
        status = {
            "diloco": "trainer",
            "round": self.round,
            "batches": stats.batches,
            "samples": stats.samples,
            "batch_ms": stats.batch_ms,
            "loss": _finite(stats.loss_sum / stats.batches) if stats.batches else None,
            "data_done": self.reader.out_of_data(),
            "model_hash": self.global_hash if self.round is not None else None,
            # Whether it has begun to send the round's update: one that has not goes on with
            # its round when a replacement server holds the model it trains from.
            "syncing": self.stats.syncing,
        }
        return self.bridge.status(status)

    def _train_batch(self) -> bool:
        started = time.monotonic()
        next_batch = self.reader.next_batch(self.batch_size)
        self.stats.consumed.extend(self.reader.finished)
        self.reader.finished.clear()
        if next_batch is None:
            return False
        batch, rows = next_batch
        loss = float(self.model.train_step(batch))
        elapsed = (time.monotonic() - started) * 1000
        stats = self.stats
        stats.batches += 1
        stats.samples += rows
        stats.loss_sum += loss
        stats.batch_ms = elapsed if stats.batch_ms is None else 0.7 * stats.batch_ms + 0.3 * elapsed
        return True

    def _join(self, server: str) -> Optional[Dict[str, Any]]:
        if self.round is not None:
            self.log(f"round {self.round}: abandoned; joining the parameter server {server}")
            self.round = None
            self.reader.rewind()
            self.stats = self.stats.fresh()
            self.last_model = None
            if self._report().get("action") == "done":
                return {"action": "done"}
        self._offer(server)
        return self._receive(server)

    def _offer(self, server: str) -> None:
        metadata = {KIND: KIND_MODEL, ROUND: "0"}
        self._send(server, "initial-model.safetensors", self.global_parameters, metadata)

    def _report_consumed(self) -> None:
        if not self.stats.consumed:
            return
        self.bridge.consumed(self.stats.consumed, self.round or 0, self.data)
        self.stats.consumed = []

    def _told_to_stop(self, signum, frame) -> None:
        # Only the flag: the loop says so (writing from a handler can interrupt a write).
        if self.stopping is None:
            self.stopping = time.monotonic()

    def _leave(self) -> None:
        """Told to stop: what it trained in the round and did not send yet goes to the
        server (the slice being read is read to its end first, since its samples go into
        one round)."""
        if self.round is not None and self.server is not None and not self.stats.sent:
            while not self.stats.syncing and self.reader.in_slice() and self._train_batch():
                pass
            self._report_consumed()
            self._send_update(self.server)
        self.log("told to stop: training ends")

    def _sync(self, server: str) -> Optional[Dict[str, Any]]:
        self.stats.syncing = True
        self._report_consumed()
        self._send_update(server)
        if self.stopping is not None:
            # Its part of the round is sent: it takes no next model.
            return {"action": "done"}
        return self._receive(server)

    def _send_update(self, server: str) -> None:
        """Sends the round's pseudo-gradient, unless it trained nothing or sent it already."""
        round_ = self.round or 0
        if self.stats.samples > 0 and not self.stats.sent:
            local = self.model.parameters()
            _check_same("the global model", self.global_parameters, "this trainer's model", local)
            delta = {name: global_ - _f32(local[name]) for name, global_ in self.global_parameters.items()}
            metadata = {KIND: KIND_PSEUDO_GRADIENT, ROUND: str(round_), SAMPLES: str(self.stats.samples)}
            tensors: Mapping[str, Any] = delta
            if self.feedback is not None:
                tensors, metadata = self.feedback.compress(delta, metadata)
            if self.takes_changes:
                metadata[ACCEPTS] = KIND_MODEL_DELTA
            self._send(server, f"pseudo-gradient-{round_}.safetensors", tensors, metadata)
            self.stats.sent = True
            self.rounds_trained += 1
            self.log(
                f"round {round_}: pseudo-gradient of {self.stats.samples} samples "
                f"({self.stats.batches} batches) sent"
                + (" sparse" if self.feedback is not None else "")
            )

    def _send(self, server: str, name: str, tensors: Mapping[str, Any], metadata: Dict[str, str]) -> None:
        outbox = self.job.path("outbox")
        os.makedirs(outbox, exist_ok=True)
        path = os.path.join(outbox, name)
        safetensors.save(path, tensors, metadata)
        self.bridge.send(f"outbox/{name}", [server], "All", patience_ms=int(self.send_patience * 1000))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _receive(self, server: str) -> Optional[Dict[str, Any]]:
        offered = time.monotonic()
        offer_every = self.offer_again
        while True:
            entries = self.bridge.fetch(
                peers([server]), out_dir="models", wait_ms=int(self.model_wait * 1000)
            )
            if entries:
                tensors, metadata = safetensors.loads(self.take(entries[0].path))
                kind = metadata.get(KIND, KIND_MODEL)
                if kind == KIND_MODEL_DELTA and self.takes_changes:
                    if self._apply_change(server, tensors, metadata):
                        return None
                    continue
                if kind != KIND_MODEL:
                    # Its pseudo-gradients say whether it takes the model's changes
                    # (hypha.accepts): a server sends it none otherwise.
                    self.log(f"a file of kind {kind!r} from {server}: ignored")
                    continue
                try:
                    round_ = int(metadata[ROUND])
                except (KeyError, ValueError):
                    raise ProtocolError(f"a model from {server} without its round: {metadata}")
                if self.last_model is not None and round_ <= self.last_model:
                    continue
                expected = metadata.get(MODEL_HASH)
                matches = None if expected is None else safetensors.fingerprint_matches(tensors, expected)
                if expected is not None and not matches:
                    # Damaged on the way, or not the server's model: never trained on. As the
                    # Rust trainer does, ask for the whole model again.
                    self.log(
                        f"round {round_}: the model from {server} does not match the fingerprint "
                        "it came with; asking for the whole model"
                    )
                    self._send(server, "model-request.safetensors", {}, {KIND: KIND_MODEL_REQUEST})
                    continue
                parameters = {name: _f32(t.to_numpy()) for name, t in tensors.items()}
                self._adopt(parameters, round_, expected if matches else None, "global model")
                return None
            order = self._report()
            action = order.get("action")
            if action == "done":
                return order
            if action == "join":
                if self.round is None and order.get("parameter_server") == server:
                    if time.monotonic() - offered >= offer_every:
                        self._offer(server)
                        offered = time.monotonic()
                        if sum(v.nbytes for v in self.global_parameters.values()) >= BACK_OFF_FROM_BYTES:
                            offer_every = min(2 * offer_every, max(self.offer_again, 60.0))
                else:
                    return order

    def _adopt(self, parameters: Dict[str, Any], round_: int, hash_: Optional[str], what: str) -> None:
        """Trains on from ``parameters``, the global model of ``round_`` (checked against
        the server's fingerprint ``hash_``, or not)."""
        _check_same("the global model", parameters, "this trainer's model", self.model.parameters())
        self.model.load(parameters)
        self.global_parameters = parameters
        self.global_hash = hash_
        self.round = round_
        self.last_model = round_
        self.log(f"round {round_}: {what} received")
        self.stats = self.stats.fresh()

    def _apply_change(self, server: str, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
        """Moves the global model it holds by the server's change, if the change is of that
        model and leads to the model the server says; otherwise asks for the whole model (as
        the Rust trainer does) and returns False."""
        try:
            round_ = int(metadata[ROUND])
            base_round = int(metadata[BASE_ROUND])
        except (KeyError, ValueError):
            raise ProtocolError(f"a change from {server} without its rounds: {metadata}")
        if self.last_model is not None and round_ <= self.last_model:
            return False
        why = None
        if base_round != self.round or metadata.get(BASE_HASH) != self.global_hash:
            why = f"it is of round {base_round}'s model, this trainer holds round {self.round}'s"
        else:
            try:
                parameters = codec.apply_change(self.global_parameters, tensors, metadata)
            except ValueError as error:
                why = f"it cannot be applied: {error}"
            else:
                expected = metadata.get(MODEL_HASH, "")
                as_tensors = {n: safetensors.Tensor.from_numpy(v) for n, v in parameters.items()}
                if safetensors.fingerprint_matches(as_tensors, expected):
                    self._adopt(parameters, round_, expected, "change of the global model")
                    return True
                why = "the model it leads to does not match the fingerprint it came with"
        self.log(f"round {round_}: the change from {server} is refused ({why}); asking for the whole model")
        self._send(server, "model-request.safetensors", {}, {KIND: KIND_MODEL_REQUEST})
        return False

    def take(self, relative: str) -> bytes:
        """The bytes of a file the bridge delivered; the file is removed, so that a long
        job's directory does not fill up."""
        path = self.job.path(relative)
        with open(path, "rb") as file:
            raw = file.read()
        os.unlink(path)
        return raw


def _check_same(
    expected_name: str, expected: Mapping[str, Any], actual_name: str, actual: Mapping[str, Any]
) -> None:
    """Stops with the differences when two sets of parameters differ in names or shapes: a
    trainer whose model is not the job's would send updates that mean nothing."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    shapes = [
        f"{name}: {tuple(expected[name].shape)} vs {tuple(getattr(actual[name], 'shape', ()))}"
        for name in sorted(set(expected) & set(actual))
        if tuple(expected[name].shape) != tuple(getattr(actual[name], "shape", ()))
    ]
    if missing or extra or shapes:
        problems = []
        if missing:
            problems.append(f"{actual_name} lacks {missing}")
        if extra:
            problems.append(f"{actual_name} has {extra}, which {expected_name} does not")
        if shapes:
            problems.append("shapes differ: " + "; ".join(shapes))
        raise ProtocolError(
            f"{actual_name} is not {expected_name}: " + ", ".join(problems)
            + " (parameter names and shapes must be those of the job's other trainers)"
        )


def _f32(array: Any) -> Any:
    """A float32 copy: the global model must not share memory with the model that trains."""
    import numpy as np

    return np.array(array, dtype=np.float32, copy=True)


def _finite(value: float) -> Optional[float]:
    """JSON has no NaN: a diverging loss is reported as none."""
    return value if math.isfinite(value) else None
