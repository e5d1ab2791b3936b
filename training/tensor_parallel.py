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

TP_PLAN_LAYERS: dict[str, str] = {
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
        self.heads, self.head_dim = heads, dim // heads
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
    """A pre-norm transformer block; `tensor_plan` says how its projections split."""

    tensor_plan = TP_PLAN_LAYERS

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hidden = heads, 4 * dim
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Embed(nn.Module):
    """Token embedding plus learned positions: the transformer's first pipeline piece."""

    lookup_only = True  # `training.stages.piece_costs`: lookups and an add, no multiply-adds

    def __init__(self, embed: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.embed, self.pos = embed, pos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.pos[: x.shape[1]]


class Transformer(nn.Module):
    """A small causal transformer over tokens, built to be split: by layers into pipeline
    stages (`pipeline_pieces`) and inside each block over a cluster's GPUs
    (`tensor_parallel`)."""

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

    def pipeline_pieces(self) -> list[nn.Module]:
        """Embedding, each block, the final norm, the head (`training.stages.pieces`)."""
        return [Embed(self.embed, self.pos), *self.blocks, self.norm, self.head]


def splittable(module: nn.Module) -> bool:
    """Whether `module` holds layers that say how they split (a `tensor_plan`)."""
    return any(getattr(m, "tensor_plan", None) for m in module.modules())


def check_split(module: nn.Module, tp: int) -> None:
    """ValueError naming the fix when `module` cannot be split over `tp` GPUs: no layer says
    how it splits, or a block's heads or hidden width do not divide by `tp`."""
    if tp < 1:
        raise ValueError("tensor: give at least 1 GPU")
    if tp > 1 and not splittable(module):
        raise ValueError(
            f"tensor: the model ({type(module).__name__}) has no layer that says how it "
            "splits over GPUs (a `tensor_plan`, as training.tensor_parallel.Block has); use "
            "data or pipeline parallelism, or build the model from such blocks"
        )
    _check_blocks(module, tp)


def _check_blocks(module: nn.Module, tp: int) -> None:
    for m in module.modules():
        if not getattr(m, "tensor_plan", None):
            continue
        for what in ("heads", "hidden"):
            n = getattr(m, what, None)
            if isinstance(n, int) and n % tp:
                raise ValueError(
                    f"tensor: {n} {what} do not split over {tp} GPUs; use a number of GPUs "
                    f"that divides {n}"
                )


def tensor_parallel(module: nn.Module, mesh: Any) -> nn.Module:
    """Split every block of `module` (a model, or a pipeline stage of one) over `mesh` (a 1-D
    `DeviceMesh` of one cluster's ranks) in place, as each block's `tensor_plan` says
    (Megatron's column-then-row pairs); every rank must hold the same weights first (the same
    seed, or the same checkpoint). A module without such blocks (a pipeline stage of only the
    embedding or the head) stays whole on every rank. ValueError when a block's heads or
    hidden width do not divide by the mesh's size."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _check_blocks(module, mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {}
    for name, m in module.named_modules():
        for sub, how in (getattr(m, "tensor_plan", None) or {}).items():
            plan[f"{name}.{sub}" if name else sub] = styles[how]()
    parallelize_module(module, mesh, plan)
    return module


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a split one gathered from its ranks): what a checkpoint or a
    comparison with the unsplit model reads. Every rank of the mesh must call it."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        data = p.detach()
        out[name] = data.full_tensor() if isinstance(data, DTensor) else data.clone()
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a split tensor's shard; a whole tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's `state_dict()` with every split tensor gathered whole: a checkpoint that
    any split (or none) can load. Every rank of the mesh must call it."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    out["state"] = {
        k: {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in s.items()}
        for k, s in sorted(state["state"].items())
    }
    return out


def split_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After `opt.load_state_dict` of whole tensors (`full_optimizer_state`): each state
    tensor of a split parameter split as its parameter is. Every rank of the mesh must call
    it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in opt.state:
                continue
            st = opt.state[p]
            for n, v in list(st.items()):
                whole = isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                if whole and v.shape == p.shape:
                    st[n] = distribute_tensor(v, p.device_mesh, p.placements)
