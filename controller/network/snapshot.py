"""The scheduler's view of the world, read from the database at one instant."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

import scheduler
from controller.access.tenancy import granted_priority
from controller.money import pricing
from controller.network import labels, resources
from controller.network.allocations import free_room, held_plans
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterGpus,
    Job,
    JobEvent,
    JobMetric,
    Provider,
    StepObservation,
    Tenant,
    WanPort,
    utcnow,
)
from grammar.states import LIVE, ClusterState, JobState
from scheduler.bandwidth import KBPS_PER_GBPS, path_gbps, port_gbps
from scheduler.calibrate import POOLED
from scheduler.pipeline_cost import (
    ALL_REDUCE_OVERHEAD_S,
    MICRO_BATCH_OVERHEAD_S,
    fit_all_reduce_overhead,
    fit_micro_overhead,
)

DEFAULT_INTRA_GBPS = 100.0
OVERHEAD_JOBS = 20  # finished jobs the step overhead is fitted over


def normalize_gpu_model(reported: str) -> str | None:
    """Map a reported name ('A100-80GB', 'NVIDIA H100 80GB HBM3') to the scheduler's table."""
    if scheduler.peak_tflops(reported) is not None:
        return reported
    key = reported.upper().replace("NVIDIA", "").replace("_", "-")
    tokens = key.replace(" ", "-").split("-")
    matches = [
        name
        for name in scheduler.GPU_PEAK_TFLOPS
        if name.upper() in tokens or key.strip("- ").startswith(name.upper())
    ]
    return max(matches, key=len) if matches else None


def snapshot_name(cluster: str, gpu_model: str, models_in_cluster: int) -> str:
    """One scheduler cluster per (cluster, GPU model); plain name when it has one model."""
    return cluster if models_in_cluster == 1 else f"{cluster}/{gpu_model}"


@dataclass(frozen=True)
class World:
    """A snapshot plus where each of its clusters came from: (cluster name, inventory model)."""

    snapshot: scheduler.Snapshot
    origins: dict[str, tuple[str, str]]
    paced: frozenset[str] = frozenset()
    """Clusters with a declared uplink or downlink: their links are planned at a share and
    paced to it (`wire.plan.PlannedLink.paced`)."""
    links: tuple[scheduler.Link, ...] = ()
    """The links before the ports' shares were taken out (the snapshot's are after)."""
    ports: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    """Each paced cluster's free uplink and downlink (Gbit/s; None: undeclared), by name."""
    ceilings: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    """The most of each port one job is planned on (label `wan_job_share` times capacity)."""

    def after(
        self,
        job_id: str,
        tenant: str,
        priority: int,
        preemptible: bool,
        placement: tuple[scheduler.Assignment, ...],
        ends_at_s: float | None = None,
        wan_kbps: Mapping[str, int] | None = None,
        ports_now: Mapping[str, tuple[float | None, float | None]] | None = None,
    ) -> World:
        """This world once `placement` is reserved for a job: fewer free GPUs, one more runner,
        and less of the ports its `wan_kbps` (by cluster name) reserved, so the next job of
        the pass plans on what is left of them; or, given, the ports of those clusters as
        they are now (`free_ports`: read after the reservation, the new job's bursts kept
        too).

        Only the placement's clusters are touched (`Snapshot.with_free`): rebuilding every
        cluster was most of a simulated job's time at 10,000 clusters."""
        taken = {a.cluster: -a.gpus for a in placement}
        running = (
            *self.snapshot.running,
            scheduler.RunningJob(
                id=job_id,
                placement=placement,
                tenant=tenant,
                priority=priority,
                preemptible=preemptible,
                ends_at_s=ends_at_s,
                wan_kbps=tuple(sorted((wan_kbps or {}).items())),
            ),
        )
        snapshot = self.snapshot.with_free(taken, running)
        ports: Mapping[str, tuple[float | None, float | None]]
        if ports_now:
            ports = {**self.ports, **{n: v for n, v in ports_now.items() if n in self.ports}}
        else:
            ports = self._ports_moved(wan_kbps or {}, -1)
        if ports is not self.ports:
            snapshot = self._with_ports(snapshot, ports)
        return World(snapshot, self.origins, self.paced, self.links, ports, self.ceilings)

    def release(
        self, snapshot: scheduler.Snapshot, victims: Sequence[scheduler.RunningJob]
    ) -> scheduler.Snapshot:
        """`snapshot` (this world's, or one derived from it) as it would be once `victims`
        stopped: their GPUs free (`scheduler.release`) and the WAN rates they hold back on
        the ports, so a job short of bandwidth can be planned on what their end frees
        (the planner's preemption, `scheduler.plan(release=...)`)."""
        freed = scheduler.release(snapshot, victims)
        held: dict[str, int] = defaultdict(int)
        for victim in victims:
            for name, kbps in victim.wan_kbps:
                held[name] += kbps
        ports = self._ports_moved(held, +1)
        if ports is self.ports:
            return freed
        return self._with_ports(freed, ports)

    def _with_ports(
        self, snapshot: scheduler.Snapshot, ports: Mapping[str, tuple[float | None, float | None]]
    ) -> scheduler.Snapshot:
        """`snapshot` planned on `ports` (free, by cluster name): its links and its ports."""
        return replace(
            snapshot,
            links=_shared(self.links, self.origins, ports, self.ceilings),
            ports=_snapshot_ports(self.origins, ports, self.ceilings),
        )

    def _ports_moved(
        self, kbps_by_cluster: Mapping[str, int], sign: int
    ) -> Mapping[str, tuple[float | None, float | None]]:
        """The ports with `kbps_by_cluster` taken (sign -1) or given back (+1) on both ways,
        never below 0; the same object when no declared port is touched."""
        if not any(name in self.ports and kbps for name, kbps in kbps_by_cluster.items()):
            return self.ports
        left = dict(self.ports)
        for name, kbps in kbps_by_cluster.items():
            if name in left:
                gbps = sign * kbps / KBPS_PER_GBPS
                up, down = left[name]
                left[name] = (
                    None if up is None else max(up + gbps, 0.0),
                    None if down is None else max(down + gbps, 0.0),
                )
        return left


