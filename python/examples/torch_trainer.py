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
from typing import Dict, Mapping

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


class TorchModel:
    """An ``nn.Module`` classifier and its optimiser, as the DiLoCo loop drives them."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, device: str, input_name=None, target_name="labels") -> None:
        self.module, self.optimizer, self.device = module.to(device), optimizer, device
        self.input_name, self.target_name = input_name, target_name

    @classmethod
    def from_config(cls, config: Mapping, device: str) -> "TorchModel":
        model = config.get("model") or {}
        if model.get("type") != "mlp":
            raise SystemExit(f"this trainer trains the mlp; the job asks for {model!r}")
        torch.manual_seed(int(config.get("seed", 0)))
        module = Mlp(int(model["inputs"]), int(model.get("hidden", 64)), int(model["classes"])).to(device)
        inner = (config.get("diloco") or {}).get("inner") or {}
        optimizer = torch.optim.AdamW(
            module.parameters(),
            lr=float(inner.get("learning_rate", 1e-3)),
            betas=(float(inner.get("beta1", 0.9)), float(inner.get("beta2", 0.999))),
            weight_decay=float(inner.get("weight_decay", 0.01)),
        )
        return cls(module, optimizer, device, config.get("input"), config.get("target", "labels"))

    def parameters(self) -> Dict[str, np.ndarray]:
        return {name: value.detach().cpu().numpy().astype(np.float32) for name, value in self.module.state_dict().items()}

    def load(self, parameters: Mapping[str, np.ndarray]) -> None:
        state = {name: torch.from_numpy(np.asarray(value, dtype=np.float32)) for name, value in parameters.items()}
        self.module.load_state_dict(state)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> float:
        name = self.input_name or next((n for n in DEFAULT_INPUTS if n in batch), None)
        if name is None or name not in batch:
            raise ValueError(f"the slice has no input tensor (it holds {sorted(batch)})")
        x = batch[name]
        x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        inputs = torch.from_numpy(x.reshape(len(x), -1)).to(self.device)
        labels = torch.from_numpy(batch[self.target_name].reshape(-1).astype(np.int64)).to(self.device)
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.module(inputs), labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="A DiLoCo trainer in PyTorch (an MLP classifier)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    job = hypha_job.from_args(argv, parser=parser)
    device = job.args.device
    model = TorchModel.from_config(job.config, device)
    rounds = diloco.Trainer(job, model).run()
    print(f"torch trainer on {device}: done after {rounds} rounds", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
