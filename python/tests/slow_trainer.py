"""A trainer that takes seconds to load: the numpy example trainer, sleeping
``HYPHA_TEST_LOAD_SECONDS`` (default 10) before its first request, as a PyTorch trainer does
while it imports torch and starts CUDA.

``a_trainer_slow_to_load_trains_the_first_round`` in ``crates/hypha-scheduler/tests/diloco.rs``
runs it beside reference trainers that are ready in a second, and checks that the run's first
round waits for it. Started as the example is (``--socket``, ``--work-dir``, ``--job``), with
``hypha_sdk`` on ``PYTHONPATH``.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import numpy_trainer  # noqa: E402

if __name__ == "__main__":
    time.sleep(float(os.environ.get("HYPHA_TEST_LOAD_SECONDS", "10")))
    sys.exit(numpy_trainer.main())
