"""The job an executor runs, as its worker starts it.

A worker starts a process executor with the arguments its config gives, where
``{SOCKET_PATH}``, ``{WORK_DIR}`` and ``{JOB_JSON}`` are replaced by the job's bridge socket,
its directory and its description. :func:`from_args` reads the conventional
``--socket S --work-dir D --job JSON`` (also ``--job`` left out: ``job.json`` in the work
directory is read).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from .client import Bridge

__all__ = ["Job", "from_args"]


@dataclass
class Job:
    """A job: its id, task, executor, the job file's ``[config]``, and its bridge.

    A DiLoCo job's ``config`` holds the job file's ``[config]`` (``model``, ``seed``, …), its
    ``diloco`` settings (``batch_size``, ``inner`` = the inner optimiser's ``learning_rate``,
    ``weight_decay``, ``beta1``, ``beta2``) and ``data``, the reference its slices come from.
    """

    id: str
    task: str
    lease: int
    executor_class: str
    executor_name: str
    config: Dict[str, Any]
    work_dir: str
    bridge: Bridge
    secrets_file: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict)
    # The command line as parsed by from_args (with the caller's own options).
    args: Optional[argparse.Namespace] = None

    @classmethod
    def from_json(cls, description: Dict[str, Any], socket_path: str, work_dir: str) -> "Job":
        """The job ``description`` (``{JOB_JSON}``) whose bridge is at ``socket_path``."""
        executor = description.get("executor") or {}
        config = description.get("config")
        if config is None:
            config = executor.get("config", {})
        return cls(
            id=description.get("id") or description.get("job_id", ""),
            task=description.get("task", ""),
            lease=int(description.get("lease", 0)),
            executor_class=executor.get("class", ""),
            executor_name=executor.get("name", ""),
            config=config if isinstance(config, dict) else {"value": config},
            work_dir=work_dir,
            bridge=Bridge(socket_path),
            secrets_file=description.get("secrets_file"),
            raw=description,
        )

    def path(self, relative: str) -> str:
        """``relative`` (as the bridge names files) under the job's directory."""
        return os.path.join(self.work_dir, relative)

    def secrets(self) -> Dict[str, str]:
        """The job's secrets (``secrets.json``, readable by the job's user alone), if any."""
        if not self.secrets_file:
            return {}
        with open(self.path(self.secrets_file), encoding="utf-8") as file:
            return json.load(file)


def from_args(
    argv: Optional[Sequence[str]] = None,
    description: str = "A Hypha executor",
    parser: Optional[argparse.ArgumentParser] = None,
) -> Job:
    """The job named by ``--socket``, ``--work-dir`` and ``--job`` on the command line.

    Give your own ``parser`` to take more options (a worker's ``args`` may add them): they
    are parsed with the three, and the result is the job's ``args``.
    """
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--socket", required=True, help="the job bridge's socket ({SOCKET_PATH})")
    parser.add_argument("--work-dir", required=True, help="the job's directory ({WORK_DIR})")
    parser.add_argument(
        "--job",
        help="the job's description as JSON ({JOB_JSON}); default: job.json in the work directory",
    )
    args = parser.parse_args(argv)
    if args.job is not None:
        try:
            description = json.loads(args.job)
        except ValueError as error:
            parser.error(f"--job is not JSON: {error}")
    else:
        with open(os.path.join(args.work_dir, "job.json"), encoding="utf-8") as file:
            description = json.load(file)
    job = Job.from_json(description, args.socket, args.work_dir)
    job.args = args
    return job
