"""Top-k sparsification with the Deep Gradient Compression refinements (Lin et al., ICLR 2018).

- Local gradient accumulation (error feedback): coordinates not sent keep accumulating in `v`
  and go out once they are large enough, so nothing is lost, only delayed.
- Momentum correction: with momentum m > 0 (spec `:m<m>`, default 0.9, `:m0` turns it off)
  the compressor keeps the momentum buffer itself (per leader, on its cluster-averaged
  gradient), u <- m u + g, and accumulates u (not g) into v; the runtime must then step its
  optimizer WITHOUT momentum for these parameters (`momentum_correction` is True). Plain
  momentum on the sparse update would apply momentum to a delayed, sparse signal.
- Momentum factor masking: u and v are zeroed where a coordinate was sent (v keeps the
  rounding error when values go out as fp16/bf16), so stale momentum does not keep pushing a
  coordinate whose update has already been applied.
- Density warm-up: the first rounds send more (25%, 6.25%, 1.5625%, ... each stage 4x
  sparser, as DGC's 75% -> 93.75% -> 98.4375% sparsity ramp) until the target density, so
  early, fast-changing gradients are not starved. `warmup_rounds` rounds are split evenly
  over the stages above the target; 0 (the default) starts at the target at once, because
  warm-up rounds are dense and cost WAN bytes.

Gradient clipping, the last DGC refinement, is the optimizer's business and is left to the
runtime (clip the local gradient before `compress`).

The invariant that holds exactly (up to float rounding): sum of what was sent plus the final
`v` equals the sum of the accumulated terms, i.e. the gradients when m == 0, and the
momentum-corrected velocities u_t when m > 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from training.compression.base import Compressor, Packet
from training.compression.feedback import as_float32, check_shape, clone_tensors

WARMUP_START_DENSITY = 0.25
WARMUP_FACTOR = 0.25


def warmup_stages(target: float) -> list[float]:
    """Densities above `target` that DGC's exponential ramp passes through."""
    stages: list[float] = []
    density = WARMUP_START_DENSITY
    while density > target and len(stages) < 64:
        stages.append(density)
        density *= WARMUP_FACTOR
    return stages


def dgc_density(round_index: int, target: float, warmup_rounds: int) -> float:
    """Density for exchange round `round_index` (0-based) under DGC's warm-up.

    The `warmup_rounds` first rounds are split evenly over `warmup_stages(target)`; from
    round `warmup_rounds` on, the density is `target`.
    """
    stages = warmup_stages(target)
    if warmup_rounds <= 0 or round_index >= warmup_rounds or not stages:
        return target
    return stages[round_index * len(stages) // warmup_rounds]


EXACT_TOPK_BELOW = 1 << 17
SAMPLE_TAIL = 64  # sampled elements expected above the estimated threshold


def top_k_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |flat|, exactly, as DGC finds them: cheaply.

    A full `torch.topk` over millions of elements dominates the cost, so large tensors first
    estimate a threshold from a strided sample (DGC samples too), keep the candidates above it,
    and take the exact top-k among those. The candidates hold the true top-k whenever there
    are at least k of them; otherwise (a sample far off) it falls back to the full top-k. So the
    result is always an exact top-k, and deterministic (no random sampling).
    """
    count = flat.numel()
    if k >= count:
        return torch.arange(count, device=flat.device)
    magnitude = flat.abs()
    # sample so that ~SAMPLE_TAIL sampled elements fall in the top 2k
    sample_size = max(4096, math.ceil(SAMPLE_TAIL * count / (2 * k)))
    if count >= EXACT_TOPK_BELOW and 4 * sample_size <= count:
        sample = magnitude[:: count // sample_size]
        # aim for ~2k candidates so a slightly optimistic sample still leaves enough
        rank = min(sample.numel(), math.ceil(2 * k * sample.numel() / count))
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        candidates = torch.nonzero(magnitude >= threshold).reshape(-1)
        if candidates.numel() >= k:
            chosen = torch.topk(magnitude[candidates], k, sorted=False).indices
            return candidates[chosen]
    return torch.topk(magnitude, k, sorted=False).indices


def packet_indices(packet: Packet) -> torch.Tensor:
    """The sorted flat indices a top-k packet carries (sent as gaps: g_j = i_j - i_(j-1) - 1)."""
    gaps = packet.tensors["g"].to(torch.int64)
    return torch.cumsum(gaps + 1, 0) - 1


class TopKCompressor(Compressor):
    """Sends the k = ceil(density * numel) largest-magnitude accumulated coordinates.

    Packet: `g` (gaps between the sorted flat indices: the serializer writes them as one-byte
    varints for most of them at 1% density, instead of 4-byte indices) and `v` (the values, in
    float32 or, with `value_dtype`, float16/bfloat16, whose rounding error stays in the
    accumulation), meta `shape`.
    """

    name = "topk"

    def __init__(
        self,
        density: float,
        *,
        momentum: float = 0.9,
        warmup_rounds: int = 0,
        value_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
        if value_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"value_dtype must be float32, float16 or bfloat16, got {value_dtype}")
        self.density = density
        self.momentum = momentum
        self.warmup_rounds = warmup_rounds
        self.value_dtype = value_dtype
        self.momentum_correction = momentum > 0.0
        self.round = 0
        self._velocity: dict[str, torch.Tensor] = {}  # u: momentum buffers
        self._accumulated: dict[str, torch.Tensor] = {}  # v: not-yet-sent accumulation

    def current_density(self) -> float:
        return dgc_density(self.round, self.density, self.warmup_rounds)

    def compress(self, key: str, tensor: torch.Tensor) -> Packet:
        gradient = as_float32(tensor)
        term = gradient
        if self.momentum > 0.0:
            velocity = self._velocity.get(key)
            if velocity is None:
                velocity = gradient.clone()
            else:
                check_shape("momentum buffer", key, velocity, gradient)
                velocity.mul_(self.momentum).add_(gradient)
            self._velocity[key] = velocity
            term = velocity
        accumulated = self._accumulated.get(key)
        if accumulated is None:
            accumulated = term.clone()
        else:
            check_shape("accumulated gradient", key, accumulated, gradient)
            accumulated.add_(term)
        self._accumulated[key] = accumulated

        flat = accumulated.view(-1)  # a view: updating sent coordinates writes through
        count = flat.numel()
        k = min(count, max(1, math.ceil(self.current_density() * count))) if count else 0
        indices = torch.sort(top_k_indices(flat, k)).values
        values = flat[indices].to(self.value_dtype)
        # Sent coordinates leave the accumulation (all but a half-precision rounding error);
        # momentum factor masking clears their u.
        flat[indices] -= values.to(torch.float32)
        if self.momentum > 0.0:
            self._velocity[key].view(-1)[indices] = 0.0
        gaps = torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1
        return Packet(tensors={"g": gaps, "v": values}, meta={"shape": list(gradient.shape)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        values = packet.tensors["v"].to(torch.float32)
        shape = [int(d) for d in packet.meta["shape"]]
        dense = torch.zeros(math.prod(shape), dtype=torch.float32, device=values.device)
        dense[packet_indices(packet).to(values.device)] = values
        return dense.reshape(shape)

    def step(self) -> None:
        self.round += 1

    def residual(self, key: str) -> torch.Tensor | None:
        """The accumulation `v` not sent yet for `key`."""
        return self._accumulated.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "velocity": clone_tensors(self._velocity),
            "residuals": clone_tensors(self._accumulated),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state.get("round", 0))
        self._velocity = clone_tensors(state.get("velocity", {}))
        self._accumulated = clone_tensors(state.get("residuals", {}))