def build_snapshot(
    session: Session, qos_class: str, at: datetime | None = None
) -> scheduler.Snapshot:
    return build_world(session, qos_class, at).snapshot


def build_world(session: Session, qos_class: str, at: datetime | None = None) -> World:
    """Clusters with free GPUs and the price of `qos_class` now; effective links; running jobs.

    A (cluster, model) without a price for the class is left out: nothing runs unpriced.
    """
    at = at or utcnow()
    seen = observed(session)
    setups = dict(seen.setup_by_cluster)
    gpu_offers = pricing.current_gpu_offers(session, at)
    egress = pricing.current_egress_prices(session, at)
    bandwidth = pricing.current_bandwidth_prices(session, at)
    # Columns, not ORM rows: with a thousand clusters and their links, loading Cluster and
    # Link objects (each link joined to both its clusters) was most of a reconcile pass's read.
    inventory: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for cluster_id, inv_model, inv_allocatable, inv_in_use in session.execute(
        select(
            ClusterGpus.cluster_id,
            ClusterGpus.model,
            ClusterGpus.allocatable,
            ClusterGpus.in_use,
        ).order_by(ClusterGpus.cluster_id, ClusterGpus.model)
    ):
        inventory[cluster_id].append((inv_model, inv_allocatable, inv_in_use))
    clusters = session.execute(
        select(
            Cluster.id,
            Cluster.name,
            Cluster.region,
            Cluster.labels,
            Cluster.state,
            Cluster.cordoned,
            Cluster.provider_id,
        )
    ).all()
    parties = dict(session.execute(select(Provider.id, Provider.name)).all())
    out: list[scheduler.Cluster] = []
    names: dict[str, list[str]] = {}
    origins: dict[str, tuple[str, str]] = {}
    for c in clusters:
        offered = [g for g in inventory.get(c.id, ()) if g[1] > 0]
        intra = labels.number(c.labels, "intra_bandwidth_gbps", c.name) or DEFAULT_INTRA_GBPS
        names[c.id] = []
        for gpu_model, allocatable, in_use in offered:
            offer = gpu_offers.get((c.id, gpu_model, qos_class))
            if offer is None:
                continue
            price = offer.price
            free = max(0, allocatable - in_use)
            if offer.gpus is not None:  # the offer sells at most this many at once
                free = min(free, max(0, offer.gpus - in_use))
            model = normalize_gpu_model(gpu_model)
            tflops = labels.number(c.labels, "gpu_tflops", c.name)
            if model is None and tflops is None:
                continue
            name = snapshot_name(c.name, gpu_model, len(offered))
            names[c.id].append(name)
            origins[name] = (c.name, gpu_model)
            state = c.state if c.state in LIVE else ClusterState.DOWN  # PENDING takes no work
            out.append(
                scheduler.Cluster(
                    name=name,
                    region=c.region,
                    gpu_model=model or gpu_model,
                    gpus_free=free,
                    intra_bandwidth_gbps=intra,
                    price_per_gpu_hour=float(price),
                    state=state,
                    cordoned=c.cordoned,
                    gpu_tflops=tflops,
                    setup_s=setups.get(c.name),
                    provider=parties.get(c.provider_id) if c.provider_id else None,
                    bandwidth_price_per_gbps_hour=float(bandwidth.get(c.id, 0)),
                    min_hours=float(offer.min_hours or 0),
                )
            )
    cluster_names = {c.id: (c.name, c.labels) for c in clusters}
    rows = resources.link_rows(session)
    ports, ceilings = _free_ports(session, cluster_names, resources.carried_gbps(rows))
    links = _scheduler_links(rows, names, egress)
    snapshot = scheduler.Snapshot(
        clusters=tuple(out),
        links=_shared(links, origins, ports, ceilings),
        ports=_snapshot_ports(origins, ports, ceilings),
        running=tuple(running_jobs(session)),
        quotas=tuple(
            (tenant_id, quota)
            for tenant_id, quota in session.execute(
                select(Tenant.id, Tenant.gpu_quota).where(Tenant.gpu_quota.is_not(None))
            )
            if quota is not None
        ),
        step_overhead_s=seen.step_overhead_s,
        local_step_overhead_s=seen.local_step_overhead_s,
        setup_s=seen.setup_s,
        setup_per_gpu_s=seen.setup_per_gpu_s,
        micro_overhead_s=seen.micro_overhead_s,
        all_reduce_overhead_s=seen.all_reduce_overhead_s,
        ps_push_s=seen.ps_push_s,
        priors=seen.priors,
        spread=seen.spread,
        host_cores=seen.host_cores,
    )
    return World(snapshot, origins, frozenset(ports), links, ports, ceilings)


