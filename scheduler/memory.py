"""Memory model of a training job, and the pipeline plan of one that fits no single GPU.

Pure functions. A model is a `ModelProfile`: its layers in order, each with parameters,
forward FLOPs per sample and the activation bytes it keeps for backward and sends on. A GPU
holds its parameters, their gradients, the optimizer's state and the activations of the
micro-batches in flight (1F1B: stage s of S holds at most S - s of them).

`plan_parallelism` keeps a job that fits one GPU data parallel. Otherwise it builds a
pipeline: the fewest stages that fit (fewer hops, a smaller bubble), one GPU each, laid over
clusters in the order (every order of up to `MAX_ORDERED_CLUSTERS` clusters is tried) whose
links carry the cuts' activations fastest, the layers split so the slowest stage or link is
as fast as it can be (a dynamic programme over contiguous splits under each GPU's memory),
and the micro-batch count that minimises the step as `scheduler.pipeline_cost` times it
(`schedule_seconds`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from grammar.parallel import Parallelism
from scheduler.gpus import DEFAULT_EFFICIENCY
from scheduler.pipeline_cost import (
    ALL_REDUCE_OVERHEAD_S,
    MICRO_BATCH_OVERHEAD_S,
    boundary_latency_s,
    micro_batch_candidates,
    schedule_seconds,
    tensor_collective_s,
)
from scheduler.types import Cluster, Link

GPU_MEMORY_GB: dict[str, float] = {
    "B200": 192.0,
    "H200": 141.0,
    "H100": 80.0,
    "H100-PCIE": 80.0,
    "H800": 80.0,
    "H20": 96.0,
    "GH200": 96.0,
    "A100": 80.0,
    "A800": 80.0,
    "A10G": 24.0,
    "A10": 24.0,
    "L40S": 48.0,
    "L40": 48.0,
    "L4": 24.0,
    "V100": 32.0,
    "T4": 16.0,
    "MI300X": 192.0,
    "MI250X": 128.0,
    "RTX4090": 24.0,
    "CPU": 64.0,
}
"""Datasheet memory per GPU (the largest variant where a model comes in several)."""

USABLE = 0.9
"""Share of a GPU's memory training can use (the runtime's context and fragmentation take
the rest)."""

OPTIMIZER_STATE_BYTES: dict[str, int] = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8}
"""Optimizer state per parameter (fp32): momentum buffer; Adam's two moments."""

MAX_ORDERED_CLUSTERS = 5
"""Up to this many clusters every order is tried; beyond, the order of most memory first."""


@dataclass(frozen=True)
class Layer:
    """One layer (a piece a stage boundary may follow), per sample."""

    name: str
    params: int
    flops: float
    """Forward FLOPs per sample (backward costs twice that)."""
    activation_bytes: float
    """Bytes of its output per sample: what crosses a stage boundary after it."""
    stored_bytes: float
    """Bytes it keeps for backward per sample (its inputs and intermediates)."""
    heads: int = 0
    """A block that splits over GPUs (tensor parallelism): its attention heads, which a split
    must divide; 0: the layer stays whole on every GPU of a split (embeddings, the head)."""


@dataclass(frozen=True)
class ModelProfile:
    layers: tuple[Layer, ...]
    optimizer: str = "adam"
    param_bytes: int = 4
    """Bytes per parameter and per gradient (fp32: 4)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("model: give at least one layer")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_BYTES)}"
            )

    @property
    def params(self) -> int:
        return sum(x.params for x in self.layers)

    @classmethod
    def transformer(
        cls,
        *,
        blocks: int,
        dim: int,
        seq: int,
        vocab: int,
        optimizer: str = "adam",
        param_bytes: int = 4,
    ) -> ModelProfile:
        """A decoder-only transformer: embedding, `blocks` blocks, head. A block has 12 dim^2
        weights and runs 2 FLOPs a weight a token plus attention's 4 seq dim a token; it keeps
        34 seq dim + 5 heads seq^2 half-precision values for backward (Korthikanti et al.,
        no recomputation), scaled to `param_bytes`."""
        heads = max(1, dim // 64)
        act = float(seq * dim * param_bytes)
        weights = 12 * dim * dim + 13 * dim
        kept = (34.0 * seq * dim + 5.0 * heads * seq * seq) * param_bytes / 2
        layers = [Layer("embed", vocab * dim + seq * dim, 0.0, act, float(seq * 8))]
        layers += [
            Layer(
                f"block{i}", weights, 2.0 * weights * seq + 4.0 * seq * seq * dim, act, kept, heads
            )
            for i in range(blocks)
        ]
        layers.append(
            Layer("head", dim * vocab, 2.0 * dim * vocab * seq, seq * vocab * 4.0, act * 2)
        )
        return cls(tuple(layers), optimizer, param_bytes)

    def splits(self, tensor: int) -> bool:
        """Whether the model splits over `tensor` GPUs: some layer splits, and every splitting
        layer's heads divide by it."""
        return tensor in split_widths([x.heads for x in self.layers], tensor)

    def split(self, tensor: int) -> ModelProfile:
        """What one GPU of a `tensor`-way split holds and computes: a splitting layer's
        parameters and FLOPs over `tensor`, and of what it keeps for backward the part
        Megatron splits (Korthikanti et al.: 24 of a block's 34 values a token, and the
        attention scores; the rest, the norms' and the residual's, stays whole)."""
        if tensor == 1:
            return self
        kept = SPLIT_KEPT + (1 - SPLIT_KEPT) / tensor
        return replace(
            self,
            layers=tuple(
                replace(
                    x,
                    params=math.ceil(x.params / tensor),
                    flops=x.flops / tensor,
                    stored_bytes=x.stored_bytes * kept,
                )
                if x.heads
                else x
                for x in self.layers
            ),
        )


