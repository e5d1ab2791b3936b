"""Building the plan (`wire.plan`) a job runs: its parallelism, its pipeline's estimate, and
the plan from the planner's result.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress

import scheduler
from controller.values.tasks import builtin_work, layer_facts
from grammar.graph import tree_degrees
from grammar.parallel import parse_stages
from scheduler.bandwidth import wan_rate_kbps
from scheduler.gpus import DEFAULT_EFFICIENCY
from scheduler.memory import Layer, ModelProfile, gpu_memory_bytes, memory, split_widths
from scheduler.pipeline_cost import (
    TENSOR_ALL_REDUCES_PER_BLOCK,
    StageWork,
    best_micro_batches,
    estimate_whole_pipelines,
    tensor_collective_s,
)
from training.pipeline.split import Placement, place
from wire.plan import (
    BandwidthCharge,
    EgressCharge,
    GpuCharge,
    JobPlan,
    Parallel,
    PlanEstimate,
    PlannedLink,
    PriceBreakdown,
    Share,
    StageShare,
)
from wire.spec import JobSpec


def keep_stages(clusters: Mapping[str, int], stages: int) -> Placement | None:
    """`stages` stages over `clusters` (in their order, consecutive stages together, several
    on one cluster when it has the GPUs), every stage with the most replicas the clusters'
    GPUs allow it equally; None when they have fewer GPUs than stages.

    What a pipeline or hybrid placed again (a lost cluster, a retry, a preemption) runs: its
    stage count, hence its layer split, stays as it was. Its stage checkpoints are shards of
    that split (`training.pipeline.checkpoint` refuses any other), and each stage's memory,
    which fitted its GPU, stays the same; fewer, larger stages might fit no GPU at all."""
    total = sum(clusters.values())
    for width in range(total // stages, 0, -1):
        slots = [c for c, n in clusters.items() for _ in range(n // width)]
        if len(slots) >= stages:
            return Placement(tuple(slots[:stages]), width)
    return None


def parallel_of(
    spec: JobSpec,
    shares: tuple[Share, ...],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    keep: int | None = None,
) -> Parallel:
    """The parallelism of a job on `shares`: the spec's when it fixes one; under `auto`, the
    memory model's (`scheduler.memory`): data parallel when the whole model (parameters,
    gradients, Adam state) fits one GPU of some share, else, of every split width its layers
    allow (`_widths`) and stage count whose stages fit the smallest GPU, the pipeline, hybrid
    (replicas inside each stage's cluster, or whole pipelines across clusters), tensor
    parallel (one stage split over one cluster's GPUs) or 3D the pipeline estimate times
    shortest (`_weighed`). A hybrid whose shares cannot give every stage equal replicas,
    either way, runs as a pipeline of one stage a GPU.

    `keep`: the stage count of the job's earlier pipeline or hybrid plan. A job placed again
    keeps it (`keep_stages`), on however many clusters it lands, so its run resumes from
    its stage checkpoints instead of failing on a split they do not match."""
    params = spec.work.params if spec.work is not None else builtin_work(spec.task).params
    whole = memory(ModelProfile((Layer("model", params, 0.0, 0.0, 0.0),)), 0, 1, 1, 1).total
    names = {origin: name for name, origin in origins.items()}
    gpu: dict[str, float] = {}
    for s in shares:
        c = snapshot.by_name.get(names.get((s.cluster, s.gpu_model or ""), s.cluster))
        if c is not None:
            with suppress(ValueError):  # a GPU model of unknown memory: no memory verdict
                gpu[s.cluster] = round(gpu_memory_bytes(c) / 1e9, 3)
    model_gb = round(whole / 1e9, 6)
    mode: str = spec.parallelism  # "split": auto, for a model no GPU holds
    reason = f"the spec asks for {mode} parallelism"
    if mode == "auto" and keep:
        mode = "split"
        reason = f"its earlier plan split it into {keep} stages"
    elif mode == "auto":
        fits = [c for c, gb in gpu.items() if whole <= gb * 1e9]
        gpus = sum(s.gpus for s in shares)
        if fits or len(gpu) < len(shares) or gpus < 2:
            mode = "data"
            reason = (
                f"the whole model needs {model_gb:.3g} GB a GPU, which fits "
                f"{', '.join(fits) or 'no known GPU model'}: data parallel moves no activations"
            )
        else:
            mode = "split"
            reason = (
                f"the whole model needs {model_gb:.3g} GB a GPU, more than the largest "
                f"({max(gpu.values()):.3g} GB usable)"
            )
    clusters: dict[str, int] = {}
    for s in shares:
        clusters[s.cluster] = clusters.get(s.cluster, 0) + s.gpus
    if mode == "tensor" and len(clusters) > 1:  # a plan placed before the one-cluster rule
        mode = "data"
        reason += f"; its GPUs are on {len(clusters)} clusters, which a split never spans"
    if mode == "data":
        return Parallel(mode="data", model_gb=model_gb, gpu_gb=gpu, reason=reason)
    where: Where = (shares, snapshot, origins)
    if mode == "split":  # auto: every split, depth and layout that fits
        return _weighed(spec, clusters, whole, keep, where, (model_gb, gpu, reason))
    tensor = spec.tensor or (sum(clusters.values()) if mode == "tensor" else 1)
    if any(n % tensor for n in clusters.values()):
        reason += f"; its layers whole, since the shares {clusters} do not make groups of {tensor}"
        tensor = 1
    groups = {c: n // tensor for c, n in clusters.items()}  # a stage replica each
    split = parse_stages(spec.pipeline.stages) if spec.pipeline.stages is not None else None
    layout = keep_stages(groups, keep) if keep and mode != "tensor" else None
    if mode == "tensor":
        (only,) = groups.items()
        layout = Placement((only[0],), only[1])
        reason += (
            f"; each layer split over {tensor} GPU(s) of {only[0]}, {only[1]} data-parallel "
            "group(s)"
        )
    elif layout is not None:
        mode = "hybrid" if layout.replicas > 1 else "pipeline"
        reason += _kept(keep, layout)
    else:
        return _staged(spec, groups, split.count if split else None, mode, tensor, where,
                       (model_gb, gpu, reason))  # fmt: skip
    return _parallel(spec, layout, mode, tensor, where, (model_gb, gpu, reason))


def _kept(keep: int | None, layout: Placement) -> str:
    return (
        f"; keeps its {keep} stages ({layout.replicas} replica(s) each, several on a "
        "cluster where needed), so the run resumes from its stage checkpoints"
    )


def _widths(spec: JobSpec, clusters: Mapping[str, int]) -> list[int]:
    """The tensor split widths `auto` weighs: those `cpn plan` weighs (`split_widths`, over
    the blocks' heads `layer_facts` knows) that make whole groups of every cluster's share (a
    split never crosses the WAN); 1 alone where the blocks are not known."""
    facts = layer_facts(spec)
    heads = [facts.heads] if facts.blocks else []
    widths = split_widths(heads, max(clusters.values()))
    return [t for t in widths if all(n % t == 0 for n in clusters.values())]


def _weighed(
    spec: JobSpec,
    clusters: Mapping[str, int],
    whole: float,
    keep: int | None,
    where: Where,
    about: tuple[float, dict[str, float], str],
) -> Parallel:
    """`auto`'s layout of a model no GPU of its shares holds: of every split width `_widths`
    allows and every depth whose stages fit the smallest GPU (its state spread evenly over a
    stage's GPUs), each layout (`place`, whole pipelines, and on one cluster one stage split
    over its GPUs: tensor parallel), the one the pipeline estimate times shortest
    (`_fastest`). `keep`: the stage count of its earlier plan, the only depth weighed (its
    stage checkpoints are shards of that split; a split's shards are whole layers, so the
    width may change)."""
    model_gb, gpu, reason = about
    least = min(gpu.values()) * 1e9
    found: list[tuple[Placement, int]] = []
    spare: list[tuple[Placement, int]] = []  # kept depths whose stages fit no GPU
    for t in _widths(spec, clusters):
        groups = {c: n // t for c, n in clusters.items()}  # a stage replica each
        if keep:
            laid = keep_stages(groups, keep)
            if laid is not None and (t == 1 or laid.stages > 1 or len(groups) == 1):
                (found if whole / (keep * t) <= least else spare).append((laid, t))
            continue
        total = sum(groups.values())
        for d in (d for d in range(1, total + 1) if whole / (d * t) <= least):
            if d == 1:
                if t > 1 and len(groups) == 1:  # one stage, split over the cluster's GPUs
                    found.append((Placement(tuple(groups), groups[next(iter(groups))]), t))
                continue
            with suppress(ValueError):  # stages the shares cannot give equal replicas
                found.append((place(dict(groups), d, d < total), t))
            found += [(laid, t) for laid in _whole_layouts(groups, d, where)]
    found = found or spare
    if keep and len(found) == 1:
        reason += _kept(keep, found[0][0])
    elif keep and found:  # `_fastest` says which layout
        reason += f"; keeps its {keep} stages, so the run resumes from its stage checkpoints"
    elif keep:  # fewer GPUs than its stages: a pipeline of the default depth
        return _staged(spec, clusters, None, "pipeline", 1, where, (model_gb, gpu, reason))
    # none fits even one GPU a stage: that pipeline still, its memory the run's to find
    found = found or [(place(dict(clusters), None, False), 1)]
    return _fastest(spec, found, where, (model_gb, gpu, reason))


Where = tuple[tuple[Share, ...], scheduler.Snapshot, Mapping[str, tuple[str, str]]]
"""A plan's shares, the snapshot and the snapshot names' origins (what estimates read)."""


def _staged(
    spec: JobSpec,
    groups: Mapping[str, int],
    stages: int | None,
    mode: str,
    tensor: int,
    where: Where,
    about: tuple[float, dict[str, float], str],
) -> Parallel:
    """A pipeline's or hybrid's layout placed afresh: `stages` (None: the default count) over
    the stage replicas `groups`; a hybrid weighs its replicas inside each stage's cluster
    against whole pipeline replicas across clusters (`_fastest_hybrid`), and one the shares
    cannot lay out either way runs as a pipeline of one stage a replica."""
    model_gb, gpu, reason = about
    inside: Placement | None = None
    try:
        inside = place(dict(groups), stages, mode == "hybrid")
    except ValueError as exc:  # hybrid's equal widths not met by these shares
        if mode != "hybrid" or not _whole_layouts(groups, stages, where):
            inside, mode = place(dict(groups), None, False), "pipeline"
            reason += f"; as a pipeline of one stage a replica, since {exc}"
    if tensor > 1:
        reason += f"; each stage's layers split over {tensor} GPUs of its cluster (3D)"
    if mode == "hybrid":
        return _fastest_hybrid(spec, inside, groups, stages, tensor, where, (model_gb, gpu, reason))
    assert inside is not None
    return _parallel(spec, inside, mode, tensor, where, (model_gb, gpu, reason))


WHOLE_ORDERS_MAX = 4
"""Up to this many clusters, whole pipelines are weighed in every order of the clusters
(which clusters make a replica, which holds its first stage); above, in the shares' order
and in each chain that goes on from a cluster to the one it has the fastest link to
(`_chains`: consecutive clusters of an order make a replica, so its activations take fast
links)."""


def _snapshot_names(
    clusters: Iterable[str], shares: Sequence[Share], origins: Mapping[str, tuple[str, str]]
) -> dict[str, str]:
    """Each of `clusters` (a share's cluster) by its name in the snapshot (its GPU model's
    part of it), or its own where the snapshot has none."""
    names = {origin: name for name, origin in origins.items()}
    model = {s.cluster: s.gpu_model or "" for s in shares}
    return {c: names.get((c, model.get(c, "")), c) for c in clusters}


def _chains(clusters: Sequence[str], where: Where) -> list[tuple[str, ...]]:
    """From each of `clusters` (share names), the order that always goes on to the unvisited
    cluster with the fastest link from the last (ties: the shares' order; no link: last)."""
    shares, snapshot, origins = where
    snap = _snapshot_names(clusters, shares, origins)

    def gbps(a: str, b: str) -> float:
        there = snapshot.link(snap[a], snap[b]) or snapshot.link(snap[b], snap[a])
        return there.bandwidth_gbps if there is not None else 0.0

    out = []
    for first in clusters:
        order, left = [first], [c for c in clusters if c != first]
        while left:
            nxt = max(left, key=lambda c: gbps(order[-1], c))  # max keeps the first of ties
            order.append(nxt)
            left.remove(nxt)
        out.append(tuple(order))
    return out


def _whole_layouts(groups: Mapping[str, int], stages: int | None, where: Where) -> list[Placement]:
    """Hybrids of whole pipeline replicas on clusters of their own (`place(whole=True)`) the
    stage replicas `groups` make: `stages` deep, or every depth that leaves two replicas or
    more, in the orders `WHOLE_ORDERS_MAX` names; only those whose replicas of a stage are
    not all in one cluster, each set of replicas once."""
    total = sum(groups.values())
    depths = [stages] if stages else [d for d in range(2, total // 2 + 1) if total % d == 0]
    orders: Iterable[tuple[str, ...]] = (
        itertools.permutations(groups)
        if len(groups) <= WHOLE_ORDERS_MAX
        else [tuple(groups), *_chains(list(groups), where)]
    )
    out: dict[tuple[tuple[str, ...], ...], Placement] = {}
    for order in orders:
        for d in depths:
            if d is None or d < 1 or total % d or total // d < 2:
                continue
            laid = place({c: groups[c] for c in order}, d, True, whole=True)
            if any(len(set(laid.replica_clusters(s))) > 1 for s in range(laid.stages)):
                out.setdefault(tuple(sorted(laid.pipelines)), laid)
    return list(out.values())


def _fastest_hybrid(
    spec: JobSpec,
    inside: Placement | None,
    groups: Mapping[str, int],
    stages: int | None,
    tensor: int,
    where: Where,
    about: tuple[float, dict[str, float], str],
) -> Parallel:
    """A hybrid's layout: replicas of each stage inside its cluster (`inside`, when the shares
    allow it) or whole pipeline replicas on clusters of their own (`_fastest`)."""
    layouts = ([inside] if inside is not None else []) + _whole_layouts(groups, stages, where)
    return _fastest(spec, [(laid, tensor) for laid in layouts], where, about)


def _fastest(
    spec: JobSpec,
    layouts: Sequence[tuple[Placement, int]],
    where: Where,
    about: tuple[float, dict[str, float], str],
) -> Parallel:
    """Of `layouts` (each with its split width: one stage split, tensor parallel; else a
    pipeline where one replica, else a hybrid, 3D where split), the one the pipeline
    estimate times shortest a step, of equal steps (to three digits) the one moving fewer
    WAN bytes, then the narrower split; the first where no estimate can be made. The reason
    names the others."""
    found = [_parallel(spec, laid, _mode(laid, t), t, where, about) for laid, t in layouts]
    timed = []
    for par in found:
        est = pipeline_estimate(spec, par, where[0], where[1], where[2], "standard")
        step, moved = (est[0].step_time_s, est[0].wan_bytes) if est is not None else (math.inf, 0)
        # equal steps to three digits: the fewer WAN bytes (less egress, more room on links)
        timed.append(((float(f"{step:.3g}"), moved, par.tensor), step, par))
    _, best_s, best = min(timed, key=lambda x: x[0])
    if best_s == math.inf:
        best = found[0]
    if len(found) < 2:
        return best
    others = [f"{_layout_text(par)} {step:.4g} s" for _, step, par in timed if par is not best]
    return best.model_copy(
        update={
            "reason": best.reason
            + f"; {_layout_text(best)}, step {best_s:.4g} s (weighed: {', '.join(others)})"
        }
    )


def _mode(laid: Placement, tensor: int) -> str:
    if tensor > 1 and laid.stages == 1:
        return "tensor"
    return "hybrid" if laid.replicas > 1 else "pipeline"


def _layout_text(par: Parallel) -> str:
    """How a plan's stages, replicas and splits lie, in a few words."""
    first = par.stages[0]
    if par.mode == "tensor":
        where = f"{first.cluster} ({first.replicas} group(s))"
        return f"each layer split over {par.tensor} GPUs of {where}"
    split = f", each split over {par.tensor} GPUs (3D)" if par.tensor > 1 else ""
    if first.replicas == 1:
        return f"a pipeline of {len(par.stages)} stages, one a {'group' if split else 'GPU'}{split}"
    if first.replica_clusters:
        rows = zip(*(st.replica_clusters for st in par.stages), strict=True)
        lines = "; ".join(" -> ".join(r) for r in rows)
        return f"{first.replicas} whole pipelines ({lines}){split}"
    return f"{len(par.stages)} stages of {first.replicas} replicas inside their clusters{split}"


def _parallel(
    spec: JobSpec,
    layout: Placement,
    mode: str,
    tensor: int,
    where: Where,
    about: tuple[float, dict[str, float], str],
) -> Parallel:
    """The plan's parallelism for a chosen `layout`: its stages, micro-batches and costs."""
    shares, snapshot, origins = where
    model_gb, gpu, reason = about
    stages = tuple(
        StageShare(
            cluster=c,
            replicas=layout.replicas,
            replica_clusters=layout.replica_clusters(s) if layout.pipelines else (),
        )
        for s, c in enumerate(layout.stage_clusters)
    )
    micro = spec.pipeline.micro_batches
    if micro is None:
        micro, why = _micro_batches(spec, stages, shares, snapshot, origins, tensor)
        reason += f"; {micro} micro-batch{'es' if micro > 1 else ''} a step: {why}"
    blocks = layer_facts(spec).blocks
    split_known = tensor > 1 and blocks > 0
    inside = layout.replicas > 1 and not layout.pipelines  # an all-reduce inside a cluster
    return Parallel(
        mode="tensor" if mode == "tensor" else "hybrid" if mode == "hybrid" else "pipeline",
        stages=stages,
        tensor=tensor,
        micro_batches=micro,
        micro_overhead_s=snapshot.micro_overhead_s,
        all_reduce_overhead_s=(
            snapshot.all_reduce_overhead_s if tensor > 1 or layout.replicas > 1 else None
        ),
        all_reduces=(
            TENSOR_ALL_REDUCES_PER_BLOCK * micro * math.ceil(blocks / len(stages))
            + (1 if inside else 0)
            if split_known
            else None
        ),
        bubble=round((len(stages) - 1) / (micro + len(stages) - 1), 6),
        model_gb=model_gb,
        gpu_gb=gpu,
        reason=reason,
    )


MICRO_BATCHES_FALLBACK = 4
"""A pipeline's micro-batches when the planner cannot weigh them (a stage's cluster or a link
missing from the snapshot)."""


def micro_batches_of(parallel: Parallel, spec: JobSpec) -> int:
    """The micro-batches a pipeline plan runs: the plan's, else the spec's, else the fallback
    (plans stored before the planner chose them)."""
    return parallel.micro_batches or spec.pipeline.micro_batches or MICRO_BATCHES_FALLBACK


def _rows(stages: Sequence[StageShare]) -> list[tuple[StageShare, ...]]:
    """Each whole pipeline replica's stages, one replica each, on its own clusters; or the
    stages as they are (one row) where every replica is in its stage's cluster."""
    if not stages or not stages[0].replica_clusters:
        return [tuple(stages)]
    return [
        tuple(StageShare(cluster=st.replica_clusters[r]) for st in stages)
        for r in range(stages[0].replicas)
    ]


def _micro_batches(
    spec: JobSpec,
    stages: Sequence[StageShare],
    shares: Sequence[Share],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    tensor: int = 1,
) -> tuple[int, str]:
    """The planner's micro-batch count (`scheduler.pipeline_cost.best_micro_batches`) and
    why; the fallback where the stages cannot be estimated. Whole pipeline replicas: weighed
    on the first replica's pipeline, with its share of the batch."""
    rows = _rows(stages)
    loads = _stage_loads(spec, rows[0], shares, snapshot, origins, tensor, len(rows))
    if loads is None:
        return MICRO_BATCHES_FALLBACK, "the stages' clusters or links are not all known"
    batch, _ = _batch_and_activations(spec)
    if spec.work is not None and spec.args.batch_size is None:  # its own work, batch unsaid
        return MICRO_BATCHES_FALLBACK, (
            "its batch is not known (args.batch_size would let the planner weigh them)"
        )
    try:
        m = best_micro_batches(
            loads,
            snapshot.by_name,
            snapshot.directed_links,
            max(1, batch // len(rows)),
            snapshot.micro_overhead_s,
            spec.pipeline.schedule,
        )
    except ValueError:  # no link between two stages' clusters
        return MICRO_BATCHES_FALLBACK, "no link between two stages' clusters"
    return m, (
        f"the shortest step, weighing the bubble against a micro-batch's fixed cost of "
        f"{snapshot.micro_overhead_s * 1e3:.3g} ms"
    )


def _batch_and_activations(spec: JobSpec) -> tuple[int, float]:
    """The global batch (1 where unknown: declared work, no `args.batch_size`) and a sample's
    activation bytes at a stage boundary (0: unknown, declared work that does not say)."""
    act = layer_facts(spec).activation_bytes
    batch = spec.args.batch_size or (builtin_work(spec.task).batch_size if spec.work is None else 1)
    return batch, float(act)


def _stage_loads(
    spec: JobSpec,
    stages: Sequence[StageShare],
    shares: Sequence[Share],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    tensor: int = 1,
    pipelines: int = 1,
) -> list[tuple[str, float, float, int]] | None:
    """Per stage, in order: (the snapshot's cluster name, its GPUs' forward and backward of
    the whole step, activation bytes of the whole batch to the next stage, GPUs). The stages
    share the step's work evenly, each replica 1/R of it, each of a replica's T tensor-parallel
    GPUs 1/T of that plus its blocks' all-reduces (`tensor_collective_s`; a task of the
    tenant's own has no blocks known); `stages` as one of `pipelines` whole pipeline
    replicas, 1/`pipelines` of the batch. None when a stage's cluster is not in the
    snapshot."""
    snap = _snapshot_names([st.cluster for st in stages], shares, origins)
    if any(n not in snapshot.by_name for n in snap.values()):
        return None
    whole_batch, act = _batch_and_activations(spec)
    batch = whole_batch / pipelines  # this pipeline's share of the batch
    s_count = len(stages)
    blocks = layer_facts(spec).blocks / s_count
    out = []
    for i, st in enumerate(stages):
        c = snapshot.by_name[snap[st.cluster]]
        split = tensor_collective_s(
            act * batch / st.replicas,
            blocks,
            tensor,
            c.intra_bandwidth_gbps,
            snapshot.all_reduce_overhead_s,
        )
        out.append(
            (
                snap[st.cluster],
                _step_s(spec, c) / (s_count * st.replicas * tensor * pipelines) + split,
                0.0 if i == s_count - 1 else act * batch,
                st.replicas * tensor,
            )
        )
    return out


def _step_s(spec: JobSpec, c: scheduler.Cluster) -> float:
    """Seconds one GPU of `c` takes for a whole step (the global batch, forward and back)."""
    work = spec.work
    if work is not None and work.step_time_s_ref is not None:
        ref = scheduler.peak_tflops(work.ref_gpu or "") or c.peak_tflops
        return work.step_time_s_ref * ref / c.peak_tflops
    flops = (work.flops_per_step if work else None) or builtin_work(spec.task).flops_per_step
    return flops / (c.peak_tflops * 1e12 * (c.efficiency or DEFAULT_EFFICIENCY))


def pipeline_estimate(
    spec: JobSpec,
    parallel: Parallel,
    shares: Sequence[Share],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    qos_class: str,
) -> tuple[PlanEstimate, PriceBreakdown, str] | None:
    """A pipeline or hybrid plan's time, WAN bytes and price (`scheduler.pipeline_cost`), so
    the stored plan is the one that runs, not the data-parallel estimate of its GPUs; with
    the line that says how it was made. None for data parallelism, or when a stage's cluster
    or a link between stages is not in the snapshot.

    The control plane knows a task's parameters and FLOPs and a few facts of its layers
    (`layer_facts`), not the layers: the stages share the step's work evenly, each of a
    stage's R replicas does 1/R of it, in M micro-batches; a boundary carries the task's
    activation bytes a sample (declared work that does not give them: the WAN term is left
    out)."""
    if parallel.mode == "data" or not parallel.stages:
        return None
    first = parallel.stages[0]
    rows = _rows(parallel.stages)
    found = [
        _stage_loads(spec, row, shares, snapshot, origins, parallel.tensor, len(rows))
        for row in rows
    ]
    if any(loads is None for loads in found):
        return None
    s_count, micro = len(parallel.stages), micro_batches_of(parallel, spec)
    _, act = _batch_and_activations(spec)
    params = spec.work.params if spec.work is not None else builtin_work(spec.task).params
    # each stage's replicas all-reduce its share of the gradients (each part of a split its own)
    grads = 4.0 * params / (s_count * parallel.tensor)
    work = [
        [
            StageWork(c, step_s / micro, sent / micro, gpus, st.replicas, grads)
            for (c, step_s, sent, gpus), st in zip(loads or [], row, strict=True)
        ]
        for loads, row in zip(found, rows, strict=True)
    ]
    overhead = snapshot.micro_overhead_s
    try:
        est = estimate_whole_pipelines(
            work,
            snapshot.by_name,
            snapshot.directed_links,
            micro,
            spec.steps,
            qos_class,
            micro_overhead_s=overhead,
            schedule=spec.pipeline.schedule,
            all_reduce_overhead_s=snapshot.all_reduce_overhead_s,
        )
    except ValueError:  # no link between two stages' clusters
        return None
    snap = {
        st.cluster: w.cluster
        for row, ws in zip(rows, work, strict=True)
        for st, w in zip(row, ws, strict=True)
    }
    real = {name: origin[0] for name, origin in origins.items()}
    per_step = sum(n for _, _, n in est.wan_bytes_per_step)
    # the run's set-up on its stages' clusters, as the data-parallel estimate counts it
    gpus: dict[str, int] = {}
    for ws in work:
        for w in ws:
            gpus[w.cluster] = gpus.get(w.cluster, 0) + w.gpus
    setup = scheduler.setup_of(snapshot, snap.values(), sum(gpus.values()))
    total_s = est.total_time_s + setup
    hours = total_s / 3600
    gpu = tuple(
        GpuCharge(
            cluster=real.get(n, n),
            gpu_model=origins.get(n, (n, None))[1],
            gpus=k,
            gpu_hours=round(k * hours, 6),
            price_per_gpu_hour=snapshot.by_name[n].price(qos_class),
            amount=round(k * hours * snapshot.by_name[n].price(qos_class), 6),
            provider=snapshot.by_name[n].provider,
        )
        for n, k in gpus.items()
    )
    egress = []
    for a, b, nbytes in est.wan_bytes_per_step:
        link = snapshot.link(a, b)
        price_gb = link.egress_price_per_gb if link else 0.0
        gb = nbytes * est.steps / 1e9
        egress.append(
            EgressCharge(src=real.get(a, a), dst=real.get(b, b), gb=round(gb, 9),
                         price_per_gb=price_gb, amount=round(gb * price_gb, 6),
                         provider=_party(snapshot, a))
        )  # fmt: skip
    compute = max(w.compute_s for ws in work for w in ws) + overhead
    across = est.sync_s if first.replica_clusters else 0.0  # the gradients' WAN all-reduce
    cost = sum(g.amount for g in gpu) + sum(e.amount for e in egress)
    estimate = PlanEstimate(
        step_time_s=est.step_s,
        total_time_s=total_s,
        wan_bytes=round(est.wan_bytes),
        cost=round(cost, 6),
        setup_s=setup,
        total_time_range_s=(total_s * snapshot.spread[0], total_s * snapshot.spread[1]),
        compute_s=compute * (micro + s_count - 1),
        wan_s=max(est.link_s, default=0.0) * (micro + s_count - 1) + est.latency_s + across,
        effective_steps=float(spec.steps),
    )
    why = (
        f"priced as a {parallel.mode} of {s_count} stages: step {est.step_s:.4g} s "
        f"({micro + s_count - 1} x the slowest stage or link, {est.bottleneck_s:.4g} s, a "
        f"micro-batch's fixed {overhead * 1e3:.3g} ms{_prior(snapshot, 'micro_overhead_s')} "
        f"included, and the links' latency once, {est.latency_s:.4g} s), "
        f"{per_step / 1e6:.4g} MB of activations and gradients over the WAN a step"
        + ("" if act else " (activation size unknown: WAN not counted)")
        + (
            f"; then each stage's gradients all-reduce over the WAN between its "
            f"{first.replicas} whole pipelines' clusters, {across:.4g} s"
            if across
            else ""
        )
        + (
            f"; an all-reduce inside a cluster costs {snapshot.all_reduce_overhead_s * 1e3:.3g} "
            f"ms beyond its bytes{_prior(snapshot, 'all_reduce_overhead_s')}"
            if parallel.tensor > 1 or any(st.replicas > 1 for st in parallel.stages)
            else ""
        )
    )
    return estimate, PriceBreakdown(total=round(cost, 6), gpu=gpu, egress=tuple(egress)), why


def _prior(snapshot: scheduler.Snapshot, cost: str) -> str:
    """What a plan says of a fitted cost no finished run has measured yet."""
    return " (a prior: no run has measured it yet)" if cost in snapshot.priors else ""


def _party(snapshot: scheduler.Snapshot, name: str) -> str | None:
    """The provider of the cluster `name` (the snapshot's), whose uplink egress leaves by."""
    cluster = snapshot.by_name.get(name)
    return cluster.provider if cluster is not None else None


def as_billed(
    estimate: PlanEstimate,
    breakdown: PriceBreakdown,
    shares: Sequence[Share],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    included: float = 0.0,
) -> tuple[PlanEstimate, PriceBreakdown, dict[str, int]]:
    """A plan's estimate and price as metering will bill its run: each GPU line at least its
    offer's minimum term, and the WAN rate it reserves on each cluster's ports (returned,
    as the placement reserves it) at their bandwidth prices. Every plan passes here: a new
    one (`plan_of`) and a re-staged one (`loop.restage`)."""

    def origin(name: str) -> tuple[str, str | None]:
        return origins.get(name, (name, None))

    estimate, breakdown = _with_minimum_terms(estimate, breakdown, snapshot, origin)
    reserved = wan_kbps(estimate, shares)
    estimate, breakdown = _with_bandwidth(estimate, breakdown, reserved, snapshot, origin, included)
    return estimate, breakdown, reserved


def _with_minimum_terms(
    estimate: PlanEstimate,
    breakdown: PriceBreakdown,
    snapshot: scheduler.Snapshot,
    origin: Callable[[str], tuple[str, str | None]],
) -> tuple[PlanEstimate, PriceBreakdown]:
    """The price with each GPU line billed at least its offer's minimum term (`min_hours` of
    each GPU), as metering bills a shorter run (`metering.meter_minimum_terms`)."""
    terms = {origin(c.name): c.min_hours for c in snapshot.clusters if c.min_hours > 0}
    if not terms:
        return estimate, breakdown
    lines, extra = [], 0.0
    for g in breakdown.gpu:
        least = g.gpus * terms.get((g.cluster, g.gpu_model), 0.0)
        if g.gpu_hours < least:
            amount = round(least * g.price_per_gpu_hour, 6)
            extra += amount - g.amount
            g = g.model_copy(update={"gpu_hours": round(least, 6), "amount": amount})
        lines.append(g)
    if not extra:
        return estimate, breakdown
    return (
        estimate.model_copy(update={"cost": round((estimate.cost or 0.0) + extra, 6)}),
        breakdown.model_copy(
            update={"total": round(breakdown.total + extra, 6), "gpu": tuple(lines)}
        ),
    )


def _with_bandwidth(
    estimate: PlanEstimate,
    breakdown: PriceBreakdown,
    reserved: Mapping[str, int],
    snapshot: scheduler.Snapshot,
    origin: Callable[[str], tuple[str, str | None]],
    included: float = 0.0,
) -> tuple[PlanEstimate, PriceBreakdown]:
    """The estimate and price with the WAN rate `reserved` on each cluster's ports (the
    kbit/s the placement takes), held for the whole run at the cluster's bandwidth price, as
    metering bills it; `included`: what the cost model already counted for it (its
    `reserved_cost`, which the search weighed), replaced by these lines."""
    by_cluster = {origin(c.name)[0]: c for c in snapshot.clusters}
    hours = estimate.total_time_s / 3600
    lines = []
    for name, kbps in sorted(reserved.items()):
        c = by_cluster.get(name)
        if c is None or c.bandwidth_price_per_gbps_hour <= 0 or kbps <= 0:
            continue
        gbps = kbps / 1e6
        lines.append(
            BandwidthCharge(
                cluster=name,
                gbps=gbps,
                hours=round(hours, 6),
                price_per_gbps_hour=c.bandwidth_price_per_gbps_hour,
                amount=round(gbps * hours * c.bandwidth_price_per_gbps_hour, 6),
                provider=c.provider,
            )
        )
    if not lines and not included:
        return estimate, breakdown
    extra = sum(b.amount for b in lines) - included
    cost = round((estimate.cost or 0.0) + extra, 6)
    return (
        estimate.model_copy(update={"cost": cost}),
        breakdown.model_copy(
            update={"total": round(breakdown.total + extra, 6), "bandwidth": tuple(lines)}
        ),
    )


def wan_kbps(estimate: PlanEstimate, shares: Sequence[Share]) -> dict[str, int]:
    """What a plan reserves of each of its clusters' ports: its WAN bytes over its steps'
    time, shared by its clusters (by name: a cluster's GPU models share its ports; over a
    tree, by each one's edges), as the estimate the plan states (a pipeline's is its
    stages')."""
    clusters = sorted({s.cluster for s in shares})
    weights = tree_degrees(estimate.tree) if estimate.tree else None
    return wan_rate_kbps(
        estimate.wan_bytes, estimate.total_time_s - estimate.setup_s, clusters, weights
    )


def planned_links(
    snapshot: scheduler.Snapshot,
    names: Sequence[str],
    origin: Callable[[str], tuple[str, str | None]],
    paced: frozenset[str] = frozenset(),
) -> tuple[PlannedLink, ...]:
    """The snapshot's links between the clusters of `names` (snapshot names), one for each
    pair of distinct clusters, in their clusters' names: a cluster offering several GPU
    models is several snapshot names, with no WAN between them."""
    out: dict[tuple[str, str], PlannedLink] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            src, dst = sorted((origin(a)[0], origin(b)[0]))
            if src == dst or (src, dst) in out:
                continue
            shared = src in paced or dst in paced
            both = [k for k in (snapshot.link(a, b), snapshot.link(b, a)) if k is not None]
            # a paced link runs both ways at one bandwidth: the slower direction's share
            link = min(both, key=lambda k: k.bandwidth_gbps) if shared and both else None
            link = link or snapshot.link(a, b) or snapshot.link(b, a)
            if link is not None:
                out[(src, dst)] = PlannedLink(
                    src=src,
                    dst=dst,
                    bandwidth_gbps=link.bandwidth_gbps,
                    rtt_ms=link.rtt_ms,
                    paced=shared,
                )
    return tuple(out[k] for k in sorted(out))


def plan_of(
    result: scheduler.Plan,
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    qos_class: str,
    spec: JobSpec | None = None,
    keep: int | None = None,
    paced: frozenset[str] = frozenset(),
) -> JobPlan:
    """The typed plan of a planner decision, priced by cluster and by WAN link; `paced`: the
    clusters with a declared uplink or downlink (`World.paced`), whose links the run paces.

    `origins` maps the snapshot's cluster names to (cluster, GPU model): a cluster offering
    several GPU models is one scheduler cluster per model. With the job's `spec`, the plan
    records its parallelism (`parallel_of`; `keep`: the stage count of its earlier plan),
    and a pipeline or hybrid is estimated and priced as one (`pipeline_estimate`).
    """
    est = result.estimate
    hours = est.total_time_s / 3600

    def origin(name: str) -> tuple[str, str | None]:
        return origins.get(name, (name, None))

    gpu = []
    shares = []
    for a in result.placement:
        cluster, model = origin(a.cluster)
        planned = snapshot.by_name[a.cluster]
        price = planned.price(qos_class)
        shares.append(Share(cluster=cluster, gpus=a.gpus, gpu_model=model, region=planned.region))
        gpu.append(
            GpuCharge(
                cluster=cluster,
                gpu_model=model,
                gpus=a.gpus,
                gpu_hours=round(a.gpus * hours, 6),
                price_per_gpu_hour=price,
                amount=round(a.gpus * hours * price, 6),
                provider=planned.provider,
            )
        )
    egress = []
    ring = est.ring
    # the links the exchange crosses: the tree's edges both ways, or the ring's
    if len(ring) > 1 and est.wan_bytes:
        edges = [e for c, p in est.tree for e in ((c, p), (p, c))] or [
            *zip(ring, [*ring[1:], ring[0]], strict=True)
        ]
        per_edge = est.wan_bytes / len(edges)
        for a_name, b_name in edges:
            link = snapshot.link(a_name, b_name)
            price_gb = link.egress_price_per_gb if link else 0.0
            egress.append(
                EgressCharge(
                    src=origin(a_name)[0],
                    dst=origin(b_name)[0],
                    gb=round(per_edge / 1e9, 9),
                    price_per_gb=price_gb,
                    amount=round(per_edge / 1e9 * price_gb, 6),
                    provider=_party(snapshot, a_name),
                )
            )
    parallel = (
        Parallel() if spec is None else parallel_of(spec, tuple(shares), snapshot, origins, keep)
    )
    staged = (
        None
        if spec is None
        else pipeline_estimate(spec, parallel, shares, snapshot, origins, qos_class)
    )
    estimate = PlanEstimate(
        step_time_s=est.step_time_s,
        total_time_s=est.total_time_s,
        wan_bytes=est.wan_bytes,
        cost=est.cost,
        compute_s=est.compute_s,
        intra_s=est.intra_s,
        wan_s=est.wan_s,
        overhead_s=est.overhead_s,
        effective_steps=est.effective_steps,
        ring=tuple(dict.fromkeys(origin(n)[0] for n in est.ring)),  # the clusters' own names
        tree={origin(c)[0]: origin(p)[0] for c, p in est.tree},
        batch_shares=_shares_by_cluster(est.batch_shares, origin),
        step_overhead_s=est.step_overhead_s,
        ps_push_s=(
            snapshot.ps_push_s
            if len(result.placement) > 1 and str(result.sync).startswith("async-ps")
            else None
        ),
        relay_ticks=dict(est.relay_ticks),
        setup_s=est.setup_s,
        total_time_range_s=est.total_time_range_s,
        quality_cost=round(est.quality_cost, 6),
    )
    breakdown = PriceBreakdown(total=round(est.cost, 6), gpu=tuple(gpu), egress=tuple(egress))
    explanation = (*result.explanation, *((parallel.reason,) if parallel.mode != "data" else ()))
    workers = sum(a.gpus for a in result.placement)
    crowd = snapshot.crowding(workers)
    if crowd > 1.0:
        explanation = (
            *explanation,
            f"its {workers} workers share one machine's "
            f"{snapshot.host_cores} cores, as finished runs did: each step's compute and "
            f"coding is planned at {crowd:.3g}x their own",
        )
    if estimate.ps_push_s is not None:
        explanation = (
            *explanation,
            f"each tick's push to its parameter server costs {estimate.ps_push_s * crowd * 1e3:.3g}"
            f" ms beyond its WAN bytes{_prior(snapshot, 'ps_push_s')}",
        )
    if estimate.relay_ticks:
        every = ", ".join(f"{r} every {t}" for r, t in sorted(estimate.relay_ticks.items()))
        explanation = (
            *explanation,
            f"each region's server sends its progress to the global one every as many steps "
            f"as one exchange lasts and one more, for its landing: {every}",
        )
    if staged is not None:  # a pipeline: priced as the stages run, not as data parallelism
        estimate, breakdown, why = staged
        explanation = (*explanation, why)
    included = est.bandwidth_cost if staged is None else 0.0  # the model's own, replaced
    estimate, breakdown, reserved = as_billed(
        estimate, breakdown, shares, snapshot, origins, included
    )
    return JobPlan(
        objective=result.objective,
        clusters=tuple(shares),
        links=planned_links(snapshot, [a.cluster for a in result.placement], origin, paced),
        wan_kbps=reserved,
        parallel=parallel,
        compression=result.compression,
        sync=result.sync,
        estimate=estimate,
        price=breakdown,
        explanation=explanation,
    )


def _shares_by_cluster(
    shares: tuple[tuple[str, float], ...], origin: Callable[[str], tuple[str, str | None]]
) -> dict[str, float]:
    """The estimate's batch shares in the clusters' own names (a cluster planned as several
    names sums them)."""
    out: dict[str, float] = {}
    for name, share in shares:
        cluster = origin(name)[0]
        out[cluster] = round(out.get(cluster, 0.0) + share, 9)
    return out