Ports = dict[str, tuple[float | None, float | None]]
"""Gbit/s of each cluster's uplink and downlink (None: undeclared), by cluster name."""


def free_ports(session: Session, names: Set[str]) -> Ports:
    """What is free of these clusters' ports now (by name), as a snapshot reads it."""
    rows = session.execute(
        select(Cluster.id, Cluster.name, Cluster.labels).where(Cluster.name.in_(sorted(names)))
    ).all()
    clusters = {
        cluster_id: (name, cluster_labels or {}) for cluster_id, name, cluster_labels in rows
    }
    carried = resources.carried_gbps(resources.link_rows(session, names))
    return _free_ports(session, clusters, carried)[0]


def _free_ports(
    session: Session,
    clusters: Mapping[str, tuple[str, Mapping[str, Any]]],
    carried: Ports,
) -> tuple[Ports, Ports]:
    """Each cluster's free uplink and downlink, and the most of each one job is planned on
    (its `wan_job_share` of the capacity; None: the whole port). A port's capacity is the
    declared one, less where its agents' probes never carried that much (`carried`, by
    name: `scheduler.bandwidth.port_gbps`). What is free is no more than leaves each running
    job's bursts through the port within `BURST_TOLERANCE` of its plan (`free_room`).
    Clusters declaring neither port are left out."""
    reserved: dict[tuple[str, str], int] = {
        (cluster_id, direction): kbps
        for cluster_id, direction, kbps in session.execute(
            select(WanPort.cluster_id, WanPort.direction, WanPort.reserved_kbps)
        )
    }
    declared: dict[str, tuple[str, float | None, float | None]] = {}
    for cluster_id, (name, cluster_labels) in clusters.items():
        up = labels.number(cluster_labels, "uplink_gbps", name)
        down = labels.number(cluster_labels, "downlink_gbps", name)
        if up is not None or down is not None:
            seen_up, seen_down = carried.get(name, (None, None))
            declared[cluster_id] = (name, port_gbps(up, seen_up), port_gbps(down, seen_down))
    holders = held_plans(session, declared.keys())
    free: Ports = {}
    ceilings: Ports = {}
    for cluster_id, (name, up, down) in declared.items():
        cluster_labels = clusters[cluster_id][1]
        held = holders.get(cluster_id, ())
        free[name] = (
            free_room(name, "up", up, reserved.get((cluster_id, "up"), 0), held),
            free_room(name, "down", down, reserved.get((cluster_id, "down"), 0), held),
        )
        share = labels.number(cluster_labels, "wan_job_share", name)
        if share is not None:
            ceilings[name] = (
                None if up is None else up * share,
                None if down is None else down * share,
            )
    return free, ceilings


