"""Modelled gradient compressors and sync modes: bytes on the WAN versus extra work and steps.

Values are parsed by `grammar`, the same parser the API, the CLI and the training runtime use,
so every value a job may carry has a model here and a plan can be handed to a run unchanged.

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
- `allreducible`: the runtime all-reduces it through a ring of compressed chunks (dense
  formats, int8/int4/int2 and top-k without momentum correction: each hop re-compresses a
  partial sum with error feedback). PowerSGD, top-k with DGC momentum and sign payloads are
  all-gathered instead, so their bytes per cluster grow with the number of clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grammar import (
    COMPRESSION_HELP as _C_HELP,
)
from grammar import (
    SYNC_HELP,
    Compression,
    CompressionKind,
    Sync,
    SyncKind,
    parse_compression,
    parse_sync,
)
from grammar.compression import value_bytes
from grammar.quality import compression_cost, sync_cost

# The candidates of compression="auto" / sync="auto" are `grammar.auto`'s menu, the one the
# runtime's auto re-decides from too (`grammar.auto.candidates`).

UNEVEN_LINK_RATIO = 4.0
"""Links among a cluster set are uneven when the fastest pair's bandwidth (or the shortest RTT
against the longest) is at least this many times the slowest's: then gossip is a candidate."""

# PowerSGD without layer shapes: assume the parameters sit in square d x d matrices with
# d = sqrt(params / POWERSGD_ASSUMED_MATRICES), i.e. a network of at least this many weight
# matrices (a 12-layer transformer has 6 per layer), with d clamped to [16, 16384].
POWERSGD_ASSUMED_MATRICES = 64


@dataclass(frozen=True)
class CompressorModel:
    """What one compressor costs and saves, in the planner's model."""

    spec: str
    ratio: float
    overhead_flops_per_param: float
    steps_factor: float
    allreducible: bool


_EVERY_STEP = Sync(SyncKind.EVERY_STEP)


@dataclass(frozen=True)
class SyncModel:
    """How often the cross-cluster exchange happens and how much it may lag."""

    spec: str
    kind: str
    period: int = 1
    staleness: int = 0
    steps_factor: float = 1.0
    runs_ahead: bool = False
    """Fast clusters take up to SPEED_BOUND steps per step of the slowest (partial, async-ps)
    instead of waiting for it: more samples in the same steps of the slowest, which is what
    the run counts (its time is the slowest's)."""
    neighbours: bool = False
    """Each cluster exchanges with its ring neighbours only (gossip), not all-reduces."""
    value: Sync = _EVERY_STEP
    """The parsed value, which `grammar.auto.step_seconds` times a step of."""


def splits_by_rate(sync: SyncModel) -> bool:
    """Whether the run splits the batch by GPU throughput (the modes that average gradients
    every step: the gradient stays the batch's mean, whoever computes which part) rather
    than equally per worker (the modes of local updates, where the split would change what
    each cluster learns from between exchanges)."""
    return sync.kind != "local-sgd" and not sync.runs_ahead


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
    spec: str | Compression, params: int = 1, layer_shapes: tuple[tuple[int, int], ...] = ()
) -> CompressorModel:
    """The model of a concrete compression value; ValueError (from `grammar`) names the fix.
    Its steps factor is `grammar.quality`'s quality cost, the one both layers decide with."""
    c = parse_compression(spec)
    name = str(c)
    if c.kind is CompressionKind.AUTO:
        raise ValueError(f"compression 'auto' has no model: the planner replaces it; {_C_HELP}")
    steps = 1.0 + compression_cost(c)
    # bytes a value as the runtime sends it (`grammar.compression.value_bytes`, its model too)
    ratio = min(1.0, value_bytes(c) / 4.0)
    if c.kind is CompressionKind.NONE:
        return CompressorModel(name, 1.0, 0.0, steps, True)
    if c.kind in (CompressionKind.FP16, CompressionKind.BF16):
        return CompressorModel(name, ratio, 2.0, steps, True)
    if c.kind is CompressionKind.INT8:
        return CompressorModel(name, ratio, 4.0, steps, True)
    if c.kind in (CompressionKind.INT4, CompressionKind.INT2):
        return CompressorModel(name, ratio, 6.0, steps, True)
    if c.kind is CompressionKind.SIGN:
        return CompressorModel(name, ratio, 4.0, steps, False)
    if c.kind is CompressionKind.TOPK:  # selection ~ a few passes over the tensor
        return CompressorModel(name, ratio, 16.0, steps, c.momentum == 0.0)
    # PowerSGD: two matmuls M Q and M^T P (2 m n r FLOPs each) + orthogonalisation; each
    # leader's factors are all-gathered (the runtime does not all-reduce P and Q)
    return CompressorModel(
        name, _powersgd_ratio(c.rank, params, layer_shapes), 4.0 * c.rank + 8.0, steps, False
    )


def sync_model(spec: str | Sync) -> SyncModel:
    """The model of a concrete sync value; ValueError (from `grammar`) names the fix. Its
    steps factor is `grammar.quality`'s quality cost.

    `adaptive` exchanges every step; its compression level moves at run time, so the plan's
    compression (the one the planner picks) stands for it. `streaming:H:fF:dD` sends the
    same bytes per H steps as `local-sgd:H` (each fragment once); its step overlaps each
    fragment with its D steps of compute (`grammar.auto.step_seconds`). `partial:H` and
    `gossip:P` are modelled as local SGD of period H (P), `async-ps:S` by where the runtime
    puts its servers (`CostModel.ps_wan`); letting fast clusters run ahead gives them more
    samples, not the run fewer steps (`runs_ahead`), and gossip's neighbour exchange has its
    own WAN terms (`neighbours`).
    """
    s = parse_sync(spec)
    name = str(s)
    if s.kind is SyncKind.AUTO:
        raise ValueError(f"sync 'auto' has no model: the planner replaces it; {SYNC_HELP}")
    steps = 1.0 + sync_cost(s)
    if s.kind is SyncKind.STALE:
        return SyncModel(name, "stale", staleness=s.staleness, steps_factor=steps, value=s)
    if s.kind in (SyncKind.LOCAL_SGD, SyncKind.STREAMING):
        return SyncModel(name, "local-sgd", period=s.period, steps_factor=steps, value=s)
    if s.kind is SyncKind.PARTIAL:
        return SyncModel(
            name, "local-sgd", period=s.period, steps_factor=steps, runs_ahead=True, value=s
        )
    if s.kind is SyncKind.GOSSIP:
        # each cluster sends its model to its ring neighbours once per P steps
        return SyncModel(
            name, "local-sgd", period=s.period, steps_factor=steps, neighbours=True, value=s
        )
    if s.kind is SyncKind.ASYNC_PS:
        # each leader waits for its own server's push and pull; the servers of several
        # regions exchange apart (`CostModel.ps_wan`)
        return SyncModel(name, "async-ps", steps_factor=steps, runs_ahead=True, value=s)
    return SyncModel(name, "every-step", value=s)
