"""What the tests that need a real bridge know when they run inside a job (see in_job.py)."""

import os
import time
import unittest
from typing import Optional

from hypha_sdk.job import Job

job: Optional[Job] = None
me = ""
peer = ""
shared = ""


def enter(current: Job) -> None:
    global job, me, peer, shared
    job = current
    shared = os.environ["SDK_TEST_DIR"]
    me = os.environ["SDK_TEST_NAME"]
    with open(os.path.join(shared, f"peer-for-{me}"), encoding="utf-8") as file:
        peer = file.read().strip()


def needs_job(cls):
    """Skips the class outside a job."""
    return unittest.skipUnless(job is not None, "needs a job bridge: run through in_job.py")(cls)


def barrier(step: str, limit: float = 60.0) -> None:
    """Waits until every other job of the test reached ``step`` too."""
    open(os.path.join(shared, f"barrier-{step}-{me}"), "w").close()
    others = [
        name[len("peer-for-") :]
        for name in os.listdir(shared)
        if name.startswith("peer-for-") and name != f"peer-for-{me}"
    ]
    deadline = time.monotonic() + limit
    for other in others:
        while not os.path.exists(os.path.join(shared, f"barrier-{step}-{other}")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{other} never reached {step}")
            time.sleep(0.05)
