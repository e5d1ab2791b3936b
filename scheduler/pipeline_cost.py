"""Time and price of a pipeline (or hybrid) plan: what `cpn plan` shows for one.

Pure. A pipeline of S stages running M micro-batches a step is paced by its slowest
element: a stage's pass over one micro-batch, or a link between two consecutive stages
moving one micro-batch's activations forward or their gradient back (bytes over bandwidth,
the slower direction; a boundary inside one cluster uses its intra bandwidth). A link's
latency does not pace it: micro-batches follow each other in flight, so each boundary
between two clusters adds its RTT once a step (half filling the pipeline forward, half
draining it backward). GPipe sends every forward before the first backward, so a link
carries activations in the forward phase and gradients in the backward one, never both at
once: each phase takes one micro-batch through every stage and link plus M - 1 of its
slowest (`schedule_seconds`). 1F1B interleaves them, one forward and one backward a slot,
so a link carries both ways at once: (M + S - 1) slots of the slowest stage's forward and
backward or link (`slot_seconds`); it keeps at most S micro-batches in flight (its memory
saving), so a micro-batch's round trip through every stage and link, latency included,
over S also bounds its slot: over long links it is slower than GPipe. (S - 1) / (M + S - 1)
of the slots is the bubble.
Every boundary between two clusters carries M activations one way and M gradients (as
large) back each step; a stage's GPUs are charged at their cluster's GPU-hour price for the
whole run, and the bytes leaving a cluster at the egress price of the link they take.

A stage whose layers are split over T GPUs of its cluster (tensor parallelism, Megatron's
column-then-row pairs) computes 1/T of its work on each and pays four all-reduces of its
activations a block a micro-batch, two forward and two backward, on the cluster's intra
links (`tensor_collective_s`: a ring, 2(T-1) rounds of 1/T of the bytes, each also paying
the intra latency).

A micro-batch also costs its slot a fixed time (`micro_overhead_s`: kernel launches, a small
batch's inefficiency, its messages' encoding and hand-over, the runtime's bookkeeping), which
makes many tiny micro-batches slower than a few, against the bubble that makes few slow;
`best_micro_batches` weighs the two. It is added to the slot whichever bounds it, a stage or
a link, so the cost fitted from a run (`fit_micro_overhead`) gives that run's step back
where a link paces it too.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler.types import Cluster, Link

SCHEDULES = ("gpipe", "1f1b")
"""The pipeline schedules the runtime runs (`training.pipeline.schedule.Schedule`)."""

MICRO_BATCH_OVERHEAD_S = 0.005
"""The prior of a micro-batch's fixed cost on one stage, before any pipeline run was
observed; the control plane fits it from finished runs (`controller.network.snapshot`)."""


ALL_REDUCE_OVERHEAD_S = 0.0001
"""The prior of one all-reduce's fixed cost inside a cluster (its launch and the runtime's
dispatch, beyond its bytes and rounds: of the order of a tenth of a millisecond for NCCL on
one machine's GPUs; gloo on CPUs takes far more, which the fit learns), before any split run
was observed; fitted like the micro-batch cost (`fit_all_reduce_overhead`)."""

TENSOR_ALL_REDUCES_PER_BLOCK = 4
"""A split block's all-reduces a micro-batch: attention's and the MLP's row-parallel outputs
forward, their column-parallel inputs' gradients backward."""

ALPHA_TENSOR_S = 10e-6
"""The latency of one round of an all-reduce inside a cluster (as `scheduler.cost`'s
`ALPHA_INTRA_S`)."""


def ring_all_reduce_s(nbytes: float, ranks: int, intra_gbps: float, overhead_s: float) -> float:
    """One all-reduce of `nbytes` over `ranks` GPUs of one cluster joined at `intra_gbps`: a
    ring, 2(R-1) rounds of 1/R of the bytes, each paying the intra latency, plus its fixed
    cost `overhead_s` (its launch and the runtime's dispatch: `fit_all_reduce_overhead`); 0
    alone."""
    if ranks <= 1:
        return 0.0
    rounds = 2 * (ranks - 1)
    return rounds * ALPHA_TENSOR_S + rounds / ranks * nbytes * 8 / (intra_gbps * 1e9) + overhead_s