SPLIT_KEPT = 10 / 34
"""The share of a block's kept activations a tensor split leaves whole on every GPU."""

MAX_TENSOR = 8
"""The widest split the planner weighs: a split's all-reduces sit on every micro-batch's
critical path, so it stays inside one machine's GPUs (NVLink), as Megatron keeps it."""


def split_widths(heads: Sequence[int], widest: int) -> list[int]:
    """The tensor split widths the planner weighs: 1, and up to `MAX_TENSOR` and `widest`
    (the most GPUs a cluster gives) each dividing every splitting layer's `heads` (0: a
    layer that stays whole; none splits: no width but 1)."""
    split = [h for h in heads if h]
    top = min(MAX_TENSOR, widest)
    return [t for t in range(1, top + 1) if t == 1 or (split and all(h % t == 0 for h in split))]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def memory(
    profile: ModelProfile, lo: int, hi: int, micro_batch: int, in_flight: int
) -> MemoryEstimate:
    """What layers [lo, hi) need on one GPU with `in_flight` micro-batches of `micro_batch`."""
    layers = profile.layers[lo:hi]
    n = sum(x.params for x in layers)
    acts = sum(x.stored_bytes for x in layers) * micro_batch * in_flight
    if lo > 0:  # the received input, kept for its gradient
        acts += profile.layers[lo - 1].activation_bytes * micro_batch * in_flight
    return MemoryEstimate(
        params=float(n * profile.param_bytes),
        grads=float(n * profile.param_bytes),
        optimizer=float(n * OPTIMIZER_STATE_BYTES[profile.optimizer]),
        activations=float(acts),
    )


def gpu_memory_bytes(cluster: Cluster, overrides: Mapping[str, float] | None = None) -> float:
    """Usable bytes of one of `cluster`'s GPUs; `overrides` maps cluster names to GB."""
    gb = (overrides or {}).get(cluster.name)
    if gb is None:
        gb = GPU_MEMORY_GB.get(cluster.gpu_model.strip().upper())
    if gb is None:
        raise ValueError(
            f"cluster {cluster.name!r}: memory of gpu_model {cluster.gpu_model!r} is unknown; "
            "give its GB in the memory overrides"
        )
    return gb * 1e9 * USABLE


def _flops_per_s(cluster: Cluster) -> float:
    return cluster.peak_tflops * 1e12 * (cluster.efficiency or DEFAULT_EFFICIENCY)


@dataclass(frozen=True)
class StagePlan:
    cluster: str
    layers: tuple[int, int]
    """[first, end) of the profile's layers."""
    memory: MemoryEstimate
    gpu_bytes: float
    compute_s: float
    """Forward and backward of one micro-batch on each of its GPUs, a split's all-reduces
    included (a micro-batch's fixed cost is the slot's: `schedule_seconds`)."""
    send_s: float
    """Its output's (and back, the gradient's) transfer per micro-batch; 0 for the last."""


@dataclass(frozen=True)
class ParallelPlan:
    parallelism: Parallelism
    reason: str
    stages: tuple[StagePlan, ...] = ()
    micro_batches: int = 1
    bubble: float = 0.0
    step_s: float = 0.0
    tensor: int = 1
    """GPUs of one cluster each stage's layers are split over (1: none)."""
    micro_overhead_s: float = 0.0
    """The fixed cost of a micro-batch its step counted (a slot's, beyond its stages' work)."""
    fits: tuple[str, ...] = field(default=())
    """Data parallel: the clusters whose GPUs hold the whole model."""


