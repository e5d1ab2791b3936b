"""Tensor parallelism inside one cluster: each layer's matrices split over the cluster's GPUs.

Megatron's split, done by PyTorch's own tensor-parallel API (`torch.distributed.tensor.
parallel`, DTensor) rather than by hand: in each transformer block the query, key, value and
first MLP projections are split by output features (`ColwiseParallel`: every rank computes
its own heads and its own slice of the hidden layer, no communication) and the attention's
output and second MLP projections by input features (`RowwiseParallel`: the partial products
are all-reduced), so a block costs two all-reduces forward and two backward. Embeddings, norms
and the head stay replicated. The same code runs on gloo (CPU) and NCCL (GPUs): the device
mesh is of the ranks' device type.

Never across the WAN: a block's all-reduces sit on the critical path of every micro-step, so
the ranks of one mesh are the GPUs of one cluster. The model is written for the split: its
attention counts heads from the width it is given (`head_dim` fixed), so after the split
each rank runs `heads / tp` of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

TP_PLAN_LAYERS = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.fc1": "colwise",
    "mlp.fc2": "rowwise",
}
"""Each block's projections and how they split (Megatron: column then row, so a pair needs
one all-reduce)."""


class Attention(nn.Module):
    """Causal self-attention whose head count is its width over `head_dim`: split by heads,
    each rank runs its own."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads: {heads} does not divide the width {dim}")
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (
            proj(h).reshape(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(h)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Transformer(nn.Module):
    """A small causal transformer over tokens, built to be split (`tensor_parallel`)."""

    def __init__(
        self, vocab: int, ctx: int, dim: int = 64, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) / math.sqrt(dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def tensor_parallel(model: Transformer, mesh: Any) -> Transformer:
    """Split `model`'s blocks over `mesh` (a 1-D `DeviceMesh` of one cluster's ranks) in
    place, Megatron's way (`TP_PLAN_LAYERS`); every rank must hold the same model first (the
    same seed, or the same checkpoint). ValueError when the heads or the hidden width do not
    split evenly."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    if model.heads % tp:
        raise ValueError(
            f"tensor parallel: {model.heads} heads do not split over {tp} GPUs; use a "
            "number of GPUs that divides the heads"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {
        f"blocks.{i}.{name}": styles[how]()
        for i in range(len(model.blocks))
        for name, how in TP_PLAN_LAYERS.items()
    }
    parallelize_module(model, mesh, plan)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a split one gathered from its ranks): what a checkpoint or a
    comparison with the unsplit model reads. Every rank of the mesh must call it."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        data = p.detach()
        out[name] = data.full_tensor() if isinstance(data, DTensor) else data.clone()
    return out
