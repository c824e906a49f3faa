"""The SDK's sparse codec: what it keeps, what error feedback carries, what it refuses.
Runs anywhere numpy is (no bridge needed)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from hypha_sdk import codec  # noqa: E402


@unittest.skipIf(np is None, "needs numpy")
class Sparse(unittest.TestCase):
    def setUp(self):
        rng = np.random.default_rng(7)
        # Two whole chunks and a short one.
        self.values = (rng.standard_normal(2 * codec.CHUNK + 100) ** 3).astype(np.float32)
        self.format = codec.SparseFormat(codec.kept_count(codec.DENSITY, codec.CHUNK), 2)

    def test_it_keeps_the_largest_of_each_chunk_and_decodes_what_it_says_it_sent(self):
        records, sent = self.format.encode(self.values)
        # 64 kept of a whole chunk: bounds 8, low offset bits 48, high parts 16, codes 16.
        self.assertEqual(len(records), 2 * 88 + self.format.record_bytes(100))
        decoded = self.format.decode(records, self.values.size)
        np.testing.assert_array_equal(decoded, sent)
        for start in range(0, self.values.size, codec.CHUNK):
            chunk = self.values[start : start + codec.CHUNK]
            kept = np.nonzero(decoded[start : start + codec.CHUNK])[0]
            self.assertEqual(len(kept), self.format.kept_in(chunk.size))
            smallest = np.abs(chunk[kept]).min()
            others = np.delete(np.abs(chunk), kept)
            self.assertTrue((others <= smallest).all())
            self.assertTrue((np.sign(chunk[kept]) == np.sign(decoded[start + kept])).all())

    def test_error_feedback_carries_what_was_not_sent(self):
        feedback = codec.ErrorFeedback(self.format, decay=1.0)
        update = {"w": self.values.reshape(-1, 4)}
        truth = np.zeros_like(self.values)
        total = np.zeros_like(self.values)
        for _ in range(30):
            tensors, metadata = feedback.compress(update, {"hypha.kind": "pseudo_gradient"})
            self.assertEqual(metadata["hypha.shape.w"], f"[{self.values.size // 4},4]")
            self.assertEqual(metadata["hypha.sparse.kept"], "64")
            records = tensors["w#sparse"].tobytes()
            total += self.format.decode(records, self.values.size)
            truth += self.values
        # Sent + carried = the sum of the true updates.
        np.testing.assert_allclose(total + feedback.residual["w"], truth, rtol=1e-4, atol=1e-3)

    def test_a_change_moves_only_the_values_it_keeps_and_refuses_another_models(self):
        model = {"w": self.values.reshape(-1, 4).copy(), "b": np.array([-0.0, 1.0], dtype=np.float32)}
        # The first chunk's change is even: its first 64 values are kept, its last is not.
        model["w"].reshape(-1)[codec.CHUNK - 1] = -0.0
        change = {"w": np.ones_like(model["w"]) * 1e-3, "b": np.array([0.0, 0.5], dtype=np.float32)}
        feedback = codec.ErrorFeedback(codec.SparseFormat(64, 2))
        tensors, metadata = feedback.compress(change, {})
        moved = codec.apply_change(model, tensors, metadata)
        kept_w = np.nonzero(self.format.decode(tensors["w#sparse"].tobytes(), self.values.size))[0]
        self.assertEqual(len(kept_w), 2 * 64 + self.format.kept_in(100))
        np.testing.assert_array_equal(
            np.delete(moved["w"].reshape(-1), kept_w), np.delete(model["w"].reshape(-1), kept_w)
        )
        # A value a change does not keep is left as it is, to the bit (-0.0 stays -0.0).
        self.assertNotIn(codec.CHUNK - 1, kept_w)
        self.assertEqual(np.signbit(moved["w"].reshape(-1)[codec.CHUNK - 1]), True)
        # A parameter shorter than a chunk is sent whole.
        np.testing.assert_array_equal(moved["b"], np.array([0.0, 1.5], dtype=np.float32))
        with self.assertRaisesRegex(ValueError, "shape"):
            codec.apply_change({"w": model["w"].reshape(4, -1), "b": model["b"]}, tensors, metadata)
        with self.assertRaisesRegex(ValueError, "other parameters"):
            codec.apply_change({"w": model["w"]}, tensors, metadata)

    def test_equal_magnitudes_and_halfway_levels_are_chosen_as_the_rust_nodes_choose(self):
        # Of equal magnitudes the earliest offsets are kept.
        even = np.full(codec.CHUNK, 0.5, dtype=np.float32)
        positions, _ = self.format.decode_kept(self.format.encode(even)[0], codec.CHUNK)
        np.testing.assert_array_equal(positions, np.arange(64))
        # 2 lies halfway between 1 and 3, the first grid: rounded away from zero (as
        # f32::round does) it joins 3, and the levels become the means 1 and 2.5 (rounded to
        # even it would have joined 1: 1.5 and 3).
        _, sent = codec.SparseFormat(4096, 2).encode(np.array([1.0, 2.0, 3.0], dtype=np.float32))
        np.testing.assert_array_equal(sent, np.array([1.0, 2.5, 2.5], dtype=np.float32))

    def test_hostile_records_are_refused(self):
        # A chunk of 4,096 keeping 2: 11 low bits each (3 bytes), 4 bits of high parts (1 byte).
        two = codec.SparseFormat(2, 2)
        self.assertEqual(two.record_bytes(codec.CHUNK), 8 + 3 + 1 + 1)
        records, _ = two.encode(self.values[: codec.CHUNK])
        record = bytearray(records)
        # Two offsets the same (5, 5; high parts 0 and 0, bits 0 and 1): not increasing.
        bad = bytearray(record)
        bad[8:12] = bytes([5, 5 << 3, 0, 0b11])
        with self.assertRaisesRegex(ValueError, "not increasing"):
            two.decode(bytes(bad), codec.CHUNK)
        # Three high bits for two offsets, or one.
        for field in (0b111, 0b1):
            bad = bytearray(record)
            bad[11] = field
            with self.assertRaisesRegex(ValueError, "high parts"):
                two.decode(bytes(bad), codec.CHUNK)
        # A short chunk keeps every value and has no offsets: 100 codes of 2 bits.
        self.assertEqual(self.format.record_bytes(100), 8 + 25)
        records, _ = self.format.encode(self.values[:100])
        record = bytearray(records)
        bad = bytearray(record)
        bad[0:4] = np.array([2.0], dtype="<f4").tobytes()
        bad[4:8] = np.array([1.0], dtype="<f4").tobytes()
        with self.assertRaisesRegex(ValueError, "out of order"):
            self.format.decode(bytes(bad), 100)
        with self.assertRaisesRegex(ValueError, "cut short"):
            self.format.decode(bytes(record[:-1]), 100)
        with self.assertRaises(ValueError):
            codec.SparseFormat(41, 3)


if __name__ == "__main__":
    unittest.main()
