"""Value objects the scheduler decides over: snapshots of clusters and links, job requests,
placements, plans. Frozen dataclasses so a decision is a pure function of its inputs."""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from grammar import canonical_compression, canonical_sync
from grammar.states import ClusterState
from scheduler.gpus import peak_tflops

Objective = Literal["time", "cost", "cost-within-deadline"]
OBJECTIVES: tuple[Objective, ...] = ("time", "cost", "cost-within-deadline")


@dataclass(frozen=True)
class Cluster:
    """One GPU cluster as the scheduler sees it at snapshot time.

    `gpu_tflops` overrides the datasheet peak of `gpu_model`; `efficiency` overrides the
    (calibrated or default) fraction of peak reached in training. `class_prices` maps QoS
    classes (e.g. "spot") to a GPU-hour price other than `price_per_gpu_hour`.
    """

    name: str
    region: str
    gpu_model: str
    gpus_free: int
    intra_bandwidth_gbps: float
    price_per_gpu_hour: float
    state: ClusterState = ClusterState.READY
    cordoned: bool = False
    gpu_tflops: float | None = None
    efficiency: float | None = None
    class_prices: tuple[tuple[str, float], ...] = ()
    setup_s: float | None = None
    """Seconds a run spends here outside its steps (launch, set-up, first-step compilation,
    checkpoints, evaluation, the drain), fitted from observed runs; None: the snapshot's."""
    provider: str | None = None
    """The party whose offer its prices are (a quote names each party's part); None: the
    operator's own cluster."""
    bandwidth_price_per_gbps_hour: float = 0.0
    """What a job pays per Gbit/s-hour of WAN rate it reserves on the cluster's ports."""
    min_hours: float = 0.0
    """The offer's minimum term: a run pays for at least this many hours of each GPU here."""

    def __post_init__(self) -> None:
        if self.setup_s is not None and not 0 <= self.setup_s < 86400:
            raise ValueError(f"cluster {self.name!r}: setup_s must be in [0, 86400) seconds")
        if self.gpus_free < 0:
            raise ValueError(f"cluster {self.name!r}: gpus_free must be >= 0")
        if self.intra_bandwidth_gbps <= 0:
            raise ValueError(f"cluster {self.name!r}: intra_bandwidth_gbps must be > 0")
        if self.price_per_gpu_hour < 0:
            raise ValueError(f"cluster {self.name!r}: price_per_gpu_hour must be >= 0")
        if self.gpu_tflops is None and peak_tflops(self.gpu_model) is None:
            raise ValueError(
                f"cluster {self.name!r}: gpu_model {self.gpu_model!r} is not in the GPU table; "
                "give gpu_tflops"
            )
        if self.gpu_tflops is not None and self.gpu_tflops <= 0:
            raise ValueError(f"cluster {self.name!r}: gpu_tflops must be > 0")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ValueError(f"cluster {self.name!r}: efficiency must be in (0, 1]")

    @property
    def peak_tflops(self) -> float:
        if self.gpu_tflops is not None:
            return self.gpu_tflops
        peak = peak_tflops(self.gpu_model)
        assert peak is not None  # checked in __post_init__
        return peak

    @property
    def schedulable(self) -> bool:
        """DOWN and cordoned clusters take no new work."""
        return self.state != ClusterState.DOWN and not self.cordoned

    def price(self, qos_class: str | None) -> float:
        """GPU-hour price for a QoS class (falls back to the list price)."""
        for name, value in self.class_prices:
            if name == qos_class:
                return value
        return self.price_per_gpu_hour


@dataclass(frozen=True)
class Link:
    """A directed WAN link; the snapshot mirrors it unless the reverse is given too."""

    a: str
    b: str
    bandwidth_gbps: float
    rtt_ms: float
    egress_price_per_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"link {self.a}-{self.b}: bandwidth_gbps must be > 0")
        if self.rtt_ms < 0:
            raise ValueError(f"link {self.a}-{self.b}: rtt_ms must be >= 0")
        if self.egress_price_per_gb < 0:
            raise ValueError(f"link {self.a}-{self.b}: egress_price_per_gb must be >= 0")


def both_ways(links: Iterable[Link]) -> dict[tuple[str, str], Link]:
    """Every link in both directions; an explicitly given direction wins over a mirror."""
    links = tuple(links)
    out: dict[tuple[str, str], Link] = {}
    for link in links:
        out.setdefault(
            (link.b, link.a),
            Link(link.b, link.a, link.bandwidth_gbps, link.rtt_ms, link.egress_price_per_gb),
        )
    for link in links:
        out[(link.a, link.b)] = link
    return out


