"""How a task's model splits into pipeline stages: an ordered list of pieces.

A model is split between layers, never inside one: `pieces(model)` returns modules that,
applied in order, compute exactly what the model's forward does, and that share the model's
parameters (so a pipeline built from them starts from the very weights a single process
would). A stage is a contiguous run of pieces (`group`).

The task interface: a model that is an `nn.Sequential` splits into its children; any other
model defines `pipeline_pieces() -> list[nn.Module]`. The built-in char transformer does
(embedding, one piece per block, head); the built-in MLP and CNNs are sequential.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.tasks import CharTransformer


class _CharEmbed(nn.Module):
    """Token embedding plus learned positions: the char transformer's first piece."""

    lookup_only = True  # `piece_costs`: table lookups and an add, no multiply-adds

    def __init__(self, embed: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.embed = embed
        self.pos = pos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.pos[: x.shape[1]]


class _CausalBlock(nn.Module):
    """One encoder layer under the causal mask, as `nn.TransformerEncoder` calls it."""

    mask: torch.Tensor

    def __init__(self, layer: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        out: torch.Tensor = self.layer(h, src_mask=self.mask[:t, :t], is_causal=True)
        return out


def char_transformer_pieces(model: CharTransformer) -> list[nn.Module]:
    """Embedding, each block, (the final norm,) the head."""
    out: list[nn.Module] = [_CharEmbed(model.embed, model.pos)]
    out += [_CausalBlock(layer, model.mask) for layer in model.blocks.layers]
    if model.blocks.norm is not None:
        out.append(model.blocks.norm)
    out.append(model.head)
    return out


def pieces(model: nn.Module) -> list[nn.Module]:
    """The ordered pieces of `model` (ValueError says how to make a model splittable)."""
    if isinstance(model, CharTransformer):
        return char_transformer_pieces(model)
    custom = getattr(model, "pipeline_pieces", None)
    if callable(custom):
        found = list(custom())
        if not found or not all(isinstance(p, nn.Module) for p in found):
            raise ValueError("task: pipeline_pieces() must return a non-empty list of modules")
        return found
    if isinstance(model, nn.Sequential):
        return list(model.children())
    raise ValueError(
        f"task: the model ({type(model).__name__}) cannot be split into pipeline stages; "
        "make it an nn.Sequential or give it a pipeline_pieces() method returning its "
        "layers in order"
    )


def piece_costs(parts: Sequence[nn.Module]) -> list[float]:
    """A deterministic compute proxy per piece: its multiply-add weights (embeddings and
    learned positions are lookups, so they cost nothing), at least 1 so no piece is free.
    Every stage computes the same split from it without timing anything."""
    costs = []
    for p in parts:
        n = 0
        for m in p.modules():
            if isinstance(m, nn.Embedding) or getattr(m, "lookup_only", False):
                continue
            n += sum(w.numel() for w in m.parameters(recurse=False) if w.dim() >= 2)
        costs.append(float(max(n, 1)))
    return costs


def group(parts: Sequence[nn.Module], cuts: Sequence[int]) -> list[nn.Sequential]:
    """Stages from pieces: stage i holds pieces [cuts[i-1], cuts[i]) (0 and len at the ends)."""
    bounds = [0, *cuts, len(parts)]
    return [nn.Sequential(*parts[a:b]) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class PieceProfile:
    """What the planner needs of one piece, per sample (plain numbers: the scheduler reads
    them without importing torch)."""

    params: int
    flops: float
    """Forward FLOPs of one sample, as torch's FLOP counter counts them."""
    activation_bytes: int
    """Its output: what crosses a stage boundary after it."""
    stored_bytes: int
    """Tensors autograd keeps for its backward (parameters not counted)."""


def _forward_flops(part: nn.Module, inp: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`part(inp)` and its multiply-add FLOPs (2 a weight an output position of every linear
    layer, convolution and attention projection, plus attention's scores and mixing).
    Forward hooks, not torch's FLOP counter: that one costs seconds on first use."""
    flops = 0.0

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        nonlocal flops
        if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d):
            rows = out.numel() / (m.out_features if isinstance(m, nn.Linear) else m.out_channels)
            flops += 2.0 * m.weight.numel() * rows
        elif isinstance(m, nn.MultiheadAttention):
            q = args[0]  # (batch, seq, dim) with batch_first; its projections are not called
            tokens, dim = q.numel() / q.shape[-1], q.shape[-1]
            proj = 4 * dim * dim if m.in_proj_weight is None else m.in_proj_weight.numel()
            flops += 2.0 * (proj + m.out_proj.weight.numel()) * tokens
            flops += 4.0 * tokens * q.shape[-2] * dim  # scores and their weighted sum

    handles = [m.register_forward_hook(hook) for m in part.modules()]
    try:
        out = part(inp)
    finally:
        for h in handles:
            h.remove()
    return out, flops


def profile_pieces(parts: Sequence[nn.Module], sample: torch.Tensor) -> list[PieceProfile]:
    """Run one sample (a batch of one) through `parts`, measuring each piece."""
    out: list[PieceProfile] = []
    h = sample
    for part in parts:
        weights = {q.data_ptr() for q in part.parameters()}
        kept = 0

        def pack(t: torch.Tensor, weights: set[int] = weights) -> torch.Tensor:
            nonlocal kept
            if t.data_ptr() not in weights:
                kept += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inp = h.detach().requires_grad_() if h.is_floating_point() else h
            h, flops = _forward_flops(part, inp)
        out.append(
            PieceProfile(
                params=sum(q.numel() for q in part.parameters()),
                flops=flops,
                activation_bytes=h.numel() * h.element_size(),
                stored_bytes=kept,
            )
        )
    return out