def tensor_collective_s(
    activation_bytes: float,
    blocks: float,
    tensor: int,
    intra_gbps: float,
    overhead_s: float = 0.0,
) -> float:
    """Seconds a stage's `blocks` split blocks spend all-reducing a micro-batch's activations
    (`activation_bytes` each) over `tensor` GPUs joined at `intra_gbps`, four all-reduces a
    block (`ring_all_reduce_s`, each with its fixed cost `overhead_s`); 0 unsplit."""
    if tensor <= 1 or blocks <= 0:
        return 0.0
    one = ring_all_reduce_s(activation_bytes, tensor, intra_gbps, overhead_s)
    return TENSOR_ALL_REDUCES_PER_BLOCK * blocks * one


def fit_all_reduce_overhead(
    measured_step_s: float, planned_step_s: float, all_reduces: int, counted: float
) -> float:
    """One split run's sample of an all-reduce's fixed cost inside a cluster (a split's, and
    a stage's replicas' after each step alike): what its measured step took over
    the planned one, spread over the step's `all_reduces` (a one-stage run: every one on its
    critical path), plus the cost the plan `counted` (may be negative: the caller takes a
    median and floors it)."""
    return (measured_step_s - planned_step_s) / all_reduces + counted


def micro_batch_candidates(batch: int, stages: int, limit: int = 64) -> list[int]:
    """Micro-batch counts worth trying: powers of two and multiples of the stage count."""
    found = {1 << i for i in range(7)} | {stages * k for k in (1, 2, 4, 8)}
    return sorted(m for m in found if 1 <= m <= min(batch, limit))


@dataclass(frozen=True)
class StageWork:
    """One stage as the estimate sees it."""

    cluster: str
    compute_s: float
    """Forward and backward of one micro-batch on one of its GPUs."""
    send_bytes: float
    """Activation bytes of one micro-batch sent to the next stage (0 for the last stage)."""
    gpus: int = 1
    """GPUs the stage holds: its data-parallel replicas times its tensor split (1 in a
    pipeline)."""
    replicas: int = 1
    """Its data-parallel replicas, which all-reduce its gradients inside its cluster after
    each step (`grad_bytes` each)."""
    grad_bytes: float = 0.0
    """Its parameters' gradient bytes (whole; each of a split's parts all-reduces its own)."""


@dataclass(frozen=True)
class PipelineEstimate:
    stages: int
    micro_batches: int
    bottleneck_s: float
    """The mean slot of the schedule, per micro-batch (its passes over M + S - 1)."""
    link_s: tuple[float, ...]
    """Per boundary s -> s+1, the link's transfer time per micro-batch."""
    latency_s: float
    """The boundaries' RTTs, paid once a step (filling and draining the pipeline)."""
    step_s: float
    bubble: float
    steps: int
    total_time_s: float
    wan_bytes_per_step: tuple[tuple[str, str, float], ...]
    """(from, to, bytes) per directed WAN link, activations and gradients together."""
    gpu_cost: float
    egress_cost: float
    sync_s: float = 0.0
    """The stages' replicas' gradient all-reduce after the step (the slowest stage's)."""

    @property
    def wan_bytes(self) -> float:
        """Bytes over the WAN in the whole run."""
        return sum(b for _, _, b in self.wan_bytes_per_step) * self.steps

    @property
    def cost(self) -> float:
        return self.gpu_cost + self.egress_cost


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def link_seconds(
    a: Cluster, b: Cluster, links: Mapping[tuple[str, str], Link], nbytes: float
) -> float:
    """Seconds to move `nbytes` a -> b and as many back (the slower way), latency aside;
    ValueError naming the pair when the snapshot has no link between them (either way)."""
    if a.name == b.name:
        return nbytes * 8 / (a.intra_bandwidth_gbps * 1e9)
    return max(nbytes * 8 / (x.bandwidth_gbps * 1e9) for x in _ways(a, b, links))


def boundary_latency_s(a: Cluster, b: Cluster, links: Mapping[tuple[str, str], Link]) -> float:
    """What a boundary a -> b adds to a step once: half its RTT forward, half backward (the
    slower way's); 0 inside one cluster. ValueError as `link_seconds`."""
    if a.name == b.name:
        return 0.0
    return max(x.rtt_ms / 1e3 for x in _ways(a, b, links))


