"""The built-in tasks: small models on data that ships or is generated (no downloads)."""

from __future__ import annotations

import torch
from torch import nn

from training.tasks.base import OptimizerSpec, Task
from training.tasks.datasets import mnist1d_split, stdlib_text


def mnist1d_mlp() -> Task:
    x, y, xt, yt = mnist1d_split()

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Linear(40, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x, y),
        (xt, yt),
        OptimizerSpec("sgd", lr=0.1, momentum=0.9),
        batch_size=128,
        target_accuracy=0.6,
    )


class _Unsqueeze(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)


def mnist1d_cnn() -> Task:
    x, y, xt, yt = mnist1d_split()

    def model() -> nn.Module:
        return nn.Sequential(
            _Unsqueeze(),
            nn.Conv1d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 10, 10),
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x, y),
        (xt, yt),
        OptimizerSpec("sgd", lr=0.05, momentum=0.9),
        batch_size=128,
        target_accuracy=0.8,
    )


def digits_cnn() -> Task:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    cut = int(0.8 * len(x))
    tr, te = perm[:cut], perm[cut:]

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 10),
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x[tr], y[tr]),
        (x[te], y[te]),
        OptimizerSpec("sgd", lr=0.1, momentum=0.9),
        batch_size=64,
        target_accuracy=0.9,
    )


class CharTransformer(nn.Module):
    """A tiny causal transformer over characters."""

    mask: torch.Tensor

    def __init__(self, vocab: int, ctx: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(h)


def char_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def char_transformer(ctx: int = 32) -> Task:
    text = stdlib_text()
    codes = torch.tensor(
        [min(max(ord(c) - 32, 0), 95) if c != "\n" else 95 for c in text], dtype=torch.long
    )  # printable ASCII + newline, 96 symbols
    n = (len(codes) - 1) // ctx
    xs = codes[: n * ctx].reshape(n, ctx)
    ys = codes[1 : n * ctx + 1].reshape(n, ctx)
    cut = int(0.9 * n)

    def model() -> nn.Module:
        return CharTransformer(96, ctx)

    return Task(
        model,
        char_loss,
        (xs[:cut], ys[:cut]),
        (xs[cut:], ys[cut:]),
        OptimizerSpec("adam", lr=3e-3),
        batch_size=64,
        target_accuracy=0.4,
    )


def char_gpt(ctx: int = 32) -> Task:
    """The char transformer's data and size, its model written for every split: by layers
    into pipeline stages and by attention heads and MLP columns over a cluster's GPUs
    (`training.tensor_parallel.Transformer`, 4 heads: tensor parallel over 1, 2 or 4)."""
    from training.tensor_parallel import Transformer

    task = char_transformer(ctx)

    def model() -> nn.Module:
        return Transformer(96, ctx, dim=64, layers=2, heads=4)

    task.model = model
    return task
