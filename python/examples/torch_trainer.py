"""A DiLoCo trainer in PyTorch: the reference executor's MLP classifier as an ``nn.Module``.

``nn.Linear`` layers named ``l1``, ``l2``, ``l3`` give the parameter names and shapes the
reference executor uses (``l1.weight`` is ``[hidden, inputs]``), so this trainer can share a
job with Rust and numpy trainers. The inner optimiser is ``torch.optim.AdamW`` with the job's
``[diloco] inner`` settings, kept across rounds; the model trains on the GPU when there is
one (``--device``). Run it as a process executor like ``numpy_trainer.py``::

    args = ["/path/to/torch_trainer.py", "--socket", "{SOCKET_PATH}",
            "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]

Any other ``nn.Module`` works the same way: what the DiLoCo loop needs is ``parameters()``
and ``load()`` as numpy arrays by name, and ``train_step(batch)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, Mapping, Optional

import numpy as np
import torch
from torch import nn

from hypha_sdk import diloco, job as hypha_job

DEFAULT_INPUTS = ("inputs", "images", "input_ids", "tokens")


class Mlp(nn.Module):
    def __init__(self, inputs: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(inputs, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def adamw(module: nn.Module, config: Mapping) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with the job's ``[diloco] inner`` settings (the reference
    executor's defaults where the job sets none)."""
    inner = (config.get("diloco") or {}).get("inner") or {}
    return torch.optim.AdamW(
        module.parameters(),
        lr=float(inner.get("learning_rate", 1e-3)),
        betas=(float(inner.get("beta1", 0.9)), float(inner.get("beta2", 0.999))),
        weight_decay=float(inner.get("weight_decay", 0.01)),
    )


class TorchModel:
    """An ``nn.Module`` and its optimiser, as the DiLoCo loop drives them: ``loss(batch)``
    is the module's loss on a batch of the slice's numpy arrays."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[[Mapping[str, np.ndarray]], torch.Tensor]) -> None:
        self.module, self.optimizer, self.loss = module, optimizer, loss

    def parameters(self) -> Dict[str, np.ndarray]:
        return {name: value.detach().cpu().numpy().astype(np.float32) for name, value in self.module.state_dict().items()}

    def load(self, parameters: Mapping[str, np.ndarray]) -> None:
        state = {name: torch.from_numpy(np.asarray(value, dtype=np.float32)) for name, value in parameters.items()}
        self.module.load_state_dict(state)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> float:
        self.optimizer.zero_grad()
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def input_of(batch: Mapping[str, np.ndarray], name: Optional[str]) -> np.ndarray:
    """The slice's input tensor: ``[config] input``, else the reference executor's default."""
    name = name or next((n for n in DEFAULT_INPUTS if n in batch), None)
    if name is None or name not in batch:
        raise ValueError(f"the slice has no input tensor (it holds {sorted(batch)})")
    return batch[name]


def mlp_model(config: Mapping, device: str) -> TorchModel:
    """The job's ``mlp`` as a :class:`TorchModel` on ``device``."""
    model = config.get("model") or {}
    if model.get("type") != "mlp":
        raise SystemExit(f"this trainer trains the mlp; the job asks for {model!r}")
    torch.manual_seed(int(config.get("seed", 0)))
    module = Mlp(int(model["inputs"]), int(model.get("hidden", 64)), int(model["classes"])).to(device)
    input_name, target_name = config.get("input"), config.get("target", "labels")

    def loss(batch: Mapping[str, np.ndarray]) -> torch.Tensor:
        x = input_of(batch, input_name)
        x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        inputs = torch.from_numpy(x.reshape(len(x), -1)).to(device)
        labels = torch.from_numpy(batch[target_name].reshape(-1).astype(np.int64)).to(device)
        return nn.functional.cross_entropy(module(inputs), labels)

    return TorchModel(module, adamw(module, config), loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="A DiLoCo trainer in PyTorch (an MLP classifier)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    job = hypha_job.from_args(argv, parser=parser)
    device = job.args.device
    model = mlp_model(job.config, device)
    rounds = diloco.Trainer(job, model).run()
    print(f"torch trainer on {device}: done after {rounds} rounds", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