@dataclass(frozen=True)
class Port:
    """What a job may use of one cluster's uplink and downlink, Gbit/s (None: no limit):
    the free share of a declared port. A path is already no faster than the ports it
    crosses; a collective whose messages leave or reach one cluster at the same time (a
    tree's level, a gossip round, a server's pushes) shares them besides."""

    cluster: str
    up_gbps: float | None = None
    down_gbps: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("up_gbps", self.up_gbps), ("down_gbps", self.down_gbps)):
            if value is not None and not value >= 0:
                raise ValueError(f"port of {self.cluster}: {name} must be >= 0 or None")


@dataclass(frozen=True)
class Assignment:
    """`gpus` GPUs of one cluster."""

    cluster: str
    gpus: int


Placement = tuple[Assignment, ...]


@dataclass(frozen=True)
class RunningJob:
    """A job holding GPUs now: what quotas count and preemption may free.

    `preemption_cost` is what stopping it loses (e.g. work since its last checkpoint); when
    absent, the hourly price of the GPUs it holds stands in for it.
    """

    id: str
    placement: Placement
    tenant: str = "default"
    priority: int = 0
    preemptible: bool = False
    preemption_cost: float | None = None
    ends_at_s: float | None = None
    """When it is expected to hand its GPUs back (seconds on the caller's clock; None:
    unknown): what `scheduler.waiting` weighs a wait for them by."""
    wan_kbps: tuple[tuple[str, int], ...] = ()
    """The WAN rate it holds on each datacenter's uplink and downlink (kbit/s, by cluster
    name, as `scheduler.bandwidth.wan_need_kbps` gave it): what stopping it frees there."""

    @property
    def gpus(self) -> int:
        return sum(a.gpus for a in self.placement)


def crowding(gpus: int | None, host_cores: int) -> float:
    """How many times its compute a step of `gpus` workers takes where they share one
    machine's `host_cores` (1 where host_cores is 0, and where the workers are not known)."""
    if not host_cores or gpus is None or gpus <= host_cores:
        return 1.0
    return gpus / host_cores


_SECONDS_BOUNDS: tuple[tuple[str, int], ...] = (
    ("step_overhead_s", 3600),
    ("local_step_overhead_s", 3600),
    ("setup_s", 86400),
    ("setup_per_gpu_s", 3600),
    ("micro_overhead_s", 3600),
    ("all_reduce_overhead_s", 3600),
    ("ps_push_s", 3600),
)
"""`Snapshot`'s fitted seconds and the bound each is kept under."""


