"""A trainer of the run that floods its scheduler with statuses: the numpy example trainer,
which before each of its reports sends ``FLOOD`` statuses of its own whose fingerprint is
64 KiB long and ``FLOOD`` other JSON documents of 64 KiB (issue 58, item 3: a scheduler that
wrote every status down would fill its disk).

``a_trainer_that_floods_its_scheduler_with_statuses_fills_no_disk`` in
``crates/hypha-scheduler/tests/diloco.rs`` runs it beside honest trainers and checks that the
run trains and its metrics and events files stay small. Started as the example is
(``--socket``, ``--work-dir``, ``--job``), with ``hypha_sdk`` on ``PYTHONPATH``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy_trainer  # noqa: E402
from hypha_sdk import diloco  # noqa: E402

FLOOD = 20
PADDING = "x" * 65536

_honest_report = diloco.Trainer._report


def _flooding_report(self):
    for _ in range(FLOOD):
        self.bridge.status({"diloco": "trainer", "round": self.round, "model_hash": PADDING})
        self.bridge.status({"junk": PADDING})
    return _honest_report(self)


diloco.Trainer._report = _flooding_report

if __name__ == "__main__":
    sys.exit(numpy_trainer.main())
