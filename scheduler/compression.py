"""Modelled gradient compressors and sync modes: bytes on the WAN versus extra work and steps.

The spec strings are the ones the training runtime parses ("none", "fp16", "bf16", "int8",
"topk:<density>", "powersgd:<rank>", "sign"; "every-step", "local-sgd:<H>", "stale:<s>"), so a
plan can be handed to a run unchanged.

Every figure below is a *model*, not a measurement:

- `ratio` is compressed bytes / fp32 bytes of the exchanged tensor.
- `overhead_flops_per_param` is the extra GPU work per parameter on each cluster leader
  (compress + decompress), expressed in FLOPs so it scales with the leader's throughput.
- `steps_factor` is the extra optimisation steps the compressor or sync mode costs to reach the
  same loss (statistical efficiency). Error feedback keeps these small; the priors follow the
  orders of magnitude reported by Vogels et al. 2019 (PowerSGD), Lin et al. 2018 (DGC top-k),
  Bernstein et al. 2018 (signSGD) and Douillard et al. 2023 (DiLoCo). Without this factor the
  planner would always pick the most aggressive compressor; with it, it picks the least
  compression that hides the WAN under compute.
- `allreducible`: the payload can be summed chunk-wise in a ring (dense formats, PowerSGD's
  P/Q factors). Sparse top-k and sign payloads cannot, so they are all-gathered instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

SYNC_KINDS = ("every-step", "local-sgd", "stale")

# Candidates the planner tries for compression="auto" / sync="auto" (in this order, so ties
# resolve to the earlier, milder choice).
AUTO_COMPRESSIONS: tuple[str, ...] = (
    "none",
    "bf16",
    "int8",
    "powersgd:8",
    "powersgd:2",
    "topk:0.01",
    "sign",
)
AUTO_SYNCS: tuple[str, ...] = ("every-step", "stale:1", "local-sgd:8", "local-sgd:32")

# PowerSGD without layer shapes: assume the parameters sit in square d x d matrices with
# d = sqrt(params / POWERSGD_ASSUMED_MATRICES), i.e. a network of at least this many weight
# matrices (a 12-layer transformer has 6 per layer), with d clamped to [16, 16384].
POWERSGD_ASSUMED_MATRICES = 64

_HELP_COMPRESSION = (
    'use "none", "fp16", "bf16", "int8", "topk:<density in (0,1]>", "powersgd:<rank >= 1>", '
    '"sign" or "auto"'
)
_HELP_SYNC = 'use "every-step", "local-sgd:<H >= 1>", "stale:<s >= 0>" or "auto"'


@dataclass(frozen=True)
class CompressorModel:
    """What one compressor costs and saves, in the planner's model."""

    spec: str
    ratio: float
    overhead_flops_per_param: float
    steps_factor: float
    allreducible: bool


@dataclass(frozen=True)
class SyncModel:
    """How often the cross-cluster exchange happens and how much it may lag."""

    spec: str
    kind: str
    period: int = 1
    staleness: int = 0
    steps_factor: float = 1.0


def _powersgd_ratio(rank: int, params: int, layer_shapes: tuple[tuple[int, int], ...]) -> float:
    """Bytes of P (m x r) and Q (n x r) over bytes of M (m x n); 1-D tensors travel dense."""
    if layer_shapes:
        dense = 0
        sent = 0
        for m, n in layer_shapes:
            dense += m * n
            sent += min(m * n, rank * (m + n)) if min(m, n) > 1 else m * n
        return min(1.0, sent / dense) if dense else 1.0
    d = math.sqrt(params / POWERSGD_ASSUMED_MATRICES)
    d = min(16384.0, max(16.0, d))
    return min(1.0, 2.0 * rank / d)


def compressor_model(
    spec: str, params: int = 1, layer_shapes: tuple[tuple[int, int], ...] = ()
) -> CompressorModel:
    """Parse a compression spec into its model; ValueError names the fix."""
    s = spec.strip().lower()
    if s == "none":
        return CompressorModel("none", 1.0, 0.0, 1.0, True)
    if s in ("fp16", "bf16"):
        return CompressorModel(s, 0.5, 2.0, 1.0, True)
    if s == "int8":
        # one fp32 scale per 1024-element chunk
        return CompressorModel("int8", 0.25 + 1.0 / 1024, 4.0, 1.01, False)
    if s == "sign":
        # 1 bit per element + one fp32 scale per tensor (negligible)
        return CompressorModel("sign", 1.0 / 32, 4.0, 1.15, False)
    m = re.fullmatch(r"topk:([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)", s)
    if m:
        density = float(m.group(1))
        if not 0.0 < density <= 1.0:
            raise ValueError(
                f"compression {spec!r}: density must be in (0, 1]; {_HELP_COMPRESSION}"
            )
        # fp32 value + int32 index per kept element; selection ~ a few passes over the tensor
        return CompressorModel(
            f"topk:{m.group(1)}",
            min(1.0, 2.0 * density),
            16.0,
            1.0 + 0.05 * math.log10(1.0 / density),
            False,
        )
    m = re.fullmatch(r"powersgd:(\d+)", s)
    if m:
        rank = int(m.group(1))
        if rank < 1:
            raise ValueError(f"compression {spec!r}: rank must be >= 1; {_HELP_COMPRESSION}")
        # two matmuls M Q and M^T P (2 m n r FLOPs each) + orthogonalisation
        return CompressorModel(
            f"powersgd:{rank}",
            _powersgd_ratio(rank, params, layer_shapes),
            4.0 * rank + 8.0,
            1.0 + 0.2 / rank,
            True,
        )
    raise ValueError(f"compression {spec!r} is not understood: {_HELP_COMPRESSION}")


def sync_model(spec: str) -> SyncModel:
    """Parse a sync spec into its model; ValueError names the fix."""
    s = spec.strip().lower()
    if s == "every-step":
        return SyncModel("every-step", "every-step")
    m = re.fullmatch(r"(local-sgd|stale):(\d+)", s)
    if not m:
        raise ValueError(f"sync {spec!r} is not understood: {_HELP_SYNC}")
    n = int(m.group(2))
    if m.group(1) == "stale":
        return SyncModel(f"stale:{n}", "stale", staleness=n, steps_factor=1.0 + 0.02 * n)
    if n < 1:
        raise ValueError(f"sync {spec!r}: H must be >= 1; {_HELP_SYNC}")
    return SyncModel(
        f"local-sgd:{n}", "local-sgd", period=n, steps_factor=1.0 + 0.02 * math.log2(n)
    )


def validate_compression(spec: str) -> str:
    """Return the canonical spec ("auto" allowed); ValueError names the fix."""
    if spec.strip().lower() == "auto":
        return "auto"
    return compressor_model(spec).spec


def validate_sync(spec: str) -> str:
    """Return the canonical spec ("auto" allowed); ValueError names the fix."""
    if spec.strip().lower() == "auto":
        return "auto"
    return sync_model(spec).spec