def _link_s(
    a: Cluster, b: Cluster, links: Mapping[tuple[str, str], Link], nbytes: float
) -> float | None:
    """Seconds to move `nbytes` a -> b and its gradient back (full duplex: the slower way),
    latency aside (`scheduler.pipeline_cost`: it is paid once a step, not a micro-batch)."""
    if a.name == b.name:
        return nbytes * 8 / (a.intra_bandwidth_gbps * 1e9)
    there, back = links.get((a.name, b.name)), links.get((b.name, a.name))
    if there is None or back is None:
        return None
    return max(nbytes * 8 / (x.bandwidth_gbps * 1e9) for x in (there, back))


def _latency_s(slots: Sequence[Cluster], links: Mapping[tuple[str, str], Link]) -> float:
    """The RTTs of the boundaries between consecutive stages on different clusters, paid once
    a step (`scheduler.pipeline_cost.boundary_latency_s`); links missing: 0 (the split is
    refused by `_link_s` then)."""
    total = 0.0
    for a, b in itertools.pairwise(slots):
        with contextlib.suppress(ValueError):
            total += boundary_latency_s(a, b, links)
    return total


@dataclass(frozen=True)
class _Split:
    bottleneck: float
    wan_s: float
    stages: tuple[StagePlan, ...]


@dataclass(frozen=True)
class _Sums:
    """Prefix sums over a profile's layers, so a split's memory test is O(1)."""

    flops: list[float]
    params: list[int]
    kept: list[float]
    per_param: int
    split: list[int]
    """Splitting layers (blocks) so far."""
    split_bytes: list[float]
    """Their outputs' bytes a sample so far: what a split all-reduces."""

    @classmethod
    def of(cls, profile: ModelProfile) -> _Sums:
        flops, params, kept, split, split_bytes = [0.0], [0], [0.0], [0], [0.0]
        for x in profile.layers:
            flops.append(flops[-1] + x.flops)
            params.append(params[-1] + x.params)
            kept.append(kept[-1] + x.stored_bytes)
            split.append(split[-1] + (1 if x.heads else 0))
            split_bytes.append(split_bytes[-1] + (x.activation_bytes if x.heads else 0.0))
        per_param = 2 * profile.param_bytes + OPTIMIZER_STATE_BYTES[profile.optimizer]
        return cls(flops, params, kept, per_param, split, split_bytes)

    def collective_s(
        self, j: int, i: int, micro_batch: int, tensor: int, cluster: Cluster, overhead_s: float
    ) -> float:
        """Layers [j, i)'s all-reduces of one micro-batch under a `tensor`-way split, each
        with its fixed cost `overhead_s`."""
        blocks = self.split[i] - self.split[j]
        if tensor <= 1 or not blocks:
            return 0.0
        mean = (self.split_bytes[i] - self.split_bytes[j]) / blocks * micro_batch
        return tensor_collective_s(mean, blocks, tensor, cluster.intra_bandwidth_gbps, overhead_s)

    def fits(self, profile: ModelProfile, j: int, i: int, samples: int, limit: float) -> bool:
        """`memory(profile, j, i, mb, k).total <= limit` with `samples` = mb x k in flight."""
        acts = (self.kept[i] - self.kept[j]) * samples
        if j > 0:
            acts += profile.layers[j - 1].activation_bytes * samples
        return (self.params[i] - self.params[j]) * self.per_param + acts <= limit


