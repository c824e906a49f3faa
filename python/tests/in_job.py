"""Runs the SDK's tests inside a Hypha job, where the job bridge exists.

A worker starts it as a process executor::

    python3 tests/in_job.py --socket {SOCKET_PATH} --work-dir {WORK_DIR} --job {JOB_JSON}

with ``SDK_TEST_DIR`` (a directory the task's jobs share, holding ``peer-for-$NAME``: the
peer id of the other job's worker) and ``SDK_TEST_NAME`` (this job's name) in its
environment. Every ``test_*.py`` beside it runs; the outcome goes to ``results.json`` in the
job's directory and the exit code (0: all passed), so that the job, and the Rust test that
ran it, fails when a test does. Outside a job, the tests that need a bridge are skipped.
"""

import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import in_job_context  # noqa: E402
from hypha_sdk import job as hypha_job  # noqa: E402


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = []

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test.id())


def main() -> int:
    job = hypha_job.from_args(sys.argv[1:], description="The hypha_sdk tests, inside a job")
    in_job_context.enter(job)
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Recorder)
    result = runner.run(suite)
    outcome = {
        "passed": result.passed,
        "failed": [t.id() + ": " + trace for t, trace in result.failures + result.errors],
        "skipped": [t.id() + ": " + why for t, why in result.skipped],
    }
    with open(job.path("results.json"), "w", encoding="utf-8") as file:
        json.dump(outcome, file, indent=1)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
