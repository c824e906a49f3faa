"""A trainer of the run that lies about its work: the numpy example trainer, whose
pseudo-gradients claim a trillion samples each (an update's weight in the mean is its samples,
so a believed claim would outweigh every honest update).

The parameter server refuses them; ``a_trainer_whose_updates_are_refused_holds_up_no_round``
in ``crates/hypha-scheduler/tests/diloco.rs`` runs it beside honest trainers and checks that
the run goes on without it. Started as the example is (``--socket``, ``--work-dir``,
``--job``), with ``hypha_sdk`` on ``PYTHONPATH``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy_trainer  # noqa: E402
from hypha_sdk import diloco  # noqa: E402

CLAIMED_SAMPLES = 10**12

_honest_send = diloco.Trainer._send


def _lying_send(self, server, name, tensors, metadata):
    if metadata.get(diloco.KIND) == diloco.KIND_PSEUDO_GRADIENT:
        metadata = dict(metadata, **{diloco.SAMPLES: str(CLAIMED_SAMPLES)})
    _honest_send(self, server, name, tensors, metadata)


diloco.Trainer._send = _lying_send

if __name__ == "__main__":
    sys.exit(numpy_trainer.main())