def _shared(
    links: tuple[scheduler.Link, ...],
    origins: Mapping[str, tuple[str, str]],
    ports: Mapping[str, tuple[float | None, float | None]],
    ceilings: Mapping[str, tuple[float | None, float | None]],
) -> tuple[scheduler.Link, ...]:
    """The links as the planner may use them now, each direction given: each no faster than
    its source's free uplink and its destination's free downlink (`ports`, by cluster name;
    `origins` maps a snapshot name to its cluster's), nor than the share of them one job may
    take (`ceilings`). A pair one of whose directions has nothing free is left out, both
    ways: every exchange crosses a pair both ways, and a direction left alone would be
    mirrored (`scheduler.both_ways`) at its full speed."""
    if not ports:
        return links
    none: tuple[float | None, float | None] = (None, None)
    paths: dict[tuple[str, str], scheduler.Link | None] = {}
    for (a, b), link in sorted(scheduler.both_ways(links).items()):
        src = origins.get(a, (a, ""))[0]
        dst = origins.get(b, (b, ""))[0]
        up = _least(ports.get(src, none)[0], ceilings.get(src, none)[0])
        down = _least(ports.get(dst, none)[1], ceilings.get(dst, none)[1])
        gbps = path_gbps(link.bandwidth_gbps, up, down)
        paths[(a, b)] = None if gbps <= 0 else replace(link, bandwidth_gbps=gbps)
    return tuple(
        link for (a, b), link in paths.items() if link is not None and paths[(b, a)] is not None
    )


def _snapshot_ports(
    origins: Mapping[str, tuple[str, str]],
    ports: Mapping[str, tuple[float | None, float | None]],
    ceilings: Mapping[str, tuple[float | None, float | None]],
) -> tuple[scheduler.Port, ...]:
    """The planner's ports: each snapshot cluster's free uplink and downlink (`ports`, by
    cluster name; `origins` maps a snapshot name to its cluster's), no more than the share
    of them one job may take (`ceilings`)."""
    none: tuple[float | None, float | None] = (None, None)
    out: list[scheduler.Port] = []
    for name, (cluster, _) in origins.items():
        if cluster in ports:
            free, most = ports[cluster], ceilings.get(cluster, none)
            out.append(scheduler.Port(name, _least(free[0], most[0]), _least(free[1], most[1])))
    return tuple(out)


def _least(a: float | None, b: float | None) -> float | None:
    """The smaller of two limits, None being no limit."""
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class _LinkTable:
    """The scheduler's links and what they were made from."""

    rows: Sequence[Any]
    names: dict[str, list[str]]
    egress: dict[tuple[str, str], Decimal]
    links: tuple[scheduler.Link, ...]


_last_table: _LinkTable | None = None
"""The last pass's links: the next pass usually reads the very same rows (links change when an
admin or an agent's measurement changes them), and turning 9,000 rows into scheduler links was
a tenth of a placement at 1,000 clusters. One slot, replaced whole: safe across threads."""


def _scheduler_links(
    rows: Sequence[Any], names: dict[str, list[str]], egress: dict[tuple[str, str], Decimal]
) -> tuple[scheduler.Link, ...]:
    """Every effective link between priced (cluster, model) pairs, at the egress price now."""
    global _last_table
    last = _last_table
    if last is not None and last.rows == rows and last.names == names and last.egress == egress:
        return last.links
    links: list[scheduler.Link] = []
    for link in _effective_links(rows):
        price = egress.get((link.src_cluster_id, link.dst_cluster_id))
        if price is None:
            price = Decimal(str(link.egress_price_per_gb))
        for a in names.get(link.src_cluster_id, []):
            for b in names.get(link.dst_cluster_id, []):
                links.append(scheduler.Link(a, b, link.bandwidth_gbps, link.rtt_ms, float(price)))
    _last_table = _LinkTable(rows, names, egress, tuple(links))
    return _last_table.links


