"""The SDK reads a trainer's ``config["diloco"]`` as the bridge's ``openapi.json`` describes
it (``components.schemas.TrainerConfig``, generated from the Rust type the scheduler writes
and the Rust trainer reads): no key it does not describe, each codec's keys with their
meaning, the same defaults. Runs anywhere numpy is (no bridge needed)."""

import json
import math
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

try:
    import numpy  # noqa: F401
except ImportError:  # pragma: no cover
    numpy = None

from hypha_sdk import codec, diloco  # noqa: E402

OPENAPI = os.path.join(HERE, "..", "..", "crates", "hypha-bridge", "openapi.json")

# A value in range for every codec key the schema may name: a key the schema gains and this
# table lacks fails the test, so that the SDK's reading of it is decided, not forgotten.
EXAMPLES = {"topk_density": 0.1, "sparse_density": 0.02, "sparse_bits": 4, "sparse_decay": 0.5}


class Recording(dict):
    """A dict that remembers which keys were read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def trainer_config_schema():
    with open(OPENAPI, encoding="utf-8") as f:
        return json.load(f)["components"]["schemas"]["TrainerConfig"]


@unittest.skipIf(numpy is None, "needs numpy")
class TrainerConfigSchema(unittest.TestCase):
    def setUp(self):
        self.schema = trainer_config_schema()
        self.codecs = {
            variant["properties"]["compression"]["const"]: variant for variant in self.schema["oneOf"]
        }

    def config(self, name, **keys):
        """A config of codec ``name`` as the schema has it, with ``keys`` set."""
        config = {
            "batch_size": 24,
            "inner": {"learning_rate": 0.001, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999},
            "overlap": False,
            "compression": name,
        }
        config.update(keys)
        for key in self.schema["required"] + self.codecs[name]["required"]:
            self.assertIn(key, config, f"the schema requires {key}")
        return Recording(config)

    def test_every_key_the_sdk_reads_is_described(self):
        described = set(self.schema["properties"])
        for variant in self.codecs.values():
            described |= set(variant["properties"])
        for name, variant in self.codecs.items():
            keys = {k: EXAMPLES[k] for k in variant["properties"] if k != "compression"}
            config = self.config(name, **keys)
            settings = diloco.read_settings(config)
            self.assertEqual(settings.batch_size, 24)
            self.assertLessEqual(config.read, described, f"{name}: read but not described")
            self.assertIn("compression", config.read)

    def test_sparse_keys_mean_what_the_schema_says_and_other_codecs_send_float32(self):
        self.assertIn("sparse", self.codecs)
        for name in self.codecs:
            keys = {k: EXAMPLES[k] for k in self.codecs[name]["properties"] if k != "compression"}
            feedback = diloco.read_settings(self.config(name, **keys)).feedback
            if name != "sparse":
                self.assertIsNone(feedback, f"{name}: the SDK sends float32, which every server reads")
                continue
            self.assertEqual(feedback.format.kept, codec.kept_count(EXAMPLES["sparse_density"], codec.CHUNK))
            self.assertEqual(feedback.format.bits, EXAMPLES["sparse_bits"])
            self.assertEqual(feedback.decay, EXAMPLES["sparse_decay"])
        self.assertTrue(diloco.read_settings(self.config("none", overlap=True)).overlap)

    def test_the_sdk_defaults_are_the_described_ones_and_it_refuses_what_is_out_of_range(self):
        sparse = self.codecs["sparse"]["properties"]
        defaults = diloco.read_settings(self.config("sparse")).feedback
        density = sparse["sparse_density"]["default"]
        self.assertEqual(defaults.format.kept, codec.kept_count(density, codec.CHUNK))
        self.assertEqual(defaults.format.bits, sparse["sparse_bits"]["default"])
        self.assertTrue(math.isclose(defaults.decay, sparse["sparse_decay"]["default"], rel_tol=1e-6))
        for key in ("sparse_density", "sparse_decay"):
            self.assertEqual((sparse[key]["exclusiveMinimum"], sparse[key]["maximum"]), (0, 1))
            for outside in (0.0, 1.5):
                with self.assertRaises(ValueError, msg=f"{key} = {outside}"):
                    diloco.read_settings(self.config("sparse", **{key: outside}))
        self.assertEqual(set(sparse["sparse_bits"]["enum"]) - {None}, {2, 4})
        with self.assertRaises(ValueError):
            diloco.read_settings(self.config("sparse", sparse_bits=3))


if __name__ == "__main__":
    unittest.main()


@unittest.skipIf(numpy is None, "needs numpy")
class FailsClosed(unittest.TestCase):
    def test_the_loop_refuses_to_start_where_it_cannot_check_a_models_fingerprint(self):
        """Without the blake3 package the loop would train on global models it cannot check
        (issue 58): it stops before its first request, saying what to install."""

        class Job:
            bridge = None
            config = {"diloco": {"batch_size": 4}, "data": {}}

        class Model:
            def parameters(self):
                return {"w": numpy.zeros(2, dtype=numpy.float32)}

        from hypha_sdk import safetensors

        saved = safetensors._blake3
        safetensors._blake3 = lambda: None
        try:
            with self.assertRaisesRegex(RuntimeError, "pip install blake3"):
                diloco.Trainer(Job(), Model())
        finally:
            safetensors._blake3 = saved
        if safetensors.can_fingerprint():
            diloco.Trainer(Job(), Model())