def _ways(a: Cluster, b: Cluster, links: Mapping[tuple[str, str], Link]) -> list[Link]:
    there, back = links.get((a.name, b.name)), links.get((b.name, a.name))
    if there is None and back is None:
        raise ValueError(f"links: no link between {a.name!r} and {b.name!r}")
    return [x for x in (there, back) if x is not None]


def _link(links: Mapping[tuple[str, str], Link], a: str, b: str) -> Link | None:
    return links.get((a, b)) or links.get((b, a))


def estimate_pipeline(
    stages: Sequence[StageWork],
    clusters: Mapping[str, Cluster],
    links: Mapping[tuple[str, str], Link],
    micro_batches: int,
    steps: int,
    qos_class: str | None = None,
    micro_overhead_s: float = 0.0,
    schedule: str = "gpipe",
    all_reduce_overhead_s: float = 0.0,
) -> PipelineEstimate:
    """The step time, run time, WAN bytes and price of `stages` (in pipeline order) running
    `micro_batches` a step for `steps` steps under `schedule`, each micro-batch costing a
    stage `micro_overhead_s` more, then each stage's replicas all-reducing its gradients
    inside its cluster (in parallel, the slowest stage's ring; each all-reduce costing
    `all_reduce_overhead_s` more); links are keyed (from, to), either way found. ValueError
    `field: ...` for a bad input."""
    if not stages:
        raise ValueError("stages: give at least one")
    if micro_batches < 1:
        raise ValueError("micro_batches: give at least 1")
    if steps < 1:
        raise ValueError("steps: give at least 1")
    if not 0 <= micro_overhead_s < 3600:
        raise ValueError("micro_overhead_s: must be in [0, 3600) seconds")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    for st in stages:
        if st.cluster not in clusters:
            raise ValueError(f"stages: cluster {st.cluster!r} is not in the snapshot")
        if st.compute_s < 0 or st.send_bytes < 0 or st.gpus < 1:
            raise ValueError(f"stages: stage on {st.cluster!r} has a negative time or size")
    s_count, m = len(stages), micro_batches
    link_s: list[float] = []
    latency = 0.0
    wan: dict[tuple[str, str], float] = {}
    for here, there in itertools.pairwise(stages):
        a, b = clusters[here.cluster], clusters[there.cluster]
        link_s.append(link_seconds(a, b, links, here.send_bytes))
        latency += boundary_latency_s(a, b, links)
        if a.name != b.name:
            moved = here.send_bytes * m
            wan[(a.name, b.name)] = wan.get((a.name, b.name), 0.0) + moved  # activations
            wan[(b.name, a.name)] = wan.get((b.name, a.name), 0.0) + moved  # their gradients
    busy = [st.compute_s for st in stages]
    passes = schedule_seconds(busy, link_s, latency, schedule, m, micro_overhead_s)
    bottleneck = (passes - latency) / (m + s_count - 1)  # the mean slot
    sync = max(
        ring_all_reduce_s(
            st.grad_bytes,
            st.replicas,
            clusters[st.cluster].intra_bandwidth_gbps,
            all_reduce_overhead_s,
        )
        for st in stages
    )
    step_s = passes + sync
    total = step_s * steps
    gpu_cost, egress = _costs([stages], clusters, links, wan, steps, total, qos_class)
    return PipelineEstimate(
        stages=s_count,
        micro_batches=m,
        bottleneck_s=bottleneck,
        link_s=tuple(link_s),
        latency_s=latency,
        step_s=step_s,
        bubble=bubble_fraction(s_count, m),
        steps=steps,
        sync_s=sync,
        total_time_s=total,
        wan_bytes_per_step=tuple((a, b, n) for (a, b), n in sorted(wan.items())),
        gpu_cost=gpu_cost,
        egress_cost=egress,
    )


