"""A trainer of the run that scales its every pseudo-gradient up a hundredfold: the numpy
example trainer, its updates multiplied by 100 before they are sent (one such update, taken
whole, would move the global model as far as a hundred honest ones). ``HYPHA_TEST_UPDATE_FACTOR``
sets another factor: -1 flips the sign of every update, keeping its norm.

The parameter server clips it to ``max_update_norm_ratio`` times the round's reference norm
rather than refusing it; ``a_trainer_that_scales_its_updates_up_is_clipped_and_the_run_keeps_its_trainers``
and ``a_trainer_that_flips_its_updates_counts_for_nothing_and_the_run_keeps_it`` in
``crates/hypha-scheduler/tests/diloco.rs`` run it beside honest trainers. Started as the
example is (``--socket``, ``--work-dir``, ``--job``), with ``hypha_sdk`` on ``PYTHONPATH``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy_trainer  # noqa: E402
from hypha_sdk import diloco  # noqa: E402

FACTOR = float(os.environ.get("HYPHA_TEST_UPDATE_FACTOR", "100"))

_honest_send = diloco.Trainer._send


def _scaling_send(self, server, name, tensors, metadata):
    if metadata.get(diloco.KIND) == diloco.KIND_PSEUDO_GRADIENT:
        tensors = {key: value * FACTOR for key, value in tensors.items()}
    _honest_send(self, server, name, tensors, metadata)


diloco.Trainer._send = _scaling_send

if __name__ == "__main__":
    sys.exit(numpy_trainer.main())