@dataclass(frozen=True)
class Snapshot:
    """Clusters, links, the jobs running on them and per-tenant GPU quotas, at one instant."""

    clusters: tuple[Cluster, ...]
    links: tuple[Link, ...] = ()
    running: tuple[RunningJob, ...] = ()
    quotas: tuple[tuple[str, int], ...] = ()
    # observed seconds per step of a job across clusters that the cost model does not
    # explain (stragglers, the exchange's runtime overhead): `fit_step_overhead` over
    # finished jobs across clusters; added to every estimate across clusters
    step_overhead_s: float = 0.0
    local_step_overhead_s: float = 0.0
    """The same of several workers on one cluster, fitted from such jobs alone: what a run
    across clusters misses of its exchanges is none of a run that makes none."""
    setup_s: float = 0.0
    """A run's seconds outside its steps on a cluster without a `setup_s` of its own; a run
    on several clusters pays the longest (they set up in parallel)."""
    setup_per_gpu_s: float = 0.0
    """And per GPU of the run, where starting its workers is not free (fitted: 0 where
    workers start in parallel on their own machines)."""
    micro_overhead_s: float = 0.0
    """A pipeline's fixed cost of one micro-batch on one stage (`scheduler.pipeline_cost`),
    fitted from finished pipeline runs."""
    all_reduce_overhead_s: float = 0.0
    """A tensor split's fixed cost of one all-reduce (`pipeline_cost.tensor_collective_s`),
    fitted from finished tensor-parallel runs."""
    ps_push_s: float = 0.0
    """An async-ps push's fixed cost beyond its WAN terms: the blocking call to its server
    and the coding at both ends, paid every tick even where the server is the cluster's own;
    fitted from finished async-ps runs."""
    priors: frozenset[str] = frozenset()
    """The fitted costs above (by field name) that no finished run has measured yet: their
    values are priors, which a plan that counts them says."""
    spread: tuple[float, float] = (1.0, 1.0)
    """What finished runs took over their estimates, low and high (the 10th and 90th
    percentiles): an estimate's range is its total times these."""
    ports: tuple[Port, ...] = ()
    """The declared WAN ports, by cluster, at what a job may use of them (`Port`)."""
    host_cores: int = 0
    """0: each GPU computes on its own. n: every worker runs on one machine of n cores, as
    finished runs reported (the embedded default's local Ray, its GPUs CPU worker slots), so
    a step of G workers takes max(1, G / n) times its compute (`crowding`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.host_cores < 1_000_000:
            raise ValueError("host_cores: give 0 (each GPU on its own) or a machine's cores")
        for name, limit in _SECONDS_BOUNDS:
            if not 0 <= getattr(self, name) < limit:
                raise ValueError(f"{name}: must be in [0, {limit}) seconds")
        if not 0 < self.spread[0] <= self.spread[1]:
            raise ValueError("spread: give (low, high) with 0 < low <= high")
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"clusters: names must be unique, repeated: {', '.join(dup)}")
        known = set(names)
        for port in self.ports:
            if port.cluster not in known:
                raise ValueError(f"ports: names unknown cluster {port.cluster!r}")
        for link in self.links:
            for end in (link.a, link.b):
                if end not in known:
                    raise ValueError(f"links: {link.a}-{link.b} names unknown cluster {end!r}")
            if link.a == link.b:
                raise ValueError(f"links: {link.a}-{link.b} joins a cluster to itself")

    def crowding(self, gpus: int | None) -> float:
        """`crowding` on this snapshot's `host_cores`."""
        return crowding(gpus, self.host_cores)

    @cached_property
    def by_name(self) -> dict[str, Cluster]:
        return {c.name: c for c in self.clusters}

    @cached_property
    def directed_links(self) -> dict[tuple[str, str], Link]:
        return both_ways(self.links)

    @cached_property
    def neighbours(self) -> dict[str, frozenset[str]]:
        """The clusters each cluster has a link to: the planner grows sets along links, and
        asking `link` of every cluster was most of a plan at 10,000 clusters."""
        out: dict[str, set[str]] = {}
        for a, b in self.directed_links:
            out.setdefault(a, set()).add(b)
        return {a: frozenset(bs) for a, bs in out.items()}

    def link(self, a: str, b: str) -> Link | None:
        return self.directed_links.get((a, b))

    @cached_property
    def port_of(self) -> dict[str, Port]:
        return {p.cluster: p for p in self.ports}

    @cached_property
    def positions(self) -> dict[str, int]:
        """Each cluster's index in `clusters`: the same in every reallocated copy (shared)."""
        return {c.name: i for i, c in enumerate(self.clusters)}

    @cached_property
    def free_gpus(self) -> int:
        """Free GPUs on clusters that take new work (`Cluster.schedulable`)."""
        return sum(c.gpus_free for c in self.clusters if c.schedulable)

    @cached_property
    def closed(self) -> dict[str, str]:
        """Clusters that take no new work, and why ("DOWN" or "cordoned"): the same in every
        reallocated copy (shared)."""
        return {
            c.name: "DOWN" if c.state == ClusterState.DOWN else "cordoned"
            for c in self.clusters
            if not c.schedulable
        }

    @cached_property
    def full(self) -> frozenset[str]:
        """Clusters that take new work but have no free GPUs."""
        return frozenset(c.name for c in self.clusters if c.schedulable and c.gpus_free < 1)

    @cached_property
    def open_clusters(self) -> tuple[str, ...]:
        """Clusters that take new work and have free GPUs, in `clusters` order: where a job
        without region or data limits may run (`rules.exclusions`)."""
        return tuple(c.name for c in self.clusters if c.schedulable and c.gpus_free >= 1)

    @cached_property
    def releases(self) -> dict[str, tuple[tuple[float, int], ...]]:
        """Per cluster, when its runners are expected to hand GPUs back and how many, in time
        order (runners with a known `ends_at_s` only): what `scheduler.waiting` weighs."""
        out: dict[str, list[tuple[float, int]]] = {}
        for run in self.running:
            if run.ends_at_s is not None:
                for a in run.placement:
                    out.setdefault(a.cluster, []).append((run.ends_at_s, a.gpus))
        return {name: tuple(sorted(ends)) for name, ends in out.items()}

    @cached_property
    def memo(self) -> dict[object, object]:
        """Derived tables that depend only on what a reallocation keeps (names, models,
        prices, links), shared by every reallocated copy: e.g. the cost model's per-cluster
        rates (`CostModel`), which were a pass over every cluster per plan."""
        return {}

    def _share_tables(self) -> None:
        # built here, on the original, so that every copy of it shares them
        _ = self.directed_links, self.neighbours, self.positions, self.closed, self.memo

    def reallocated(
        self, clusters: tuple[Cluster, ...], running: tuple[RunningJob, ...]
    ) -> Snapshot:
        """This snapshot with other free-GPU counts and runners on the same clusters.

        A shallow copy: it skips `__post_init__`'s check of every link and carries over the
        both-ways link table and `memo`, which a placement or a release leaves unchanged;
        rebuilding them was O(links) at every step of a reconcile pass and of the simulator.
        A cluster may differ only in `gpus_free` (what the shared tables assume).
        """
        if len(clusters) != len(self.clusters):
            raise ValueError("clusters: a reallocation keeps the same clusters in order")
        for new, old in zip(clusters, self.clusters, strict=True):
            if new is not old and (
                new.name != old.name or replace(new, gpus_free=old.gpus_free) != old
            ):
                if new.name != old.name:
                    raise ValueError("clusters: a reallocation keeps the same clusters in order")
                raise ValueError(f"clusters: {new.name!r} changed more than its free GPUs")
        self._share_tables()
        out = copy.copy(self)
        object.__setattr__(out, "clusters", clusters)
        object.__setattr__(out, "running", running)
        for name in ("by_name", "free_gpus", "full", "open_clusters", "releases"):
            out.__dict__.pop(name, None)
        return out

    def with_free(self, delta: Mapping[str, int], running: tuple[RunningJob, ...]) -> Snapshot:
        """`reallocated` with the free GPUs of the clusters in `delta` moved by their value
        (names not in the snapshot are ignored), in time proportional to the change: a
        placement or a release rebuilt every cluster, `by_name` and the free total from all
        clusters, which was most of a simulated job's time at 10,000 clusters."""
        self._share_tables()
        clusters = list(self.clusters)
        changed: list[Cluster] = []
        opened: list[str] = []  # schedulable clusters that had no free GPUs and now have some
        shut: list[str] = []  # and the other way round
        moved = 0
        for name, d in delta.items():
            i = self.positions.get(name)
            if i is None:
                continue
            old = clusters[i]
            clusters[i] = new = replace(old, gpus_free=old.gpus_free + d)
            changed.append(new)
            if old.schedulable:
                moved += d
                if (old.gpus_free >= 1) != (new.gpus_free >= 1):
                    (opened if new.gpus_free >= 1 else shut).append(name)
        out = copy.copy(self)
        object.__setattr__(out, "clusters", tuple(clusters))
        object.__setattr__(out, "running", running)
        if "by_name" in self.__dict__:
            by_name = dict(self.by_name)
            by_name.update((c.name, c) for c in changed)
            out.__dict__["by_name"] = by_name
        if "free_gpus" in self.__dict__:
            out.__dict__["free_gpus"] = self.free_gpus + moved
        if "full" in self.__dict__ and (opened or shut):
            out.__dict__["full"] = self.full.union(shut).difference(opened)
        if "open_clusters" in self.__dict__ and (opened or shut):
            at = self.positions.__getitem__
            names = list(self.open_clusters)
            for name in shut:
                del names[bisect.bisect_left(names, at(name), key=at)]
            for name in opened:
                bisect.insort(names, name, key=at)
            out.__dict__["open_clusters"] = tuple(names)
        out.__dict__.pop("releases", None)
        if "releases" in self.__dict__ and running[:-1] == self.running:
            # one runner added (a placement): its ends joined to what was known
            releases = dict(self.releases)
            added = running[-1]
            if added.ends_at_s is not None:
                for a in added.placement:
                    ends = (*releases.get(a.cluster, ()), (added.ends_at_s, a.gpus))
                    releases[a.cluster] = tuple(sorted(ends))
            out.__dict__["releases"] = releases
        return out

    def quota(self, tenant: str) -> int | None:
        for name, gpus in self.quotas:
            if name == tenant:
                return gpus
        return None