def _costs(
    pipelines: Sequence[Sequence[StageWork]],
    clusters: Mapping[str, Cluster],
    links: Mapping[tuple[str, str], Link],
    wan: Mapping[tuple[str, str], float],
    steps: int,
    total_s: float,
    qos_class: str | None,
) -> tuple[float, float]:
    """Every stage's GPUs at their cluster's price for `total_s`, and the egress of `wan`
    (bytes a step per directed link) over `steps` at each link's price."""
    gpu = sum(
        st.gpus * clusters[st.cluster].price(qos_class) * total_s / 3600.0
        for row in pipelines
        for st in row
    )
    egress = 0.0
    for (src, dst), nbytes in wan.items():
        lk = _link(links, src, dst)
        egress += nbytes * steps / 1e9 * (lk.egress_price_per_gb if lk is not None else 0.0)
    return gpu, egress


def wan_ring_all_reduce_s(
    nbytes: float,
    ring: Sequence[str],
    clusters: Mapping[str, Cluster],
    links: Mapping[tuple[str, str], Link],
    overhead_s: float = 0.0,
) -> tuple[float, dict[tuple[str, str], float]]:
    """One ring all-reduce of `nbytes` among ranks on the clusters `ring` (in rank order,
    rank r sending to r + 1, as gloo's ring does): 2(R - 1) rounds of 1/R of the bytes, each
    as slow as its slowest edge (half the link's RTT plus the chunk at its bandwidth; an
    edge inside a cluster at its intra bandwidth), plus its fixed cost `overhead_s`. Returns
    the seconds and the bytes each directed WAN link carries. ValueError naming a pair
    without a link."""
    r_count = len(ring)
    if r_count <= 1:
        return 0.0, {}
    chunk = nbytes / r_count
    slowest = 0.0
    wan: dict[tuple[str, str], float] = {}
    for a, b in zip(ring, [*ring[1:], ring[0]], strict=True):
        here, there = clusters[a], clusters[b]
        if a == b:
            slowest = max(slowest, chunk * 8 / (here.intra_bandwidth_gbps * 1e9))
            continue
        slowest = max(
            slowest,
            boundary_latency_s(here, there, links) / 2 + link_seconds(here, there, links, chunk),
        )
        wan[(a, b)] = wan.get((a, b), 0.0) + 2 * (r_count - 1) * chunk
    return 2 * (r_count - 1) * slowest + overhead_s, wan


def estimate_whole_pipelines(
    pipelines: Sequence[Sequence[StageWork]],
    clusters: Mapping[str, Cluster],
    links: Mapping[tuple[str, str], Link],
    micro_batches: int,
    steps: int,
    qos_class: str | None = None,
    micro_overhead_s: float = 0.0,
    schedule: str = "gpipe",
    all_reduce_overhead_s: float = 0.0,
) -> PipelineEstimate:
    """Data parallelism over whole pipeline replicas on clusters of their own (`pipelines`:
    each replica's stages in order, one replica each, the same count): every replica runs
    its share of the batch as `estimate_pipeline` times it, the slowest sets the step, then
    each stage's replicas all-reduce its gradients over the WAN between their clusters
    (`wan_ring_all_reduce_s`, the stages in parallel: the slowest). ValueError as
    `estimate_pipeline`, and for replicas of unequal depth."""
    if not pipelines:
        raise ValueError("pipelines: give at least one")
    depth = len(pipelines[0])
    if any(len(p) != depth for p in pipelines):
        raise ValueError("pipelines: every replica needs the same number of stages")
    each = [
        estimate_pipeline(
            p, clusters, links, micro_batches, steps, qos_class,
            micro_overhead_s=micro_overhead_s, schedule=schedule,
            all_reduce_overhead_s=all_reduce_overhead_s,
        )
        for p in pipelines
    ]  # fmt: skip
    if len(pipelines) == 1:
        return each[0]
    sync = 0.0
    wan: dict[tuple[str, str], float] = {}
    for e in each:
        for a, b, n in e.wan_bytes_per_step:
            wan[(a, b)] = wan.get((a, b), 0.0) + n
    for s in range(depth):
        ring = [p[s].cluster for p in pipelines]
        took, moved = wan_ring_all_reduce_s(
            pipelines[0][s].grad_bytes, ring, clusters, links, all_reduce_overhead_s
        )
        sync = max(sync, took)
        for edge, n in moved.items():
            wan[edge] = wan.get(edge, 0.0) + n
    slowest = max(each, key=lambda e: e.step_s)
    step_s = slowest.step_s + sync
    total = step_s * steps
    gpu_cost, egress = _costs(pipelines, clusters, links, wan, steps, total, qos_class)
    return replace(
        slowest,
        step_s=step_s,
        sync_s=sync,
        total_time_s=total,
        wan_bytes_per_step=tuple((a, b, n) for (a, b), n in sorted(wan.items())),
        gpu_cost=gpu_cost,
        egress_cost=egress,
    )


