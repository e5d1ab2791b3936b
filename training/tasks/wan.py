"""Built-in tasks of the WAN-bound regime: a few million parameters, little compute a step.

Synchronous fp32 data parallelism spends far longer putting each step's gradient on a
25-100 Mbit/s link than computing it (`wan_regime` says by how much), so these are the tasks
where the sync mode and the compressor decide the wall time. Offline data only: the stdlib's
own sources for the language model, the cached MNIST-1D for the MLP. Too slow for the test
suite beyond a smoke test; benchmarks use them.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from training.auto import wan_bound_ratio
from training.tasks.base import OptimizerSpec, Task, as_tensors
from training.tasks.builtin import CharTransformer, char_loss
from training.tasks.datasets import mnist1d_split, stdlib_text

GPT_CTX = 64
GPT_VOCAB = 96  # printable ASCII + newline, as the char transformer


class BigramGPT(CharTransformer):
    """A GPT-style causal decoder whose input embedding reads character bigrams (the previous
    and the current character): ~2.4 M embedding parameters that cost a lookup, not compute,
    as a subword vocabulary's would."""

    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int) -> None:
        super().__init__(vocab, ctx, dim=dim, layers=layers, heads=heads)
        self.vocab = vocab
        self.embed = nn.Embedding(vocab * vocab, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        return super().forward(prev * self.vocab + x)


def gpt_stdlib() -> Task:
    """A GPT-style decoder (d=256, 4 layers, 8 heads, ctx 64, bigram input embedding; ~5.5 M
    parameters) predicting the next character of the stdlib's Python sources."""
    text = stdlib_text()
    codes = torch.tensor(
        [min(max(ord(c) - 32, 0), 95) if c != "\n" else 95 for c in text], dtype=torch.long
    )
    n = (len(codes) - 1) // GPT_CTX
    xs = codes[: n * GPT_CTX].reshape(n, GPT_CTX)
    ys = codes[1 : n * GPT_CTX + 1].reshape(n, GPT_CTX)
    cut = int(0.95 * n)

    def model() -> nn.Module:
        return BigramGPT(GPT_VOCAB, GPT_CTX, dim=256, layers=4, heads=8)

    return Task(
        model,
        char_loss,
        (xs[:cut], ys[:cut]),
        (xs[cut:], ys[cut:]),
        OptimizerSpec("adamw", lr=1e-3),
        batch_size=6,
        target_accuracy=0.35,
    )


def wide_mlp() -> Task:
    """A wide MLP (40 -> 2048 -> 2048 -> 10, ~4.3 M parameters) on MNIST-1D."""
    x, y, xt, yt = mnist1d_split()

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Linear(40, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 10),
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x, y),
        (xt, yt),
        OptimizerSpec("sgd", lr=0.05, momentum=0.9),
        batch_size=64,
        target_accuracy=0.6,
    )


def step_compute_s(task: Task, steps: int = 3, threads: int = 1) -> float:
    """Median seconds of one forward/backward of a global batch, on `threads` threads (the
    workers run on one), after one warm-up step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = task.model()
        x, y = as_tensors(task.train)
        xb, yb = x[: task.batch_size], y[: task.batch_size]
        times: list[float] = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=False)
            task.loss(model(xb), yb).backward()
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        return times[len(times) // 2]
    finally:
        torch.set_num_threads(before)


def wan_regime(task: Task, mbps: float, compute_s: float | None = None) -> float:
    """fp32 exchange time / compute time per step of synchronous DP at `mbps`: what every
    benchmark result prints (>= 10: the WAN-bound regime these tasks are for)."""
    params = sum(p.numel() for p in task.model().parameters() if p.requires_grad)
    return wan_bound_ratio(
        params, compute_s if compute_s is not None else step_compute_s(task), mbps
    )
