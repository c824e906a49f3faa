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
        self.format = codec.SparseFormat(codec.kept_count(0.01, codec.CHUNK), 2)

    def test_it_keeps_the_largest_of_each_chunk_and_decodes_what_it_says_it_sent(self):
        records, sent = self.format.encode(self.values)
        self.assertEqual(len(records), 2 * 81 + self.format.record_bytes(100))
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
            self.assertEqual(metadata["hypha.sparse.kept"], "41")
            records = tensors["w#sparse"].tobytes()
            total += self.format.decode(records, self.values.size)
            truth += self.values
        # Sent + carried = the sum of the true updates.
        np.testing.assert_allclose(total + feedback.residual["w"], truth, rtol=1e-4, atol=1e-3)

    def test_a_change_moves_only_the_values_it_keeps_and_refuses_another_models(self):
        model = {"w": self.values.reshape(-1, 4).copy(), "b": np.array([-0.0, 1.0], dtype=np.float32)}
        change = {"w": np.ones_like(model["w"]) * 1e-3, "b": np.array([0.0, 0.5], dtype=np.float32)}
        feedback = codec.ErrorFeedback(codec.SparseFormat(41, 2))
        tensors, metadata = feedback.compress(change, {})
        moved = codec.apply_change(model, tensors, metadata)
        kept_w = np.nonzero(self.format.decode(tensors["w#sparse"].tobytes(), self.values.size))[0]
        self.assertEqual(len(kept_w), 2 * 41 + self.format.kept_in(100))
        np.testing.assert_array_equal(
            np.delete(moved["w"].reshape(-1), kept_w), np.delete(model["w"].reshape(-1), kept_w)
        )
        # The value a change does not keep is left as it is, to the bit (-0.0 stays -0.0).
        self.assertEqual(np.signbit(moved["b"][0]), True)
        self.assertEqual(moved["b"][1], np.float32(1.5))
        with self.assertRaisesRegex(ValueError, "shape"):
            codec.apply_change({"w": model["w"].reshape(4, -1), "b": model["b"]}, tensors, metadata)
        with self.assertRaisesRegex(ValueError, "other parameters"):
            codec.apply_change({"w": model["w"]}, tensors, metadata)

    def test_hostile_records_are_refused(self):
        records, _ = self.format.encode(self.values[:100])
        record = bytearray(records)
        # Two offsets the same: not increasing.
        bad = bytearray(record)
        bad[8:11] = bytes([5, 0x50, 0x00])
        with self.assertRaisesRegex(ValueError, "not increasing"):
            self.format.decode(bytes(bad), 100)
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
