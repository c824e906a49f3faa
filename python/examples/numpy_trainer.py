"""A DiLoCo trainer in numpy: the reference executor's MLP classifier, backpropagation by hand.

The model is the one a job's ``[config] model = { type = "mlp", inputs, hidden, classes }``
describes, with the reference executor's parameter names and shapes (``l1``, ``l2``, ``l3``;
``weight`` is ``[out, in]``): Python and Rust trainers can train one job together. The inner
optimiser is AdamW with the job's ``[diloco] inner`` settings, its moments kept across rounds.

A worker runs it as a process executor::

    [[executors]]
    class = "train"
    name = "diloco"
    runtime = "process"
    cmd = "python3"
    args = ["/path/to/numpy_trainer.py", "--socket", "{SOCKET_PATH}",
            "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]

with ``hypha_sdk`` installed (``pip install ./python``) or on ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
from typing import Dict, Mapping, Optional

import numpy as np

from hypha_sdk import diloco, job as hypha_job

DEFAULT_INPUTS = ("inputs", "images", "input_ids", "tokens")


class NumpyMlp:
    """Three linear layers with ReLU between them, cross-entropy loss, AdamW."""

    def __init__(
        self,
        inputs: int,
        hidden: int,
        classes: int,
        seed: int = 0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        input_name: Optional[str] = None,
        target_name: str = "labels",
    ) -> None:
        rng = np.random.default_rng(seed)
        self.params: Dict[str, np.ndarray] = {}
        for name, fan_in, fan_out in (("l1", inputs, hidden), ("l2", hidden, hidden), ("l3", hidden, classes)):
            # Kaiming-normal weights and uniform biases, as the reference executor starts.
            self.params[f"{name}.weight"] = (
                rng.standard_normal((fan_out, fan_in)) * np.sqrt(2.0 / fan_in)
            ).astype(np.float32)
            bound = 1.0 / np.sqrt(fan_in)
            self.params[f"{name}.bias"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
        self.inputs, self.classes = inputs, classes
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.beta1, self.beta2 = beta1, beta2
        self.steps = 0
        self.first = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.second = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.input_name, self.target_name = input_name, target_name

    @classmethod
    def from_config(cls, config: Mapping) -> "NumpyMlp":
        """The model a DiLoCo job's config describes."""
        model = config.get("model") or {}
        if model.get("type") != "mlp":
            raise SystemExit(f"this trainer trains the mlp; the job asks for {model!r}")
        inner = (config.get("diloco") or {}).get("inner") or {}
        return cls(
            inputs=int(model["inputs"]),
            hidden=int(model.get("hidden", 64)),
            classes=int(model["classes"]),
            seed=int(config.get("seed", 0)),
            learning_rate=float(inner.get("learning_rate", 1e-3)),
            weight_decay=float(inner.get("weight_decay", 0.01)),
            beta1=float(inner.get("beta1", 0.9)),
            beta2=float(inner.get("beta2", 0.999)),
            input_name=config.get("input"),
            target_name=config.get("target", "labels"),
        )

    # --- the three methods the DiLoCo loop needs -------------------------------------------

    def parameters(self) -> Dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def load(self, parameters: Mapping[str, np.ndarray]) -> None:
        for name, value in parameters.items():
            if name not in self.params or self.params[name].shape != value.shape:
                raise ValueError(f"the global model's {name} {value.shape} is not this model's")
            self.params[name] = np.array(value, dtype=np.float32)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> float:
        x, labels = self._read(batch)
        loss, grads = self._loss_and_gradients(x, labels)
        self._adamw(grads)
        return loss

    # --- the model -------------------------------------------------------------------------

    def _read(self, batch: Mapping[str, np.ndarray]):
        name = self.input_name or next((n for n in DEFAULT_INPUTS if n in batch), None)
        if name is None or name not in batch:
            raise ValueError(f"the slice has no input tensor (it holds {sorted(batch)})")
        x = batch[name]
        # Bytes are pixel intensities, as the reference executor reads them.
        x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        x = x.reshape(len(x), -1)
        if x.shape[1] != self.inputs:
            raise ValueError(f"{name} has {x.shape[1]} features a sample; the model takes {self.inputs}")
        labels = batch[self.target_name].reshape(-1).astype(np.int64)
        if labels.size and (labels.min() < 0 or labels.max() >= self.classes):
            raise ValueError(f"labels must lie in 0..{self.classes}")
        return x, labels

    def _loss_and_gradients(self, x: np.ndarray, labels: np.ndarray):
        p = self.params
        z1 = x @ p["l1.weight"].T + p["l1.bias"]
        h1 = np.maximum(z1, 0)
        z2 = h1 @ p["l2.weight"].T + p["l2.bias"]
        h2 = np.maximum(z2, 0)
        logits = h2 @ p["l3.weight"].T + p["l3.bias"]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(len(labels))
        loss = float(-log_probs[rows, labels].mean())
        d_logits = np.exp(log_probs)
        d_logits[rows, labels] -= 1
        d_logits /= len(labels)
        grads = {"l3.weight": d_logits.T @ h2, "l3.bias": d_logits.sum(axis=0)}
        d_z2 = (d_logits @ p["l3.weight"]) * (z2 > 0)
        grads["l2.weight"], grads["l2.bias"] = d_z2.T @ h1, d_z2.sum(axis=0)
        d_z1 = (d_z2 @ p["l2.weight"]) * (z1 > 0)
        grads["l1.weight"], grads["l1.bias"] = d_z1.T @ x, d_z1.sum(axis=0)
        return loss, grads

    def _adamw(self, grads: Mapping[str, np.ndarray], eps: float = 1e-8) -> None:
        self.steps += 1
        correction1 = 1 - self.beta1**self.steps
        correction2 = 1 - self.beta2**self.steps
        for name, grad in grads.items():
            m = self.first[name] = self.beta1 * self.first[name] + (1 - self.beta1) * grad
            v = self.second[name] = self.beta2 * self.second[name] + (1 - self.beta2) * grad * grad
            param = self.params[name] * (1 - self.learning_rate * self.weight_decay)
            step = self.learning_rate * (m / correction1) / (np.sqrt(v / correction2) + eps)
            self.params[name] = (param - step).astype(np.float32)


def main(argv=None) -> int:
    job = hypha_job.from_args(argv, description="A DiLoCo trainer in numpy (an MLP classifier)")
    model = NumpyMlp.from_config(job.config)
    rounds = diloco.Trainer(job, model).run()
    print(f"numpy trainer: done after {rounds} rounds", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