def _effective_links(rows: Iterable[Any]) -> list[Any]:
    """`controller.network.resources.winning_links` over columns, sorted by cluster names."""
    return sorted(resources.winning_links(rows), key=lambda k: (k.src_name, k.dst_name))


SPREAD_PRIOR = (0.5, 2.0)
"""What a run may take over its estimate before any run was observed: half to twice."""

PS_PUSH_PRIOR_S = 0.002
"""The prior of an async-ps push's fixed cost (`scheduler.Snapshot.ps_push_s`) before any
async-ps run was observed: a Ray actor call to a server on a nearby node and the coding of
the model at both ends, a few milliseconds for a small model."""

SETUP_PRIOR_S = 30.0
"""A run's seconds outside its steps before any run was observed: Ray actors started, torch
imported, the data loaded, evaluations, checkpoints and the drain (about what a fresh
`make demo` run shows on a laptop's CPU); replaced by what finished runs show."""


@dataclass(frozen=True)
class Observed:
    """What finished runs say the cost model missed: per step (`step_overhead_s` across
    clusters, `local_step_overhead_s` on one) and per run outside its steps (`setup_s`:
    pooled, and per cluster name that ran them)."""

    step_overhead_s: float = 0.0
    local_step_overhead_s: float = 0.0
    setup_s: float = SETUP_PRIOR_S
    setup_by_cluster: tuple[tuple[str, float], ...] = ()
    setup_per_gpu_s: float = 0.0
    spread: tuple[float, float] = SPREAD_PRIOR
    micro_overhead_s: float = MICRO_BATCH_OVERHEAD_S
    all_reduce_overhead_s: float = ALL_REDUCE_OVERHEAD_S
    ps_push_s: float = PS_PUSH_PRIOR_S
    priors: frozenset[str] = frozenset({"micro_overhead_s", "all_reduce_overhead_s", "ps_push_s"})
    """Which of the three costs above no finished run has measured yet (still their priors)."""
    host_cores: int = 0
    """The cores of the one machine every finished run's workers shared (0: not all ran on
    one, or none said): `scheduler.Snapshot.host_cores`."""