def _split(
    profile: ModelProfile,
    slots: Sequence[Cluster],
    links: Mapping[tuple[str, str], Link],
    mems: Mapping[str, float],
    micro: int,
    micro_batch: int,
    tensor: int = 1,
    all_reduce_s: float = ALL_REDUCE_OVERHEAD_S,
) -> _Split | None:
    """The contiguous split of the layers over `slots` (one stage each, in order) with the
    least bottleneck (slowest stage or link per micro-batch) that fits every GPU; None if
    none fits. `profile` is what one GPU of a `tensor`-way split holds (`ModelProfile.split`),
    whose all-reduces each stage also pays."""
    layers, s_count = profile.layers, len(slots)
    n = len(layers)
    sums = _Sums.of(profile)
    flops = sums.flops

    inf = (math.inf, math.inf)
    # best[k][i]: (bottleneck, wan seconds) of layers [0, i) on slots [0, k); back: split point
    best = [[inf] * (n + 1) for _ in range(s_count + 1)]
    back = [[0] * (n + 1) for _ in range(s_count + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, s_count + 1):
        slot = slots[k - 1]
        speed = _flops_per_s(slot)
        in_flight = min(micro, s_count - (k - 1))
        limit = mems[slot.name]
        for i in range(k, n - (s_count - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                if not sums.fits(profile, j, i, micro_batch * in_flight, limit):
                    continue
                compute = 3.0 * (flops[i] - flops[j]) * micro_batch / speed
                compute += sums.collective_s(j, i, micro_batch, tensor, slot, all_reduce_s)
                link, wan = 0.0, 0.0
                if k > 1:
                    got = _link_s(
                        slots[k - 2], slot, links, layers[j - 1].activation_bytes * micro_batch
                    )
                    if got is None:
                        continue
                    link = got
                    wan = got if slots[k - 2].name != slot.name else 0.0
                cand = (max(prev[0], compute, link), prev[1] + wan)
                if cand < best[k][i]:
                    best[k][i], back[k][i] = cand, j
    if best[s_count][n] == inf:
        return None
    bounds = [n]
    for k in range(s_count, 0, -1):
        bounds.append(back[k][bounds[-1]])
    bounds.reverse()
    stages = []
    for k in range(s_count):
        lo, hi, slot = bounds[k], bounds[k + 1], slots[k]
        send = 0.0
        if k + 1 < s_count:
            send = (
                _link_s(slot, slots[k + 1], links, layers[hi - 1].activation_bytes * micro_batch)
                or 0.0
            )
        stages.append(
            StagePlan(
                cluster=slot.name,
                layers=(lo, hi),
                memory=memory(profile, lo, hi, micro_batch, min(micro, s_count - k)),
                gpu_bytes=mems[slot.name],
                compute_s=3.0 * (flops[hi] - flops[lo]) * micro_batch / _flops_per_s(slot)
                + sums.collective_s(lo, hi, micro_batch, tensor, slot, all_reduce_s),
                send_s=send,
            )
        )
    bottleneck, wan = best[s_count][n]
    return _Split(bottleneck, wan, tuple(stages))


def plan_parallelism(
    profile: ModelProfile,
    clusters: Sequence[Cluster],
    links: Sequence[Link],
    batch: int,
    memory_gb: Mapping[str, float] | None = None,
    micro_overhead_s: float = MICRO_BATCH_OVERHEAD_S,
    schedule: str = "gpipe",
    all_reduce_overhead_s: float = ALL_REDUCE_OVERHEAD_S,
) -> ParallelPlan:
    """Data parallel when the whole model trains on one GPU of some cluster; else, for each
    split its layers allow (1 to `MAX_TENSOR` GPUs of one cluster, dividing the blocks'
    heads), the fastest plan with the fewest stages of such groups (one stage of a split:
    tensor parallel; several: a pipeline, 3D when split), and of those the shortest step;
    ValueError (saying why) when nothing fits. `memory_gb` overrides GPU memory per cluster
    name; `micro_overhead_s` is the fixed cost of a micro-batch on a stage,
    `all_reduce_overhead_s` that of a split's all-reduce; under `schedule` 1F1B a slot is
    also at least a micro-batch's round trip over the S it keeps in flight
    (`scheduler.pipeline_cost`)."""
    if batch < 1:
        raise ValueError("batch: give at least 1")
    usable = [c for c in clusters if c.schedulable and c.gpus_free > 0]
    if not usable:
        raise ValueError("clusters: none is schedulable with a free GPU")
    mems = {c.name: gpu_memory_bytes(c, memory_gb) for c in usable}
    n = len(profile.layers)
    whole = memory(profile, 0, n, 1, 1)  # one sample at a time: gradient accumulation
    fits = tuple(c.name for c in usable if whole.total <= mems[c.name])
    biggest = max(usable, key=lambda c: mems[c.name])
    if fits:
        return ParallelPlan(
            Parallelism.DATA,
            f"the whole model needs {whole.total / 1e9:.1f} GB a GPU (one sample a step), "
            f"which fits {', '.join(fits)}: data parallel moves no activations",
            fits=fits,
        )
    directed = {(x.a, x.b): x for x in links}
    for x in links:
        directed.setdefault((x.b, x.a), Link(x.b, x.a, x.bandwidth_gbps, x.rtt_ms))
    if len(usable) <= MAX_ORDERED_CLUSTERS:
        orders = list(itertools.permutations(usable))
    else:
        orders = [tuple(sorted(usable, key=lambda c: (-mems[c.name], c.name)))]
    widest = max(c.gpus_free for c in usable)
    found = [
        got
        for t in split_widths([x.heads for x in profile.layers], widest)
        if (
            got := _staged(
                profile,
                t,
                usable,
                orders,
                directed,
                mems,
                batch,
                (micro_overhead_s, all_reduce_overhead_s),
                schedule,
            )
        )
        is not None
    ]
    if found:
        # the shortest step; a narrower split where equal (fewer GPUs waiting on each other)
        best = min(found, key=lambda p: (p.step_s, p.tensor))
        head = (
            f"the whole model needs {whole.total / 1e9:.1f} GB a GPU, more than the largest "
            f"({biggest.name}: {mems[biggest.name] / 1e9:.1f} GB usable); "
        )
        others = sorted(f"{_kind(p)} {p.step_s:.3g} s" for p in found if p is not best)
        weighed = f" (weighed: {', '.join(others)} a step)" if others else ""
        return replace(best, reason=head + best.reason + weighed)
    total_gpus = sum(c.gpus_free for c in usable)
    raise ValueError(
        f"model: {whole.total / 1e9:.1f} GB fits no pipeline over the free GPUs "
        f"({total_gpus} of them), its layers whole or split; a single layer may exceed a GPU, "
        "or add clusters or GPUs"
    )


def _kind(plan: ParallelPlan) -> str:
    if plan.tensor > 1:
        return f"tensor x{plan.tensor}" if len(plan.stages) == 1 else f"3D x{plan.tensor}"
    return f"pipeline of {len(plan.stages)}"


def _staged(
    whole_profile: ModelProfile,
    tensor: int,
    usable: Sequence[Cluster],
    orders: Sequence[Sequence[Cluster]],
    directed: Mapping[tuple[str, str], Link],
    mems: Mapping[str, float],
    batch: int,
    overheads: tuple[float, float],
    schedule: str,
) -> ParallelPlan | None:
    """The fastest plan with the fewest stages that fit, each stage a group of `tensor` GPUs
    of one cluster splitting its layers (1: one GPU a stage); None when none fits. `overheads`:
    the fixed costs of a micro-batch on a stage and of a split's all-reduce."""
    profile = whole_profile.split(tensor)
    micro_s, reduce_s = overheads
    n = len(profile.layers)
    one = memory(profile, 0, n, 1, 1)
    groups = sum(c.gpus_free // tensor for c in usable)
    # fewer stages than the parameters' state needs GPUs (each at most the largest) cannot fit:
    # start there instead of proving every smaller count impossible (one stage of one GPU is
    # data parallelism, not weighed here)
    state = one.params + one.grads + one.optimizer
    least = max(1 if tensor > 1 else 2, math.ceil(state / max(mems.values())))
    for s_count in range(least, min(n, groups) + 1):
        best: tuple[tuple[float, float], ParallelPlan] | None = None
        for order in orders:
            slots = [c for c in order for _ in range(c.gpus_free // tensor)][:s_count]
            if len(slots) < s_count:
                continue
            latency = _latency_s(slots, directed)
            for micro in micro_batch_candidates(batch, s_count):
                mb = math.ceil(batch / micro)
                got = _split(profile, slots, directed, mems, micro, mb, tensor, reduce_s)
                if got is None:
                    continue
                step = schedule_seconds(
                    [st.compute_s for st in got.stages],
                    [st.send_s for st in got.stages][:-1],
                    latency,
                    schedule,
                    micro,
                    micro_s,
                )
                key = (step, got.wan_s * micro)
                if best is None or key < best[0]:
                    used = list(dict.fromkeys(st.cluster for st in got.stages))
                    if tensor > 1 and s_count == 1:
                        why = (
                            f"split over {tensor} GPUs of {used[0]} it needs "
                            f"{got.stages[0].memory.total / 1e9:.1f} GB a GPU: tensor parallel "
                            f"keeps it in one cluster, its all-reduces on the cluster's links, "
                            f"nothing on the WAN; {micro} micro-batch(es)"
                        )
                    else:
                        split = (
                            f", each of {tensor} GPUs splitting its layers (3D)"
                            if tensor > 1
                            else ""
                        )
                        why = (
                            f"{s_count} stages{split} over {' -> '.join(used)} fit, {micro} "
                            f"micro-batches of {mb} balance the bubble against "
                            "per-micro-batch cost"
                        )
                    best = (
                        key,
                        ParallelPlan(
                            Parallelism.TENSOR
                            if tensor > 1 and s_count == 1
                            else Parallelism.PIPELINE,
                            why,
                            stages=got.stages,
                            micro_batches=micro,
                            bubble=(s_count - 1) / (micro + s_count - 1),
                            step_s=step,
                            tensor=tensor,
                            micro_overhead_s=micro_s,
                        ),
                    )
        if best is not None:
            return best[1]
    return None
