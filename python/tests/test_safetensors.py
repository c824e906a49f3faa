"""SafeTensors in and out, checked against the format's own reference library where it is
installed."""

import os
import struct
import tempfile
import unittest

from hypha_sdk.safetensors import SafeTensorsError, Tensor, dumps, load, loads, save

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

try:
    import safetensors.numpy as reference
except ImportError:  # pragma: no cover
    reference = None


class Format(unittest.TestCase):
    def test_tensors_and_metadata_survive_a_round_trip(self):
        tensors = {
            "w": Tensor("F32", (2, 2), struct.pack("<4f", 1.0, -2.0, 3.5, 0.0)),
            "ids": Tensor("I64", (3,), struct.pack("<3q", 7, -1, 2**40)),
            "empty": Tensor("U8", (0, 4), b""),
        }
        raw = dumps(tensors, {"hypha.kind": "model", "hypha.round": "3"})
        self.assertEqual(struct.unpack("<Q", raw[:8])[0] % 8, 0, "the data starts 8-aligned")
        back, metadata = loads(raw)
        self.assertEqual(back, tensors)
        self.assertEqual(metadata, {"hypha.kind": "model", "hypha.round": "3"})

    def test_a_save_is_atomic_and_leaves_no_temporary_file(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "m.safetensors")
            save(path, {"b": Tensor("BOOL", (2,), b"\x01\x00")}, {"k": "v"})
            self.assertEqual(os.listdir(directory), ["m.safetensors"])
            self.assertEqual(load(path)[1], {"k": "v"})

    def test_malformed_files_say_what_is_wrong(self):
        cases = {
            b"\x01": "shorter",
            struct.pack("<Q", 1000) + b"{}": "does not fit",
            struct.pack("<Q", 2) + b"[]": "not a JSON object",
            struct.pack("<Q", 3) + b"{x}": "not JSON",
        }
        def file(header: bytes, data: int) -> bytes:
            return struct.pack("<Q", len(header)) + header + b"\x00" * data

        cases[file(b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 8)] = "outside"
        cases[file(b'{"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', 8)] = "needs 12 bytes"
        cases[file(b'{"t":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}}', 16)] = "≥ 0"
        cases[file(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}}', 8)] = "≥ 0"
        cases[file(b'{"t":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}', 8)] = "malformed"
        cases[file(b'{"__metadata__":"x","t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8)] = "object of strings"
        cases[file(b"[" * 100_000 + b"]" * 100_000, 0)] = "not JSON"
        cases[file(b'{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}', 8)] = "cover 4 of the 8"
        # Tensors sharing bytes: a small file must not become a large one in memory.
        shared = ",".join(f'"t{i}":{{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}' for i in range(3))
        cases[file(("{" + shared + "}").encode(), 8)] = "do not follow"
        for raw, expected in cases.items():
            with self.assertRaises(SafeTensorsError) as error:
                loads(raw)
            self.assertIn(expected, str(error.exception), raw)

    @unittest.skipUnless(np is not None, "numpy is not installed")
    def test_numpy_arrays_convert_both_ways(self):
        arrays = {
            "f": np.arange(6, dtype=np.float32).reshape(2, 3),
            "h": np.array([0.5, -1], dtype=np.float16),
            "i": np.array([[1, 2]], dtype=np.int32),
            "u": np.array([255, 0], dtype=np.uint8),
        }
        back, _ = loads(dumps(arrays))
        for name, array in arrays.items():
            np.testing.assert_array_equal(back[name].to_numpy(), array)
            self.assertEqual(back[name].to_numpy().dtype, array.dtype)
        # BF16 reads as float32: the upper halves of the f32 values.
        bf16 = Tensor("BF16", (2,), struct.pack("<2H", 0x3F80, 0xC000))
        np.testing.assert_array_equal(bf16.to_numpy(), np.array([1.0, -2.0], dtype=np.float32))

    @unittest.skipUnless(np is not None and reference is not None, "numpy or safetensors is not installed")
    def test_files_agree_with_the_reference_library(self):
        arrays = {"a": np.arange(12, dtype=np.float64).reshape(3, 4), "b": np.array([True, False])}
        ours = reference.load(dumps(arrays, {"x": "y"}))
        for name, array in arrays.items():
            np.testing.assert_array_equal(ours[name], array)
        theirs, metadata = loads(reference.save(arrays, metadata={"x": "y"}))
        self.assertEqual(metadata, {"x": "y"})
        for name, array in arrays.items():
            np.testing.assert_array_equal(theirs[name].to_numpy(), array)


try:
    import blake3  # noqa: F401

    HAVE_BLAKE3 = True
except ImportError:
    HAVE_BLAKE3 = False

RUST_FINGERPRINT = "blake3:641ae45e78fdc42a6abba875c449e143b509263af1716e2b5fc8f02d9b127412"


class Fingerprint(unittest.TestCase):
    """The model fingerprint trainers check what the parameter server sends against
    (``hypha.model_hash``); the DiLoCo test that mixes Rust and numpy trainers checks it
    agrees with the server's, since a numpy trainer that disagreed would never train."""

    def test_it_covers_every_name_dtype_shape_and_byte_and_not_the_order_given(self):
        from hypha_sdk.safetensors import fingerprint

        w = Tensor("F32", (2,), struct.pack("<2f", 1.0, 2.0))
        b = Tensor("F32", (1,), struct.pack("<f", 0.5))
        for algorithm in ["sha256", "blake3"]:
            if algorithm == "blake3" and not HAVE_BLAKE3:
                continue
            one = fingerprint({"w": w, "b": b}, algorithm)
            self.assertTrue(one.startswith(f"{algorithm}:") and len(one) == len(algorithm) + 65, one)
            self.assertEqual(one, fingerprint({"b": b, "w": w}, algorithm))
            others = [
                {"w": Tensor("F32", (2,), struct.pack("<2f", 1.0, 2.5)), "b": b},
                {"w": Tensor("F32", (2, 1), w.data), "b": b},
                {"v": w, "b": b},
                {"w": w},
                {"w": Tensor("I32", (2,), w.data), "b": b},
            ]
            for other in others:
                self.assertNotEqual(one, fingerprint(other, algorithm), other)

    @unittest.skipUnless(HAVE_BLAKE3, "needs the blake3 package (pip install blake3)")
    def test_it_is_the_parameter_servers(self):
        """The value ``hypha_diloco``'s test ``the_fingerprint_is_blake3_over_names_dtypes_shapes_and_values``
        computes for the same two tensors."""
        from hypha_sdk.safetensors import fingerprint, fingerprint_matches

        w = Tensor("F32", (2,), struct.pack("<2f", 1.0, 2.0))
        b = Tensor("BF16", (1,), struct.pack("<H", 0x3F00))
        self.assertEqual(fingerprint({"w": w, "b": b}), RUST_FINGERPRINT)
        self.assertTrue(fingerprint_matches({"w": w, "b": b}, RUST_FINGERPRINT))
        self.assertFalse(fingerprint_matches({"w": w}, RUST_FINGERPRINT))


if __name__ == "__main__":
    unittest.main()
