"""A DiLoCo trainer in PyTorch: the reference executor's decoder-only transformer as an
``nn.Module``.

The job's ``[config] model`` is ``{type = "transformer", vocab, context, dim, heads,
layers}``, as for the reference executor, and the module has its parameter names and shapes
(``tokens.weight`` ``[vocab, dim]``, ``positions.weight`` ``[context, dim]``, per block
``block{i}.norm1``, ``query``, ``key``, ``value``, ``out``, ``norm2``, ``up`` ``[4·dim, dim]``,
``down``, then ``norm`` and ``head`` ``[vocab, dim]``) and its arithmetic: pre-norm blocks
(layer norm, ε 1e-5), causal self-attention whose padding keys score −1e9, GELU (tanh
approximation), learned positions, and the mean cross-entropy of every real next token. So
PyTorch trainers on GPUs and Rust trainers on CPUs train one job together.

GPT-2-small's shape with byte-level tokens (``hypha-data prepare``'s default, vocab 258) is
``{type = "transformer", vocab = 258, context = 1024, dim = 768, heads = 12, layers = 12}``:
86.2 M parameters (no tied embeddings; with GPT-2's BPE vocabulary of 50 257 it would be 162 M).

Run it as a process executor like ``torch_trainer.py``::

    args = ["/path/to/torch_lm_trainer.py", "--socket", "{SOCKET_PATH}",
            "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]

``--device`` picks the device (CUDA where there is one); ``--bf16`` computes in bfloat16 under
autocast on CUDA (the parameters, the optimiser and every update stay float32).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Mapping, Optional

import numpy as np
import torch
from torch import nn

from hypha_sdk import diloco, job as hypha_job
from torch_trainer import TorchModel, adamw, input_of

ATTENTION_MASK = "attention_mask"
# What a padding key adds to an attention score: the reference executor's PADDING_SCORE.
PADDING_SCORE = -1e9


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, length, dim = x.shape
        size = dim // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(rows, length, self.heads, size).transpose(1, 2)

        mixed = nn.functional.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), attn_mask=mask
        )
        return self.out(mixed.transpose(1, 2).reshape(rows, length, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.norm1(x), mask)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        if heads < 1 or dim % heads != 0 or vocab < 2 or context < 1:
            raise SystemExit(
                f"a transformer needs vocab ≥ 2, context ≥ 1 and dim ({dim}) divisible by heads ({heads})"
            )
        self.context = context
        self.layers = layers
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        for i in range(layers):
            # block{i}, as the reference executor names them (not an nn.ModuleList's blocks.{i}).
            self.add_module(f"block{i}", Block(dim, heads))
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab)

    def forward(self, inputs: torch.Tensor, real: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits ``[rows, length, vocab]``; ``real`` (``[rows, length]``, 1 real, 0 padding)
        keeps padding from being attended to."""
        rows, length = inputs.shape
        positions = torch.arange(length, device=inputs.device)
        x = self.tokens(inputs) + self.positions(positions)
        causal = torch.full((length, length), float("-inf"), device=inputs.device).triu(1)
        mask = causal.view(1, 1, length, length)
        if real is not None:
            mask = mask + ((1.0 - real) * PADDING_SCORE).view(rows, 1, 1, length)
        for i in range(self.layers):
            x = getattr(self, f"block{i}")(x, mask)
        return self.head(self.norm(x))


def next_token_loss(module: Transformer, ids: torch.Tensor, real: Optional[torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of each real next token of ``ids`` ``[rows, width]``."""
    logits = module(ids[:, :-1], None if real is None else real[:, :-1])
    targets = ids[:, 1:].reshape(-1)
    losses = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="none")
    if real is None:
        return losses.mean()
    weights = real[:, 1:].reshape(-1)
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


class LanguageModel(TorchModel):
    """The transformer and its AdamW, counting the tokens it trains on."""

    def __init__(self, config: Mapping, device: str, bf16: bool) -> None:
        spec = config.get("model") or {}
        if spec.get("type") != "transformer":
            raise SystemExit(f"this trainer trains the transformer; the job asks for {spec!r}")
        torch.manual_seed(int(config.get("seed", 0)))
        sizes = {key: int(spec[key]) for key in ("vocab", "context", "dim", "heads", "layers")}
        module = Transformer(**sizes).to(device)
        self.vocab, self.context = sizes["vocab"], sizes["context"]
        self.device, self.input_name = device, config.get("input")
        self.autocast = bf16 and device.startswith("cuda")
        self.tokens = 0
        super().__init__(module, adamw(module, config), self._loss)

    def _loss(self, batch: Mapping[str, np.ndarray]) -> torch.Tensor:
        ids = input_of(batch, self.input_name)
        if ids.ndim != 2 or ids.shape[1] < 2 or ids.shape[1] - 1 > self.context:
            raise ValueError(
                f"token ids of shape {list(ids.shape)}: the model reads [rows, L] with 2 ≤ L ≤ "
                f"context + 1 = {self.context + 1}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(
                f"token id {int(ids.max())} is outside the model's vocabulary of {self.vocab}"
            )
        mask = batch.get(ATTENTION_MASK)
        real = None if mask is None else torch.from_numpy(mask.astype(np.float32)).to(self.device)
        self.tokens += int(mask[:, 1:].sum()) if mask is not None else ids.shape[0] * (ids.shape[1] - 1)
        ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return next_token_loss(self.module, ids, real)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="A DiLoCo trainer in PyTorch (the reference decoder-only transformer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 under autocast (CUDA only)")
    job = hypha_job.from_args(argv, parser=parser)
    device = job.args.device
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    model = LanguageModel(job.config, device, job.args.bf16)
    count = sum(p.numel() for p in model.module.parameters())
    print(f"torch transformer of {count / 1e6:.1f} M parameters on {device}", file=sys.stderr, flush=True)
    started = time.monotonic()
    rounds = diloco.Trainer(job, model).run()
    elapsed = time.monotonic() - started
    print(
        f"torch trainer on {device}: done after {rounds} rounds, {model.tokens} tokens trained "
        f"({model.tokens / max(elapsed, 1e-9):.0f} tokens/s over {elapsed:.0f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
