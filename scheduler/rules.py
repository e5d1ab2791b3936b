"""Admission rules: which clusters a job may use, quotas, fair-share queue order and the
candidates for preemption. Pure functions over snapshots; the optimizer applies them."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from grammar.states import ClusterState
from scheduler.types import JobRequest, Placement, RunningJob, Snapshot


def exclusions(snapshot: Snapshot, job: JobRequest) -> dict[str, str]:
    """Clusters the job may not use, with the rule that excludes each, in cluster order.

    A job without region or data limits is kept out only of the snapshot's `closed` and
    `full` clusters, which reallocated copies keep up to date: a pass over every cluster per
    plan grows with the fleet, and showed in a plan's time at the largest fleets simulated
    (bench/results/sim-summary.md)."""
    if job.qos.regions is None and job.data_clusters is None:
        closed, at = snapshot.closed, snapshot.positions.__getitem__
        names = sorted([*closed, *snapshot.full], key=at)
        return {n: closed.get(n, "no free GPUs") for n in names}
    out: dict[str, str] = {}
    allowed = set(job.qos.regions) if job.qos.regions is not None else None
    for c in snapshot.clusters:
        if c.state == ClusterState.DOWN:
            out[c.name] = "DOWN"
        elif c.cordoned:
            out[c.name] = "cordoned"
        elif allowed is not None and c.region not in allowed:
            out[c.name] = f"region {c.region} not in allowed regions"
        elif job.data_clusters is not None and c.name not in job.data_clusters:
            out[c.name] = "does not hold the job's data (data: local)"
        elif c.gpus_free < 1:
            out[c.name] = "no free GPUs"
    return out


def tenant_usage(running: Iterable[RunningJob]) -> dict[str, int]:
    """GPUs each tenant holds now."""
    usage: dict[str, int] = {}
    for r in running:
        usage[r.tenant] = usage.get(r.tenant, 0) + r.gpus
    return usage


def quota_left(snapshot: Snapshot, tenant: str) -> int | None:
    """GPUs the tenant may still take, or None when it has no quota."""
    quota = snapshot.quota(tenant)
    if quota is None:
        return None
    return max(0, quota - tenant_usage(snapshot.running).get(tenant, 0))


def is_clique(snapshot: Snapshot, names: Sequence[str]) -> bool:
    """Every pair linked: two clusters with no link between them cannot share a job. (Links
    count both ways, `Snapshot.directed_links`; read off the neighbour index, a set lookup a
    pair instead of two calls: the planner asks it of every set it screens.)"""
    near = snapshot.neighbours
    for i, a in enumerate(names):
        linked = near.get(a, frozenset())
        for b in names[i + 1 :]:
            if b not in linked:
                return False
    return True


def preemption_candidates(snapshot: Snapshot, job: JobRequest) -> list[RunningJob]:
    """Running preemptible jobs of strictly lower priority, cheapest to stop first."""
    return sorted(
        (r for r in snapshot.running if r.preemptible and r.priority < job.qos.priority),
        key=lambda r: (preemption_cost(snapshot, r), r.id),
    )


BANDWIDTH_BOUND = frozenset({"links", "deadline"})
"""Why a job may wait for WAN bandwidth: no path between clusters it needs (a full port
leaves none) or none fast enough for its deadline."""

Release = Callable[[Snapshot, Sequence[RunningJob]], Snapshot]
"""The world as it would be once some running jobs stopped (`release`: their GPUs only)."""


def bandwidth_victims(snapshot: Snapshot, job: JobRequest) -> list[RunningJob]:
    """What a job short of bandwidth may preempt: as for GPUs (`preemption_candidates`), of
    the jobs holding a WAN rate; stopping one that holds none frees no path."""
    return [r for r in preemption_candidates(snapshot, job) if any(k for _, k in r.wan_kbps)]


def preemption_cost(snapshot: Snapshot, r: RunningJob) -> float:
    """What stopping `r` loses: its declared cost, else the hourly price of its GPUs."""
    if r.preemption_cost is not None:
        return r.preemption_cost
    return sum(
        a.gpus * snapshot.by_name[a.cluster].price_per_gpu_hour
        for a in r.placement
        if a.cluster in snapshot.by_name
    )


def release(snapshot: Snapshot, victims: Iterable[RunningJob]) -> Snapshot:
    """The snapshot as it would be once `victims` gave their GPUs back (only their clusters
    are rebuilt: `Snapshot.with_free`)."""
    freed: dict[str, int] = {}
    gone = set()
    for v in victims:
        gone.add(v.id)
        for a in v.placement:
            freed[a.cluster] = freed.get(a.cluster, 0) + a.gpus
    return snapshot.with_free(freed, tuple(r for r in snapshot.running if r.id not in gone))


def placement_gpus(placement: Placement) -> int:
    return sum(a.gpus for a in placement)


@dataclass(frozen=True)
class QueuedJob:
    """A pending job as the queue sees it: who asks, how much, how urgent, how long."""

    id: str
    tenant: str
    gpus: int
    priority: int = 0
    submitted_at: float = 0.0
    qos_class: str = "standard"
    run_s: float | None = None
    """Its size: seconds it would compute alone (`scheduler.reference_run_s`); None when
    unknown, counted as `UNKNOWN_RUN_S`."""


UNKNOWN_RUN_S = 3600.0
"""The size the queue assumes for a job whose size it was not told."""


def _lane_key(job: QueuedJob, now: float | None) -> tuple[float, float, str]:
    """A tenant's jobs by highest response ratio, (waited + size) / size, at `now`: short jobs
    pass long ones, and a long job's ratio grows as it waits, so newer ones do not pass it
    forever. Without `now`, by submission."""
    if now is None:
        return (0.0, job.submitted_at, job.id)
    size = job.run_s if job.run_s is not None and job.run_s > 0 else UNKNOWN_RUN_S
    return (-(max(0.0, now - job.submitted_at) + size) / size, job.submitted_at, job.id)


@dataclass(frozen=True)
class QueueOrder:
    """Jobs in the order to try them, and the ones held back with the reason."""

    order: tuple[QueuedJob, ...]
    held: tuple[tuple[QueuedJob, str], ...]


def order_queue(
    queue: Sequence[QueuedJob],
    usage: Mapping[str, int] | None = None,
    shares: Mapping[str, float] | None = None,
    quotas: Mapping[str, int] | None = None,
    now: float | None = None,
    wan: Mapping[str, int] | None = None,
    totals: tuple[int, int] | None = None,
) -> QueueOrder:
    """Strict priority first; within a priority, dominant-share fairness by progressive filling.

    Each pick goes to the tenant whose dominant share (plus what it was given earlier in this
    ordering) divided by its share (default 1) is lowest, ties by the heads' lane order. With
    `totals` (GPUs, kbit/s of declared uplinks) a tenant's dominant share is the larger of its
    GPUs in use over all GPUs and its reserved WAN rate (`wan`, kbit/s) over all uplinks (DRF
    over both, so a tenant filling the WAN waits behind one holding GPUs); without, its GPUs
    in use. A pick adds its GPUs (its WAN need is known once planned). A
    tenant's own jobs go by response ratio at `now` (`_lane_key`; by submission without
    `now`): under contention, first come first served made short jobs wait behind long ones,
    which set the mean completion time (bench/results/sim-summary.md).
    A job that would take its tenant over its GPU quota is held, not ordered.

    O(n log n): a tenant's jobs all share its key's first term, so its next pick is always the
    head of its own lane; a heap over tenants' heads replaces the scan of every pending job
    per pick, which made the ordering quadratic in the queue's length.
    """
    used = dict(usage or {})
    share = dict(shares or {})
    limit = dict(quotas or {})
    order: list[QueuedJob] = []
    held: list[tuple[QueuedJob, str]] = []

    bandwidth = dict(wan or {})
    gpu_total, wan_total = totals if totals is not None else (0, 0)

    def load(tenant: str) -> float:
        s = share.get(tenant, 1.0)
        if s <= 0:
            return float("inf")
        gpus = used.get(tenant, 0)
        if totals is None:
            return gpus / s
        dominant = max(
            gpus / gpu_total if gpu_total > 0 else 0.0,
            bandwidth.get(tenant, 0) / wan_total if wan_total > 0 else 0.0,
        )
        return dominant / s

    by_prio: dict[int, dict[str, list[QueuedJob]]] = {}
    for j in queue:
        by_prio.setdefault(j.priority, {}).setdefault(j.tenant, []).append(j)
    for prio in sorted(by_prio, reverse=True):
        lanes = {t: sorted(js, key=lambda j: _lane_key(j, now)) for t, js in by_prio[prio].items()}
        heads = dict.fromkeys(lanes, 0)
        heap = [(load(t), _lane_key(js[0], now), t) for t, js in lanes.items()]
        heapq.heapify(heap)
        while heap:
            _, _, tenant = heapq.heappop(heap)
            lane = lanes[tenant]
            nxt = lane[heads[tenant]]
            heads[tenant] += 1
            q = limit.get(tenant)
            if q is not None and used.get(tenant, 0) + nxt.gpus > q:
                held.append((nxt, f"tenant {tenant!r} quota {q} GPUs would be exceeded"))
            else:
                used[tenant] = used.get(tenant, 0) + nxt.gpus
                order.append(nxt)
            if heads[tenant] < len(lane):
                heapq.heappush(heap, (load(tenant), _lane_key(lane[heads[tenant]], now), tenant))
    return QueueOrder(tuple(order), tuple(held))