def slot_seconds(
    busy: Sequence[float], transfers: Sequence[float], latency_s: float, fixed_s: float = 0.0
) -> float:
    """A 1F1B slot: the slowest stage's micro-batch (`busy`, forward and backward) or link
    transfer (activations one way while gradients go the other), at least a micro-batch's
    round trip (every stage, each transfer both ways, the boundaries' RTTs) over the S
    micro-batches it keeps in flight; plus a micro-batch's fixed cost `fixed_s`, whichever
    bounds the slot. (GPipe's step is `schedule_seconds`'.)"""
    trip = (sum(busy) + 2 * sum(transfers) + latency_s) / len(busy)
    slot = max(*busy, *transfers, trip)
    return slot + fixed_s


FORWARD_SHARE = 1 / 3
"""A stage's forward pass's share of its micro-batch's work (backward costs twice as much)."""


def schedule_seconds(
    busy: Sequence[float],
    transfers: Sequence[float],
    latency_s: float,
    schedule: str,
    micro_batches: int,
    fixed_s: float = 0.0,
) -> float:
    """A step's schedule, its gradient sync aside: the boundaries' RTTs once, a micro-batch's
    fixed cost `fixed_s` on each of the M + S - 1 slots, and the passes. 1F1B: M + S - 1
    slots (`slot_seconds`). GPipe runs every forward, then every backward: each phase is a
    pipeline over the stages and the links between them (a link's transfer one way in each
    phase, activations then gradients), one micro-batch through every element plus M - 1
    of the slowest; a stage's forward is `FORWARD_SHARE` of its `busy`."""
    m, s_count = micro_batches, len(busy)
    if schedule == "1f1b":
        return (m + s_count - 1) * slot_seconds(busy, transfers, latency_s, fixed_s) + latency_s

    def phase(share: float) -> float:
        elements = [b * share for b in busy] + list(transfers)
        return sum(elements) + (m - 1) * max(elements)

    passes = phase(FORWARD_SHARE) + phase(1 - FORWARD_SHARE)
    return passes + (m + s_count - 1) * fixed_s + latency_s


def fit_micro_overhead(
    measured_step_s: float, planned_step_s: float, micro_batches: int, stages: int, counted: float
) -> float:
    """One run's sample of a micro-batch's fixed cost: its measured step over the schedule's
    (M + S - 1) slots, less the slot its estimate gave without the cost it `counted` (may be
    negative: the caller takes a median and floors it)."""
    slots = micro_batches + stages - 1
    return measured_step_s / slots - (planned_step_s / slots - counted)


def best_micro_batches(
    stage_step_s: Sequence[tuple[str, float, float, int]],
    clusters: Mapping[str, Cluster],
    links: Mapping[tuple[str, str], Link],
    batch: int,
    micro_overhead_s: float,
    schedule: str = "gpipe",
) -> int:
    """The micro-batch count of the shortest step: `stage_step_s` is, per stage in order,
    (cluster, forward and backward of the whole step's batch on one of its GPUs, activation
    bytes of the whole batch to the next stage, GPUs); each of M micro-batches takes 1/M of
    both. Ties go to fewer micro-batches (less to keep in flight). ValueError as
    `estimate_pipeline`'s."""
    best: tuple[float, int] | None = None
    for m in micro_batch_candidates(batch, len(stage_step_s)):
        work = [StageWork(c, step_s / m, sent / m, gpus) for c, step_s, sent, gpus in stage_step_s]
        got = estimate_pipeline(
            work, clusters, links, m, 1, micro_overhead_s=micro_overhead_s, schedule=schedule
        )
        if best is None or got.step_s < best[0] * (1 - 1e-9):
            best = (got.step_s, m)
    assert best is not None  # 1 is always a candidate
    return best[1]
