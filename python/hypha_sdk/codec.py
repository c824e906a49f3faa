"""The ``sparse`` codec of DiLoCo pseudo-gradients, as the Rust trainers write it.

Of every chunk of 4,096 values (a parameter's values in row-major order) the k of largest
magnitude are sent, each as its offset in the chunk (Elias-Fano coded: the low
l = floor(log2(L / k)) bits of every offset packed, then the high parts in unary) and a code
of 2 or 4 bits on a grid of levels fitted to the chunk's kept magnitudes. The wire format is written down in the Rust
crate (``hypha_diloco::codec::sparse``): a parameter ``name`` becomes one U8 tensor
``name#sparse`` of its chunks' records, its shape goes in the metadata as ``hypha.shape.name``,
and the file says ``hypha.codec = sparse``, ``hypha.codec_version = 2``, ``hypha.sparse.kept``
(k of a whole chunk) and ``hypha.sparse.bits``.

:class:`ErrorFeedback` carries what was not sent into the next update, decayed by the job's
``sparse_decay`` (the trainer's outer momentum, as in SparseLoCo).

Needs numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

__all__ = ["CHUNK", "SparseFormat", "ErrorFeedback", "kept_count", "from_config"]

CHUNK = 4096
CODEC = "hypha.codec"
CODEC_VERSION = "hypha.codec_version"
# The wire format's version (hypha_diloco::codec::VERSION); version 1's 12-bit offsets are
# refused.
VERSION = "2"
SHAPE = "hypha.shape."
KEPT = "hypha.sparse.kept"
BITS = "hypha.sparse.bits"
RECORDS = "#sparse"
# The job's defaults when it sets no sparse_* key (hypha_diloco::codec's).
DENSITY = 0.015625
DEFAULT_BITS = 2
DECAY = 0.97


def kept_count(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1, at most n, reading the density as the f32 the
    Rust nodes read (0.1 keeps 100 of 1,000, not 101): the parameter server bounds an
    update's size by it."""
    import numpy as np

    exact = float(np.float32(density)) * n
    whole = round(exact)
    k = whole if abs(exact - whole) <= 1e-6 * max(exact, 1.0) else math.ceil(exact)
    return min(max(int(k), 1), max(n, 1))