@dataclass(frozen=True)
class QoS:
    """Service terms of one job. `regions` None means anywhere (data residency otherwise)."""

    priority: int = 0
    deadline_s: float | None = None
    max_cost: float | None = None
    regions: tuple[str, ...] | None = None
    max_clusters: int | None = None
    preemptible: bool = False
    qos_class: str | None = None

    def __post_init__(self) -> None:
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("qos.deadline_s must be > 0")
        if self.max_cost is not None and self.max_cost < 0:
            raise ValueError("qos.max_cost must be >= 0")
        if self.max_clusters is not None and self.max_clusters < 1:
            raise ValueError("qos.max_clusters must be >= 1")


@dataclass(frozen=True)
class JobRequest:
    """A data-parallel training job to place.

    Work per step is `flops_per_step` (whole global batch) or `step_time_s_ref` seconds that
    one `ref_gpu` takes for the whole global batch. `min_gpus == max_gpus` is a fixed gang;
    otherwise the job is elastic. `preference` is an ordered list of cluster names tried first.
    """

    params: int
    steps: int
    min_gpus: int
    max_gpus: int
    flops_per_step: float | None = None
    step_time_s_ref: float | None = None
    ref_gpu: str | None = None
    qos: QoS = field(default_factory=QoS)
    compression: str = "auto"
    sync: str = "auto"
    tenant: str = "default"
    preference: tuple[str, ...] = ()
    layer_shapes: tuple[tuple[int, int], ...] = ()
    id: str = ""
    data_clusters: tuple[str, ...] | None = None
    """Data residency (`data: local`): only these clusters hold the job's data, so only they
    may run it. None: the data may be read anywhere."""

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ValueError("params must be >= 1")
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.min_gpus < 1:
            raise ValueError("gpus: at least 1 GPU is needed (min_gpus >= 1)")
        if self.max_gpus < self.min_gpus:
            raise ValueError("max_gpus must be >= min_gpus")
        if (self.flops_per_step is None) == (self.step_time_s_ref is None):
            raise ValueError("give exactly one of flops_per_step or step_time_s_ref (+ ref_gpu)")
        if self.flops_per_step is not None and self.flops_per_step <= 0:
            raise ValueError("flops_per_step must be > 0")
        if self.step_time_s_ref is not None:
            if self.step_time_s_ref <= 0:
                raise ValueError("step_time_s_ref must be > 0")
            if self.ref_gpu is None or peak_tflops(self.ref_gpu) is None:
                raise ValueError(
                    "ref_gpu: name a GPU model from the GPU table with step_time_s_ref"
                )
        object.__setattr__(self, "compression", canonical_compression(self.compression))
        object.__setattr__(self, "sync", canonical_sync(self.sync))


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one placement with one compression and sync mode.

    `step_time_s` is per optimiser step; `total_time_s` covers the requested steps (what the
    run takes) and `quality_cost` is what the compressor and sync mode cost in quality: the
    fraction of extra steps they would need to match lossless every-step training
    (`grammar.quality`, or a steps factor fitted from observed runs).
    `batch_shares` is each cluster's fraction of the global batch, the split the run makes
    (`training.TrainSpec.batch_shares`): by GPU throughput, so no cluster waits on another,
    or, under the modes that let fast clusters run ahead, equal per GPU.
    """

    step_time_s: float
    total_time_s: float
    wan_bytes: int
    cost: float
    compute_s: float
    intra_s: float
    wan_s: float
    overhead_s: float
    effective_steps: float
    gpu_cost: float
    egress_cost: float
    ring: tuple[str, ...] = ()
    bottleneck: tuple[str, str] | None = None
    tree: tuple[tuple[str, str], ...] = ()
    """(child, parent) of each non-root cluster when the exchange all-reduces over a tree
    (`grammar.graph.reduction_tree`) because it is faster than the ring; empty: the ring."""
    batch_shares: tuple[tuple[str, float], ...] = ()
    step_overhead_s: float = 0.0  # included in step_time_s
    relay_ticks: tuple[tuple[str, int], ...] = ()
    """Under async-ps across regions: every how many ticks each region's server (by region)
    exchanges with the global one (`cost.relay_ticks`); the run keeps to it."""
    quality_cost: float = 0.0
    setup_s: float = 0.0  # included in total_time_s (and its GPUs in the cost)
    total_time_range_s: tuple[float, float] = (0.0, 0.0)
    """`total_time_s` times the snapshot's `spread`: where observed runs say it lands."""
    bandwidth_cost: float = 0.0
    """Of `cost`: the WAN rate the run reserves on its clusters' ports, at their prices."""


@dataclass(frozen=True)
class Plan:
    """A feasible decision and why it was made."""

    placement: Placement
    compression: str
    sync: str
    estimate: Estimate
    objective: Objective = "time"
    explanation: tuple[str, ...] = ()
    victims: tuple[str, ...] = ()

    feasible: Literal[True] = True
    reason: str = ""

    @property
    def gpus(self) -> int:
        return sum(a.gpus for a in self.placement)


@dataclass(frozen=True)
class Infeasible:
    """No plan satisfies the rules. `constraint` names the rule that failed; `closest` is the
    best plan that breaks only that rule, when there is one (e.g. the fastest plan for a
    missed deadline)."""

    constraint: str
    reason: str
    closest: Plan | None = None
    explanation: tuple[str, ...] = ()

    feasible: Literal[False] = False


PlanResult = Plan | Infeasible
