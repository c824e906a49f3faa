"""SafeTensors files in and out, with the standard library alone.

A file is an 8-byte little-endian header length, a JSON header (each tensor's ``dtype``,
``shape`` and ``data_offsets``; string metadata under ``__metadata__``), then the tensors'
little-endian bytes. :class:`Tensor` keeps the raw bytes; ``to_numpy``/``from_numpy`` and
``to_torch``/``from_torch`` convert when those libraries are installed.

Hypha's DiLoCo files carry what they are in the metadata: ``hypha.kind`` (``model`` or
``pseudo_gradient``), ``hypha.round`` and, for a pseudo-gradient, ``hypha.samples``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = [
    "Tensor",
    "SafeTensorsError",
    "load",
    "loads",
    "save",
    "dumps",
    "fingerprint",
    "fingerprint_matches",
]

# dtype → bytes per element.
ITEM_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

# The largest header read: a header is a few kilobytes, never gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafeTensorsError(ValueError):
    """A file that is not valid SafeTensors, with what is wrong in it."""


@dataclass(frozen=True)
class Tensor:
    """One tensor: its dtype name (``F32``, ``I64``, …), shape and little-endian bytes."""

    dtype: str
    shape: Tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_SIZES:
            raise SafeTensorsError(f"unknown dtype {self.dtype!r}")
        expected = ITEM_SIZES[self.dtype]
        for dim in self.shape:
            expected *= dim
        if len(self.data) != expected:
            raise SafeTensorsError(
                f"a {self.dtype} tensor of shape {list(self.shape)} needs {expected} bytes, "
                f"not {len(self.data)}"
            )

    def to_numpy(self) -> Any:
        """A numpy array (BF16 becomes float32: numpy has no bfloat16)."""
        import numpy as np

        if self.dtype == "BF16":
            halves = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return halves.view(np.float32).reshape(self.shape)
        dtype = _NUMPY_DTYPES.get(self.dtype)
        if dtype is None:
            raise SafeTensorsError(f"numpy cannot hold {self.dtype}")
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape).copy()

    @classmethod
    def from_numpy(cls, array: Any) -> "Tensor":
        import numpy as np

        array = np.ascontiguousarray(array)
        for name, dtype in _NUMPY_DTYPES.items():
            if np.dtype(dtype) == array.dtype.newbyteorder("<"):
                little = array.astype(np.dtype(dtype), copy=False)
                return cls(name, tuple(int(d) for d in array.shape), little.tobytes())
        raise SafeTensorsError(f"numpy dtype {array.dtype} has no SafeTensors dtype")

    def to_torch(self) -> Any:
        """A torch tensor (on the CPU)."""
        import torch

        if self.dtype == "BF16":
            raw = torch.frombuffer(bytearray(self.data), dtype=torch.int16)
            return raw.view(torch.bfloat16).reshape(self.shape).clone()
        return torch.from_numpy(self.to_numpy())

    @classmethod
    def from_torch(cls, tensor: Any) -> "Tensor":
        import torch

        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype == torch.bfloat16:
            raw = tensor.view(torch.int16).numpy().astype("<i2").tobytes()
            return cls("BF16", tuple(tensor.shape), raw)
        return cls.from_numpy(tensor.numpy())


_NUMPY_DTYPES = {
    "BOOL": "?",
    "U8": "u1",
    "I8": "i1",
    "U16": "<u2",
    "I16": "<i2",
    "F16": "<f2",
    "U32": "<u4",
    "I32": "<i4",
    "F32": "<f4",
    "U64": "<u8",
    "I64": "<i8",
    "F64": "<f8",
}


def loads(raw: bytes) -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    """The tensors and the metadata of SafeTensors bytes.

    The file may come from a peer: it is checked as the format's own library checks it (the
    tensors' byte ranges follow each other from 0 and cover the data exactly, each holds what
    its dtype and shape need), and anything else is a :class:`SafeTensorsError`.
    """
    if len(raw) < 8:
        raise SafeTensorsError("shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(raw):
        raise SafeTensorsError(f"a header of {length} bytes does not fit a file of {len(raw)}")
    try:
        header = json.loads(raw[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SafeTensorsError(f"the header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise SafeTensorsError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafeTensorsError("__metadata__ is not an object of strings")
    body = memoryview(raw)[8 + length :]
    entries = []
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise SafeTensorsError(f"tensor {name!r}: a malformed header entry {info!r}") from None
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise SafeTensorsError(f"tensor {name!r}: a malformed header entry {info!r}")
        numbers = [begin, end, *shape]
        if not all(type(n) is int and n >= 0 for n in numbers):
            raise SafeTensorsError(f"tensor {name!r}: offsets and dimensions must be whole numbers ≥ 0")
        entries.append((begin, end, name, dtype, tuple(shape)))
    entries.sort()
    position = 0
    tensors = {}
    for begin, end, name, dtype, shape in entries:
        if begin != position or end < begin:
            raise SafeTensorsError(
                f"tensor {name!r}: bytes {begin}..{end} do not follow the previous tensor's end {position}"
            )
        if end > len(body):
            raise SafeTensorsError(
                f"tensor {name!r}: bytes {begin}..{end} lie outside the {len(body)} of the file"
            )
        position = end
        tensors[name] = Tensor(dtype, shape, bytes(body[begin:end]))
    if position != len(body):
        raise SafeTensorsError(f"the tensors cover {position} of the {len(body)} data bytes")
    return tensors, dict(metadata)


def load(path: "os.PathLike[str] | str") -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    """The tensors and the metadata of the file at ``path``."""
    with open(path, "rb") as file:
        return loads(file.read())


def dumps(tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """SafeTensors bytes of ``tensors`` (:class:`Tensor`, numpy arrays or torch tensors),
    in name order, with string ``metadata``."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        tensor = _as_tensor(tensors[name])
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(tensor.data)],
        }
        chunks.append(tensor.data)
        offset += len(tensor.data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The tensors' bytes start 8-aligned, as readers that map the file expect.
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


def save(
    path: "os.PathLike[str] | str",
    tensors: Mapping[str, Any],
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Writes ``tensors`` to ``path`` atomically: a temporary file beside it, fsynced, then
    renamed, so that a crash never leaves a partial file under the name."""
    raw = dumps(tensors, metadata)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(raw)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def _as_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    module = type(value).__module__
    if module.startswith("torch"):
        return Tensor.from_torch(value)
    if module.startswith("numpy"):
        return Tensor.from_numpy(value)
    raise SafeTensorsError(f"cannot store a {type(value).__name__}: give a Tensor, numpy array or torch tensor")


def _blake3() -> Any:
    """A multi-threaded BLAKE3 hasher, or ``None`` where the ``blake3`` package is missing."""
    try:
        import blake3  # type: ignore[import-not-found]
    except ImportError:
        return None
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def can_fingerprint() -> bool:
    """Whether this Python computes the fingerprint the parameter server sends (BLAKE3)."""
    return _blake3() is not None


def fingerprint(tensors: Mapping[str, Tensor], algorithm: str = "blake3") -> str:
    """The model's fingerprint, ``blake3:<hex>``, as the parameter server computes it
    (``hypha_diloco::Fingerprint``) and sends it with every model (``hypha.model_hash``): the
    hash over each tensor in name order, each of its name, dtype, shape (u64 little-endian
    dimensions) and bytes prefixed with its length as a u64 little-endian. ``blake3`` needs
    the ``blake3`` package (``pip install blake3``); ``sha256`` is the standard library's,
    what servers before BLAKE3 sent."""
    if algorithm == "sha256":
        digest: Any = hashlib.sha256()
    elif algorithm == "blake3":
        digest = _blake3()
        if digest is None:
            raise SafeTensorsError("a blake3 fingerprint needs the blake3 package: pip install blake3")
    else:
        raise SafeTensorsError(f"no fingerprint {algorithm!r}: blake3 or sha256")

    def part(data: Any) -> None:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)

    for name in sorted(tensors):
        tensor = tensors[name]
        part(name.encode("utf-8"))
        part(tensor.dtype.encode("ascii"))
        part(b"".join(struct.pack("<Q", d) for d in tensor.shape))
        part(tensor.data)
    return f"{algorithm}:{digest.hexdigest()}"


def fingerprint_matches(tensors: Mapping[str, Tensor], expected: str) -> Optional[bool]:
    """Whether ``tensors`` have the fingerprint ``expected`` (``algorithm:hex``); ``None`` when
    this Python cannot compute that algorithm (``blake3`` without its package)."""
    algorithm = expected.split(":", 1)[0]
    if algorithm == "blake3" and _blake3() is None:
        return None
    try:
        return fingerprint(tensors, algorithm) == expected
    except SafeTensorsError:
        return False