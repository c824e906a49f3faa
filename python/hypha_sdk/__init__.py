"""Write Hypha executors in Python.

- :mod:`hypha_sdk.client`: the job bridge (fetch, send, receive, data consumed, status),
  standard library only.
- :mod:`hypha_sdk.job`: the job a worker started this process for (``--socket``,
  ``--work-dir``, ``--job``).
- :mod:`hypha_sdk.safetensors`: SafeTensors files, standard library only, with numpy and torch
  adapters.
- :mod:`hypha_sdk.diloco`: the DiLoCo trainer protocol as a loop you give a model (numpy).
"""

from .client import Bridge, BridgeError, FileEntry, ReceivedFile, artifact, huggingface, peers, uri
from .job import Job, from_args

__all__ = [
    "Bridge",
    "BridgeError",
    "FileEntry",
    "ReceivedFile",
    "Job",
    "from_args",
    "artifact",
    "huggingface",
    "peers",
    "uri",
]

__version__ = "0.1.0"