@dataclass(frozen=True)
class SparseFormat:
    """``kept`` values of a whole chunk, each in ``bits`` bits (2 or 4)."""

    kept: int
    bits: int

    def __post_init__(self) -> None:
        if not 1 <= self.kept <= CHUNK:
            raise ValueError(f"{self.kept} values kept of a chunk of {CHUNK}: from 1 to {CHUNK}")
        if self.bits not in (2, 4):
            raise ValueError(f"codes of {self.bits} bits: 2 or 4")

    def kept_in(self, length: int) -> int:
        """k of a whole chunk; every value of a shorter one."""
        return self.kept if length == CHUNK else length

    def record_bytes(self, length: int) -> int:
        k = self.kept_in(length)
        return 8 + _offsets_bytes(length, k) + -(-self.bits * k // 8)

    def encode(self, values: Any) -> Tuple[bytes, Any]:
        """The records of ``values`` (flat float32), and the values a reader decodes from
        them (what was sent, for error feedback)."""
        import numpy as np

        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        if not np.isfinite(values).all():
            # The server would refuse the whole update: say so here, where it began.
            raise ValueError("an update with a NaN or an infinite value cannot be sent")
        n = values.size
        whole = n // CHUNK
        parts = []
        sent = np.zeros(n, dtype=np.float32)
        if whole:
            block = values[: whole * CHUNK].reshape(whole, CHUNK)
            records, decoded = self._encode_chunks(block, self.kept)
            parts.append(records.tobytes())
            sent[: whole * CHUNK] = decoded.reshape(-1)
        if n % CHUNK:
            rest = values[whole * CHUNK :].reshape(1, -1)
            records, decoded = self._encode_chunks(rest, self.kept_in(rest.shape[1]))
            parts.append(records.tobytes())
            sent[whole * CHUNK :] = decoded.reshape(-1)
        return b"".join(parts), sent

    def _encode_chunks(self, chunks: Any, k: int) -> Tuple[Any, Any]:
        """Records (uint8, one row a chunk) of the rows of ``chunks``, each keeping ``k``."""
        import numpy as np

        rows, length = chunks.shape
        magnitude = np.abs(chunks)
        if k < length:
            # As the Rust nodes choose: every value above the k-th largest magnitude, then
            # the earliest of those equal to it (argpartition's choice among equals depends
            # on the CPU numpy runs on).
            threshold = np.partition(magnitude, length - k, axis=1)[:, length - k, None]
            above = magnitude > threshold
            at = magnitude == threshold
            ties = k - above.sum(axis=1, keepdims=True)
            kept = np.nonzero(above | (at & (np.cumsum(at, axis=1) <= ties)))[1].reshape(rows, k)
        else:
            kept = np.broadcast_to(np.arange(length), (rows, length))
        values = np.take_along_axis(chunks, kept, axis=1)
        magnitudes = np.abs(values)
        steps = (1 << (self.bits - 1)) - 1
        low, high = _fitted_levels(magnitudes, steps)
        span = (high - low).astype(np.float32)
        levels = _levels_of(magnitudes, low, high, steps)
        negative = values < 0
        codes = levels | (negative.astype(np.uint32) << (self.bits - 1))
        decoded_magnitude = low[:, None] + span[:, None] * (levels.astype(np.float32) / np.float32(steps))
        decoded_kept = np.where(negative, -decoded_magnitude, decoded_magnitude).astype(np.float32)
        decoded = np.zeros_like(chunks, dtype=np.float32)
        np.put_along_axis(decoded, kept, decoded_kept, axis=1)
        bounds = np.stack([low, high], axis=1).astype("<f4").view(np.uint8)
        records = np.concatenate(
            [bounds, _pack_offsets(kept, length), _pack(codes, self.bits)], axis=1
        )
        return records, decoded

    def decode(self, records: bytes, n: int) -> Any:
        """The ``n`` values whose records are ``records``, checked as the Rust nodes check
        them (a ``ValueError`` says what is wrong)."""
        import numpy as np

        out = np.zeros(n, dtype=np.float32)
        positions, values = self.decode_kept(records, n)
        out[positions] = values
        return out

    def decode_kept(self, records: bytes, n: int) -> Tuple[Any, Any]:
        """The positions and values that ``records`` keep of ``n`` values, checked as
        :meth:`decode` checks them."""
        import numpy as np

        kept_positions = []
        kept_values = []
        data = memoryview(records)
        at = 0
        steps = float((1 << (self.bits - 1)) - 1)
        sign = 1 << (self.bits - 1)
        for start in range(0, n, CHUNK):
            length = min(CHUNK, n - start)
            k = self.kept_in(length)
            size = self.record_bytes(length)
            record = np.frombuffer(data[at : at + size], dtype=np.uint8)
            if record.size != size:
                raise ValueError("a record cut short")
            at += size
            low, high = np.frombuffer(record[:8].tobytes(), dtype="<f4")
            if not (0.0 <= low <= high <= 1e9):
                raise ValueError("a chunk's magnitudes are not finite, negative, beyond ±1e9 or out of order")
            offsets_len = _offsets_bytes(length, k)
            offsets = _unpack_offsets(record[8 : 8 + offsets_len], length, k)
            codes = _unpack(record[8 + offsets_len :], self.bits, k)
            if (offsets >= length).any() or (np.diff(offsets.astype(np.int64)) <= 0).any():
                raise ValueError("offsets outside the chunk or not increasing")
            span = np.float32(high - low)
            magnitude = np.float32(low) + span * ((codes & (sign - 1)).astype(np.float32) / np.float32(steps))
            kept_positions.append(start + offsets.astype(np.int64))
            kept_values.append(np.where(codes & sign, -magnitude, magnitude).astype(np.float32))
        if at != len(records):
            raise ValueError("records past the parameter's values")
        if not kept_positions:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        return np.concatenate(kept_positions), np.concatenate(kept_values)


# Rounds of fitting a chunk's levels (hypha_diloco::codec::sparse's FITTING_ROUNDS).
FITTING_ROUNDS = 4


def _levels_of(magnitudes: Any, low: Any, high: Any, steps: int) -> Any:
    """The level (0 ..= steps) nearest to each magnitude (rows of float32) on its row's grid
    from ``low`` to ``high``, computed in float32 as the Rust nodes do."""
    import numpy as np

    span = (high - low).astype(np.float32)
    safe = np.where(span > 0, span, np.float32(1))
    scaled = (magnitudes - low[:, None]) / safe[:, None] * np.float32(steps)
    return np.where(
        span[:, None] > 0,
        # Halves away from zero, as Rust's f32::round (np.rint would take the even one).
        np.clip(np.floor(scaled.astype(np.float64) + 0.5), 0, steps),
        0,
    ).astype(np.uint32)


def _fitted_levels(magnitudes: Any, steps: int) -> Tuple[Any, Any]:
    """Each row's grid ends (low, high) that carry its magnitudes with the least squared error,
    by Lloyd's algorithm from the smallest and the largest magnitude: the same bits as the
    Rust nodes (hypha_diloco::codec::sparse::fitted_levels), whose sums are float64 in the
    order of the offsets (np.cumsum adds in order; np.sum would not) and exact but for the
    magnitudes'."""
    import numpy as np

    smallest = magnitudes.min(axis=1).astype(np.float32)
    largest = magnitudes.max(axis=1).astype(np.float32)
    low, high = smallest, largest
    m_each = magnitudes.astype(np.float64)
    n = np.float64(magnitudes.shape[1])
    for _ in range(FITTING_ROUNDS):
        level = _levels_of(magnitudes, low, high, steps).astype(np.float64)
        q = level.sum(axis=1)
        qq = (level * level).sum(axis=1)
        m = np.cumsum(m_each, axis=1)[:, -1]
        mq = np.cumsum(m_each * level, axis=1)[:, -1]
        spread = n * qq - q * q
        fits = spread > 0
        d = (n * mq - q * m) / np.where(fits, spread, 1.0)
        a = np.where(fits, (m - d * q) / n, m / n)
        b = np.where(fits, a + d * np.float64(steps), m / n)
        low = np.clip(a.astype(np.float32), smallest, largest)
        high = np.clip(b.astype(np.float32), low, largest)
    return low, high


def _offset_bits(length: int, k: int) -> Tuple[int, int]:
    """The Elias-Fano code of ``k`` offsets below ``length``: the low bits of each offset
    and the bits of the high parts' field; no bits at all where every value is kept."""
    if k >= length:
        return 0, 0
    low = max(length // k, 1).bit_length() - 1
    return low, k + ((length - 1) >> low) + 1


def _offsets_bytes(length: int, k: int) -> int:
    low, high = _offset_bits(length, k)
    return -(-low * k // 8) + -(-high // 8)


def _pack_offsets(offsets: Any, length: int) -> Any:
    """Rows of strictly increasing ``offsets`` below ``length``, Elias-Fano coded as the Rust
    nodes write them: the low bits packed, then a field where bit (o_i >> low) + i is set."""
    import numpy as np

    rows, k = offsets.shape
    low, high_bits = _offset_bits(length, k)
    if not high_bits:
        return np.zeros((rows, 0), dtype=np.uint8)
    offsets = offsets.astype(np.uint32)
    lows = _pack(offsets & np.uint32((1 << low) - 1), low)
    field = np.zeros((rows, high_bits), dtype=np.uint8)
    np.put_along_axis(field, (offsets >> np.uint32(low)).astype(np.int64) + np.arange(k), 1, axis=1)
    return np.concatenate([lows, np.packbits(field, axis=1, bitorder="little")], axis=1)


def _unpack_offsets(packed: Any, length: int, k: int) -> Any:
    """The ``k`` offsets of one record's Elias-Fano code, checked: a ``ValueError`` if its
    high parts set other than ``k`` bits or a padding bit is set."""
    import numpy as np

    low, high_bits = _offset_bits(length, k)
    if not high_bits:
        return np.arange(k, dtype=np.int64)
    low_bytes = -(-low * k // 8)
    lows = _unpack(packed[:low_bytes], low, k)
    field = np.unpackbits(np.asarray(packed[low_bytes:], dtype=np.uint8), bitorder="little")
    ones = np.flatnonzero(field)
    if ones.size != k or (ones.size and ones[-1] >= high_bits):
        raise ValueError("a record's high parts set other than one bit per kept value")
    highs = ones.astype(np.int64) - np.arange(k)
    return ((highs << low) | lows.astype(np.int64)).astype(np.int64)


def _pack(values: Any, bits: int) -> Any:
    """Rows of ``values`` (each below 2**bits) packed from the least significant bit of the
    first byte on, each row padded with zero bits to whole bytes."""
    import numpy as np

    rows, count = values.shape
    shifts = np.arange(bits, dtype=np.uint64)
    as_bits = ((values[:, :, None].astype(np.uint64) >> shifts) & 1).astype(np.uint8)
    flat = as_bits.reshape(rows, count * bits)
    return np.packbits(flat, axis=1, bitorder="little")


def _unpack(packed: Any, bits: int, count: int) -> Any:
    """``count`` values of ``bits`` bits from ``packed``, as :func:`_pack` wrote them; a
    ``ValueError`` if a padding bit is set."""
    import numpy as np

    flat = np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")
    if flat[count * bits :].any():
        raise ValueError("bits set after a record's last offset or code")
    grouped = flat[: count * bits].reshape(count, bits).astype(np.uint32)
    return (grouped << np.arange(bits, dtype=np.uint32)).sum(axis=1).astype(np.uint32)


@dataclass
class ErrorFeedback:
    """What the codec did not send of each parameter, carried (times ``decay``) into the
    next update."""

    format: SparseFormat
    decay: float = DECAY
    residual: Dict[str, Any] = field(default_factory=dict)

    def compress(
        self, update: Mapping[str, Any], metadata: Mapping[str, str]
    ) -> Tuple[Dict[str, Any], Dict[str, str]]:
        """The tensors and metadata of ``update`` (float32 arrays by name) as a sparse file,
        with the carried residual added; what was not sent is carried on."""
        import numpy as np

        tensors: Dict[str, Any] = {}
        meta = dict(metadata)
        meta.update({CODEC: "sparse", CODEC_VERSION: VERSION, KEPT: str(self.format.kept), BITS: str(self.format.bits)})
        residual = {}
        for name, value in update.items():
            value = np.asarray(value, dtype=np.float32)
            carried = value.reshape(-1).copy()
            previous = self.residual.get(name)
            if previous is not None and previous.shape == carried.shape:
                carried += np.float32(self.decay) * previous
            records, sent = self.format.encode(carried)
            residual[name] = carried - sent
            tensors[name + RECORDS] = np.frombuffer(records, dtype=np.uint8)
            meta[SHAPE + name] = "[" + ",".join(str(d) for d in value.shape) + "]"
        self.residual = residual
        return tensors, meta

    def reset(self) -> None:
        """Forgets the residuals: the model they were measured against is gone."""
        self.residual = {}


def apply_change(
    model: Mapping[str, Any], tensors: Mapping[str, Any], metadata: Mapping[str, str]
) -> Dict[str, Any]:
    """``model`` (float32 arrays by name) moved by a ``sparse`` change of it (the tensors
    and metadata of the parameter server's file), as the Rust trainers apply it: each kept
    value added in f32 where it is kept, every other value left as it is, so that the result
    is the server's model bit for bit. A ``ValueError`` says what does not fit."""
    import numpy as np

    if metadata.get(CODEC) != "sparse" or metadata.get(CODEC_VERSION) != VERSION:
        raise ValueError(f"a change of codec {metadata.get(CODEC)!r} version {metadata.get(CODEC_VERSION)!r}; this loop reads sparse version {VERSION}")
    try:
        format = SparseFormat(int(metadata[KEPT]), int(metadata[BITS]))
    except (KeyError, ValueError) as error:
        raise ValueError(f"a sparse change without a readable format: {error}")
    names = {name[: -len(RECORDS)] for name in tensors if name.endswith(RECORDS)}
    if names != set(model) or len(names) != len(tensors):
        raise ValueError("a change of other parameters than the model's")
    moved = {}
    for name, values in model.items():
        shape = "[" + ",".join(str(d) for d in values.shape) + "]"
        if metadata.get(SHAPE + name, "").replace(" ", "") != shape:
            raise ValueError(f"{name}: a change of shape {metadata.get(SHAPE + name)} for {shape}")
        records = tensors[name + RECORDS]
        records = records.data if hasattr(records, "data") else bytes(records)
        positions, kept = format.decode_kept(bytes(records), values.size)
        new = np.array(values, dtype=np.float32, copy=True)
        flat = new.reshape(-1)
        flat[positions] += kept
        moved[name] = new
    return moved


def from_config(diloco: Mapping[str, Any]) -> "ErrorFeedback | None":
    """The error feedback of the job's ``[diloco]`` settings (the trainers' config's
    ``diloco``) when it compresses with ``sparse``; ``None`` when it sends float32 (the
    server reads every codec, so a trainer that does not compress is still understood)."""
    if diloco.get("compression") != "sparse":
        return None

    def setting(key: str, default: float) -> float:
        value = diloco.get(key)
        return default if value is None else float(value)

    density = setting("sparse_density", DENSITY)
    decay = setting("sparse_decay", DECAY)
    for key, value in (("sparse_density", density), ("sparse_decay", decay)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"the job's {key} = {value} is not in (0, 1]")
    bits = int(setting("sparse_bits", DEFAULT_BITS))
    return ErrorFeedback(SparseFormat(kept_count(density, CHUNK), bits), decay)