def observed(session: Session) -> Observed:
    """Fit the step overhead and the set-up time from the last finished jobs. Step overhead:
    observed step minus observed compute minus what the estimate gave communication (jobs on
    several GPUs; those across clusters apart from those on one). Set-up: the run's wall time
    (RUNNING to SUCCEEDED) minus its steps at their observed step time, of jobs that ran
    once; the median each, per cluster too, less a part a GPU (`_per_gpu`: fitted, or all of
    it where their workers shared one host).
    A pipeline's micro-batch cost: its observed step over the schedule's (M + S - 1) slots
    less the slot its estimate gave without that cost, of pipeline jobs that ran once, their
    layers whole. A tensor split's all-reduce cost: its observed step over its estimate,
    spread over the step's all-reduces, of one-stage split jobs that ran once. An async-ps
    push's fixed cost: its observed tick over its estimate, plus the cost that counted, of
    async-ps jobs that ran once (kept out of the fleet's step overhead: a push's call is
    not what other modes pay)."""
    jobs = session.execute(
        select(Job.id, Job.placement, Job.started_at, Job.finished_at, Job.attempts)
        .where(Job.state == JobState.SUCCEEDED, Job.placement.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(OVERHEAD_JOBS)
    ).all()
    plans = {job_id: (plan, start, end, tries) for job_id, plan, start, end, tries in jobs if plan}
    if not plans:
        return Observed()
    last = (
        select(JobMetric.job_id, func.max(JobMetric.step).label("step"))
        .where(JobMetric.job_id.in_(plans))
        .group_by(JobMetric.job_id)
        .subquery()
    )
    rows = session.execute(
        select(
            JobMetric.job_id, JobMetric.step, JobMetric.step_time_s, JobMetric.compute_time_s
        ).join(last, (JobMetric.job_id == last.c.job_id) & (JobMetric.step == last.c.step))
    ).all()
    machines = _machines(session, plans)
    hosts = {job_id: hosts for job_id, (hosts, _) in machines.items()}
    one_host: list[bool] = []  # per set-up sample: its workers all ran on one Ray node
    residuals: list[float] = []  # of jobs across clusters
    local: list[float] = []  # of several workers on one cluster
    setups: list[tuple[int, float, tuple[str, ...]]] = []
    ratios: list[float] = []
    micro: dict[str, float] = {}  # per pipeline job: its least slot overrun at its last step
    split: dict[str, float] = {}  # per tensor job: an all-reduce's overrun at its last step
    pushes: list[float] = []  # per async-ps job: a push's fixed cost as its last step shows
    for job_id, step, step_s, compute_total in rows:
        if not step or step_s is None:
            continue
        plan, start, end, tries = plans[job_id]
        est = plan.estimate
        par = plan.parallel
        if par.mode != "data":  # a pipeline's step is not the data-parallel model's
            if par.tensor > 1:  # a split's all-reduces: fitted from one-stage runs alone
                if len(par.stages) == 1 and par.all_reduces and tries <= 1:
                    split[job_id] = fit_all_reduce_overhead(
                        step_s,
                        est.step_time_s,
                        par.all_reduces,
                        par.all_reduce_overhead_s or 0.0,
                    )
                continue
            if par.stages and par.micro_batches and est.step_time_s > 0 and tries <= 1:
                sample = fit_micro_overhead(
                    step_s,
                    est.step_time_s,
                    par.micro_batches,
                    len(par.stages),
                    par.micro_overhead_s or 0.0,
                )
                micro[job_id] = min(micro.get(job_id, math.inf), sample)
            continue
        if est.ps_push_s is not None:  # async-ps: its pushes' fixed cost, not the fleet's
            if tries <= 1:  # as one worker alone on its cores would pay it (`crowded`)
                crowd = scheduler.crowding(plan.gpus, _cores(machines.get(job_id)))
                pushes.append((step_s - est.step_time_s) / crowd + est.ps_push_s)
        elif plan.gpus > 1 and est.compute_s and compute_total is not None:
            modelled_comm = est.step_time_s - est.compute_s - est.step_overhead_s
            sample = step_s - compute_total / step - modelled_comm
            (residuals if len(plan.clusters) > 1 else local).append(sample)
        if start is not None and end is not None and tries <= 1 and plan.parallel.mode == "data":
            wall = (end - start).total_seconds()
            if est.total_time_s > 0:
                ratios.append(wall / est.total_time_s)
            setup = max(0.0, wall - step * step_s)
            setups.append((plan.gpus, setup, tuple(s.cluster for s in plan.clusters)))
            one_host.append(hosts.get(job_id) == 1)
    per_gpu = _per_gpu(setups, bool(one_host) and all(one_host))
    by_cluster: dict[str, list[float]] = defaultdict(list)
    for gpus, setup, clusters in setups:
        for name in clusters:
            by_cluster[name].append(setup - per_gpu * gpus)
    return Observed(
        step_overhead_s=scheduler.fit_step_overhead(residuals),
        local_step_overhead_s=scheduler.fit_step_overhead(local),
        setup_s=_median([s - per_gpu * g for g, s, _ in setups], SETUP_PRIOR_S),
        setup_by_cluster=tuple((c, _median(v, SETUP_PRIOR_S)) for c, v in by_cluster.items()),
        setup_per_gpu_s=per_gpu,
        spread=_spread(ratios),
        micro_overhead_s=min(_median(list(micro.values()), MICRO_BATCH_OVERHEAD_S), 3599.0),
        all_reduce_overhead_s=min(_median(list(split.values()), ALL_REDUCE_OVERHEAD_S), 3599.0),
        ps_push_s=min(_median(pushes, PS_PUSH_PRIOR_S), 3599.0),
        priors=frozenset(
            name
            for name, samples in (
                ("micro_overhead_s", list(micro)),
                ("all_reduce_overhead_s", list(split)),
                ("ps_push_s", pushes),
            )
            if not samples
        ),
        host_cores=_shared_cores(machines.values()),
    )


def _machines(session: Session, job_ids: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """(hosts, host_cores) as each finished job's report gave them (None where it did not)."""
    reports = {
        job_id: data.get("report") or {}
        for job_id, data in session.execute(
            select(JobEvent.job_id, JobEvent.data).where(
                JobEvent.job_id.in_(list(job_ids)), JobEvent.to_state == JobState.SUCCEEDED
            )
        ).all()
        if isinstance(data, dict)
    }
    return {job_id: (r.get("hosts"), r.get("host_cores")) for job_id, r in reports.items()}


def _cores(machine: tuple[Any, Any] | None) -> int:
    """The cores a run's workers shared, as its report said (0: it ran on several machines,
    or did not say)."""
    hosts, cores = machine or (None, None)
    return cores if hosts == 1 and isinstance(cores, int) and cores > 0 else 0


def _shared_cores(machines: Iterable[tuple[Any, Any]]) -> int:
    """The fewest cores of the one machine where each run's workers ran, if every run that
    said ran on one; 0 where one ran on several, or none said."""
    cores = [_cores(m) for m in machines if isinstance(m[0], int) and m[0] > 0]
    return 0 if not cores or 0 in cores else min(cores)


CALIBRATION_OBSERVATIONS = 500
"""The newest compute observations the GPU efficiency is fitted from."""


@dataclass(frozen=True)
class Calibration:
    """The GPU efficiency jobs' compute steps show, by GPU model (`scheduler.calibrate`): the
    fleet's, and each task's own where it ran, since a step's share of peak depends on its
    work as much as on the GPU (bench/results/promise.md: the CNN jobs planned on the MLPs'
    fit)."""

    fleet: Mapping[str, float] = field(default_factory=dict)
    by_task: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def for_task(self, task: str) -> dict[str, float] | None:
        """What a job of `task` plans with: its own fit of each GPU model it ran on, and of
        the others the fleet's times how much faster or slower than the fleet it ran where
        both did (the median ratio); None before any observation (the priors)."""
        own = self.by_task.get(task, {})
        ratios = [own[m] / self.fleet[m] for m in own if m != POOLED and self.fleet.get(m)]
        scale = statistics.median(ratios) if ratios else 1.0
        merged = {m: min(1.0, e * scale) for m, e in self.fleet.items()}
        return {**merged, **own} or None


def calibration(session: Session) -> Calibration:
    """The `Calibration` of the newest `CALIBRATION_OBSERVATIONS` compute observations: what
    a placement plans with, and so a quote too (a quote priced on the datasheet was held to a
    run its placement timed otherwise)."""
    rows = session.execute(
        select(StepObservation.job_id, StepObservation.gpu_model, StepObservation.gpus,
               StepObservation.flops, StepObservation.compute_s)
        .order_by(StepObservation.id.desc())
        .limit(CALIBRATION_OBSERVATIONS)
    ).all()  # fmt: skip
    kept = [
        (job_id, scheduler.Observation(gpu_model=model, gpus=gpus, flops=flops, compute_s=s))
        for job_id, model, gpus, flops, s in rows
        if flops > 0 and s > 0 and scheduler.peak_tflops(model) is not None
    ]
    if not kept:
        return Calibration()
    jobs = {job_id for job_id, _ in kept}
    tasks: dict[str, str] = {}
    workers: dict[str, int] = {}
    for job_id, spec, plan in session.execute(
        select(Job.id, Job.spec, Job.placement).where(Job.id.in_(jobs))
    ):
        task = spec.get("task") if isinstance(spec, dict) else None
        if isinstance(task, str):
            tasks[job_id] = task
        if plan is not None:
            workers[job_id] = plan.gpus
    # each observation as its GPU alone would have computed it: a step of W workers that
    # shared a machine's n cores took max(1, W / n) times as long (`Snapshot.crowding`)
    machines = _machines(session, jobs)
    fleet = _shared_cores(machines.values())
    crowds: dict[str, float] = {}
    for job_id in jobs:
        seen = machines.get(job_id)  # None: running, or not said: as the finished runs ran
        cores = fleet if seen is None or seen[0] is None else _cores(seen)
        crowds[job_id] = scheduler.crowding(workers.get(job_id), cores)
    kept = [(job_id, replace(ob, compute_s=ob.compute_s / crowds[job_id])) for job_id, ob in kept]
    by_task: dict[str, list[scheduler.Observation]] = defaultdict(list)
    for job_id, ob in kept:
        if job_id in tasks:
            by_task[tasks[job_id]].append(ob)
    return Calibration(
        fleet=scheduler.calibrate(ob for _, ob in kept),
        by_task={task: scheduler.calibrate(obs) for task, obs in by_task.items()},
    )


def _spread(ratios: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of actual over estimated run time, widened to hold 1
    (an estimate's own value stays in its range); the prior below three runs."""
    if len(ratios) < 3:
        return SPREAD_PRIOR
    cuts = statistics.quantiles(ratios, n=10, method="inclusive")
    low, high = min(cuts[0], 1.0), max(cuts[-1], 1.0)
    return (max(low, 0.01), min(high, 100.0))


def _per_gpu(samples: Sequence[tuple[int, float, tuple[str, ...]]], one_host: bool) -> float:
    """The slope of set-up time against the run's GPUs (never negative): where workers start
    one machine's cores at a time it grows with them, elsewhere it is ~0. Theil-Sen's, the
    median of the slopes between runs of different GPUs, so one cold start (the first run
    after the control plane's Ray started) does not set it as a least-squares line lets it.
    Too few samples for a slope: 0, or, where every sample's workers ran on one Ray node
    (`one_host`), the median set-up a GPU (it grows with them there: none of it fixed)."""
    if len(samples) < 3 or len({g for g, _, _ in samples}) < 2:
        if one_host:
            return min(_median([s / g for g, s, _ in samples if g > 0], 0.0), 3599.0)
        return 0.0
    slopes = [
        (s2 - s1) / (g2 - g1)
        for (g1, s1, _), (g2, s2, _) in itertools.combinations(samples, 2)
        if g1 != g2
    ]
    return min(max(0.0, statistics.median(slopes)), 3599.0)


def _median(values: Sequence[float], default: float) -> float:
    return min(max(0.0, float(statistics.median(values))), 86399.0) if values else default


def step_overhead(session: Session) -> tuple[float, float]:
    """The per-step time the cost model missed on the last finished jobs (`observed`):
    across clusters, and on one."""
    seen = observed(session)
    return seen.step_overhead_s, seen.local_step_overhead_s


def running_jobs(session: Session) -> list[scheduler.RunningJob]:
    """Jobs holding GPUs now, for quotas and preemption."""
    # Columns, not Job rows: loading each running job's JSON spec and placement made this
    # most of a reconcile pass's fixed cost with thousands of jobs running.
    rows = session.execute(
        select(
            Job.id,
            Job.tenant_id,
            Job.preemptible,
            Job.ends_at,
            Allocation.cluster_id,
            Allocation.gpu_model,
            Allocation.gpus,
            Allocation.wan_kbps,
            Cluster.name,
            granted_priority(),
        )
        .join(Allocation, Allocation.job_id == Job.id)
        .join(Cluster, Cluster.id == Allocation.cluster_id)
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Allocation.ended_at.is_(None))
    ).all()
    by_job: dict[str, tuple[str, bool, int, datetime | None, list[scheduler.Assignment]]] = {}
    wan: dict[str, dict[str, int]] = defaultdict(dict)
    models: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        models[row.cluster_id].add(row.gpu_model)
    for (
        job_id,
        tenant_id,
        preemptible,
        ends,
        cluster_id,
        gpu_model,
        gpus,
        kbps,
        name,
        priority,
    ) in rows:
        entry = by_job.setdefault(job_id, (tenant_id, bool(preemptible), priority, ends, []))
        cname = name if len(models[cluster_id]) == 1 else f"{name}/{gpu_model}"
        entry[4].append(scheduler.Assignment(cname, gpus))
        if kbps:  # one rate per cluster, whichever of its GPU models' rows holds it
            wan[job_id][name] = max(wan[job_id].get(name, 0), kbps)
    return [
        scheduler.RunningJob(
            id=job_id,
            placement=tuple(assign),
            tenant=tenant_id,
            priority=priority,  # granted: preemption takes only jobs granted less
            preemptible=preemptible,
            ends_at_s=None if ends is None else ends.timestamp(),
            wan_kbps=tuple(sorted(wan[job_id].items())) if job_id in wan else (),
        )
        for job_id, (tenant_id, preemptible, priority, ends, assign) in by_job.items()
    ]
