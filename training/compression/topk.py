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

Two more options make it SparseLoCo's compressor (Sarfi et al. 2025: top-k of 1-3 % of the
pseudo-gradient, per chunk, values at 2 bits, error feedback): `chunk` takes the top
ceil(density * chunk) of each chunk of `chunk` consecutive values instead of the top of the
whole tensor (every region keeps its share, and selection is one batched top-k), and
`value_bits` (4 or 2) sends the kept values as block-scaled stochastically rounded codes
(`training.compression.intn.quantize`), whose rounding error stays in the accumulation.

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
from training.compression.intn import dequantize, quantize

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


def chunked_top_k_indices(flat: torch.Tensor, density: float, chunk: int) -> torch.Tensor:
    """Indices of the ceil(density * chunk) largest |flat| of every `chunk` consecutive values
    (the last, shorter chunk keeps ceil(density * its length)); unsorted."""
    count = flat.numel()
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    rows = math.ceil(count / chunk)
    per = min(chunk, max(1, math.ceil(density * chunk)))
    magnitude = torch.full((rows * chunk,), -1.0, dtype=torch.float32, device=flat.device)
    magnitude[:count] = flat.abs()
    local = torch.topk(magnitude.view(rows, chunk), per, dim=1, sorted=False).indices
    starts = torch.arange(rows, device=flat.device).mul_(chunk).unsqueeze(1)
    found = (local + starts).reshape(-1)
    last = count - (rows - 1) * chunk  # the short last chunk keeps its own share
    keep_last = min(last, max(1, math.ceil(density * last)))
    if keep_last < per:
        tail = found[(rows - 1) * per :]
        tail = tail[tail < count]
        tail = tail[torch.argsort(flat[tail].abs(), descending=True, stable=True)][:keep_last]
        found = torch.cat([found[: (rows - 1) * per], tail])
    return found


def packet_indices(packet: Packet) -> torch.Tensor:
    """The sorted flat indices a top-k packet carries (sent as gaps: g_j = i_j - i_(j-1) - 1)."""
    gaps = packet.tensors["g"].to(torch.int64)
    return torch.cumsum(gaps + 1, 0) - 1


class TopKCompressor(Compressor):
    """Sends the k = ceil(density * numel) largest-magnitude accumulated coordinates.

    Packet: `g` (gaps between the sorted flat indices: the serializer writes them as one-byte
    varints for most of them at 1% density, instead of 4-byte indices) and `v` (the values, in
    float32 or, with `value_dtype`, float16/bfloat16, whose rounding error stays in the
    accumulation) or, with `value_bits`, `q` and `s` (packed codes and block scales), meta
    `shape`. Without momentum it may run in a compressed ring (`ring`): the accumulation is
    per key, whatever the key's tensor holds.
    """

    name = "topk"

    def __init__(
        self,
        density: float,
        *,
        momentum: float = 0.9,
        warmup_rounds: int = 0,
        value_dtype: torch.dtype = torch.float32,
        chunk: int = 0,
        value_bits: int = 0,
        seed: int = 0,
    ) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
        if value_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"value_dtype must be float32, float16 or bfloat16, got {value_dtype}")
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        if value_bits not in (0, 2, 4):
            raise ValueError(f"value_bits must be 0 (floats), 2 or 4, got {value_bits}")
        self.chunk = chunk
        self.value_bits = value_bits
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self.density = density
        self.momentum = momentum
        self.warmup_rounds = warmup_rounds
        self.value_dtype = value_dtype
        self.momentum_correction = momentum > 0.0
        self.ring = momentum == 0.0
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
        density = self.current_density()
        if self.chunk and count:
            chosen = chunked_top_k_indices(flat, density, self.chunk)
        else:
            k = min(count, max(1, math.ceil(density * count))) if count else 0
            chosen = top_k_indices(flat, k)
        indices = torch.sort(chosen).values
        tensors: dict[str, torch.Tensor]
        if self.value_bits:
            packed, scales = quantize(flat[indices], self.value_bits, self._generator)
            tensors = {"q": packed, "s": scales}
            sent = dequantize(packed, scales, self.value_bits, indices.numel()).to(flat.device)
        else:
            values = flat[indices].to(self.value_dtype)
            tensors = {"v": values}
            sent = values.to(torch.float32)
        # Sent coordinates leave the accumulation (all but the values' rounding error);
        # momentum factor masking clears their u.
        flat[indices] -= sent
        if self.momentum > 0.0:
            self._velocity[key].view(-1)[indices] = 0.0
        gaps = torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1
        return Packet(tensors={"g": gaps, **tensors}, meta={"shape": list(gradient.shape)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        if self.value_bits:
            count = packet.tensors["g"].numel()
            values = dequantize(packet.tensors["q"], packet.tensors["s"], self.value_bits, count)
        else:
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
            "rng": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state.get("round", 0))
        self._velocity = clone_tensors(state.get("velocity", {}))
        self._accumulated = clone_tensors(state.get("residuals", {}))
        if "rng" in state:
            self._generator.set_state(state["rng"].clone())
