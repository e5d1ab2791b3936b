"""The cost model: compute, intra-cluster and WAN communication time, and money.

One step of hierarchical data parallelism on clusters S with g_c GPUs each:

- compute: under the modes that average gradients every step (every-step, adaptive,
  stale: `splits_by_rate`) the runtime splits the global batch by throughput (the
  estimate's `batch_shares`, which the launcher hands it), so no cluster waits on another
  and the gradient is still the batch's mean: T_c = W / sum_c g_c r_c, r_c = peak TFLOPS x
  efficiency. The modes of local updates (local SGD, streaming, partial, gossip, async-ps)
  split it equally per worker, as a split changes what each cluster's local steps learn
  from: the slowest sets the pace, T_c = W / (G r_min), G = sum_c g_c. Under `partial:H` and
  `async-ps:S` (`runs_ahead`) the fast clusters do not wait: in one tick (a step of the
  slowest) cluster c takes k_c = min(SPEED_BOUND, floor(r_c / r_min)) steps (the runtime's
  `steps_per_tick`). The run takes the job's steps in ticks, so that buys samples, not time:
  the step time and the exchanges are those of the ticks.
- intra-cluster: exact ring all-reduce, T_i = max_c [2(p-1)a + 2(p-1)/p n/B_c] (clusters reduce
  in parallel), a = ALPHA_INTRA_S, n = 4 bytes x params.
- WAN: the cluster leaders exchange the compressed payload n' in a ring. All-reducible payloads
  use reduce-scatter + all-gather: 2(D-1) rounds of n'/D; sparse/sign payloads are all-gathered:
  D-1 rounds of n'. A ring round lasts as long as its slowest edge, a_e + chunk/B_e (a_e = RTT/2),
  so the ring is ordered to minimise that bottleneck, then egress price: two candidate orders
  per cluster set, the best for the dense payload and the best for a vanishing one (latency
  only), each found by exact search up to EXACT_RING_MAX clusters and greedy + 2-opt above;
  every compressor uses whichever of the two is better for its chunk. With uniform links this
  is exactly T = 2(D-1)a + 2(D-1)/D n'/B. The final broadcast inside each cluster is left
  out: it moves the same bytes as one intra ring round, on links far faster than the WAN.
- overhead: compressing on the slowest leader, O = flops_per_param x params / r_min.
- the step, from its local part L = T_c + T_i and one exchange's latency and transfer (O and
  the bytes): `grammar.auto.step_seconds`, the one formula the runtime's auto times its
  candidates with too. Nothing overlaps the backward pass (the runtime exchanges after it; a
  planner that credited overlap the runtime never gives promised a shorter step):
  every-step: L + T_w + O; local-sgd:H (partial, gossip): L + (O + T_w)/H;
  stale:s (s >= 1): max(L, O + T_w) — the leaders' exchanges go one at a time (the runtime's
  one exchange thread), each beside the next step's compute; stale:0 is every-step; async-ps:
  L + O + T_ps, where T_ps is the slowest push and pull of a cluster to its region's server
  (`ps_wan`: the servers where the runtime puts them, `grammar.graph.region_hosts`; 0 where a
  region is one cluster), and each region's server exchanges with the global one apart, one
  exchange in flight, one every `relay_ticks` (its round trip over the step, rounded up)
  ticks;
  streaming:H:fF:dD: each fragment waits what it outlasts its D steps of compute, F times a
  period, and the link carries the F fragments in the period's compute.
- shared ports: a path is already no faster than the free share of the declared ports it
  crosses (`Snapshot.ports`); where a collective sends k messages out of one cluster, or
  into one, at the same time (a tree's level, a gossip round, the pushes to a parameter
  server and its answers), they also share that port: k n'/U (`_ports_s`). A ring's round
  sends one message out of each cluster and one into it.
- gossip:P (`neighbours`): every P steps each cluster sends the payload n' to its neighbours
  in the runtime's gossip graph (`grammar.graph.gossip_graph`: the bandwidth-ordered ring
  plus exponential-graph chords as fast as its slowest edge), all at once: max over the
  graph's directed edges of a_e + n'/B_e, bytes (sum of degrees) x n'; otherwise local SGD
  of period P.
- total time: the set-up (`setup`: launch, compilation, checkpoints, evaluation, the drain,
  fitted from observed runs) + steps x step time (the steps the run takes; what a compressor
  or sync mode costs in quality is `grammar.quality`'s, weighed apart by the optimizer).
- money: sum_c g_c x price_c(QoS class) x total hours + WAN GB per directed ring edge x that
  link's egress price + the WAN rate reserved on each member's ports (its share of the bytes
  over the steps' time, as the placement reserves it) x the total hours x that cluster's
  price per Gbit/s-hour (`reserved_cost`; nothing where no cluster prices its bandwidth).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

from grammar import Sync, SyncKind, parse_sync
from grammar.auto import step_seconds
from grammar.graph import (
    TREE_FANOUT,
    bandwidth_ring,
    gossip_graph,
    hub_tree,
    reduction_tree,
    region_groups,
    region_hosts,
    tree_levels,
)
from grammar.quality import SPEED_BOUND, compression_cost, local_data_cost
from scheduler.calibrate import POOLED
from scheduler.compression import (
    UNEVEN_LINK_RATIO,
    CompressorModel,
    SyncModel,
    compressor_model,
    splits_by_rate,
    sync_model,
)
from scheduler.gpus import DEFAULT_EFFICIENCY, GPU_PEAK_TFLOPS, peak_tflops
from scheduler.types import Assignment, Cluster, Estimate, JobRequest, Placement, Snapshot

BYTES_PER_PARAM = 4
ALPHA_INTRA_S = 10e-6
EXACT_RING_MAX = 6


def ring_allreduce_time(p: int, nbytes: float, alpha_s: float, bandwidth_bytes_s: float) -> float:
    """Ring all-reduce of `nbytes` over `p` equal peers: 2(p-1)a + 2(p-1)/p n/B."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes / bandwidth_bytes_s


def efficiency_of(cluster: Cluster, factors: Mapping[str, float] | None = None) -> float:
    """Cluster override, then a calibrated factor by cluster name, by GPU model, pooled."""
    if cluster.efficiency is not None:
        return cluster.efficiency
    if factors:
        for key in (cluster.name, cluster.gpu_model, POOLED):
            if key in factors:
                return factors[key]
    return DEFAULT_EFFICIENCY


def job_work_flops(job: JobRequest, factors: Mapping[str, float] | None = None) -> float:
    """Effective FLOPs of one step of the whole global batch."""
    if job.flops_per_step is not None:
        return job.flops_per_step
    assert job.step_time_s_ref is not None and job.ref_gpu is not None
    peak = peak_tflops(job.ref_gpu)
    assert peak is not None
    factors = factors or {}
    eff = factors.get(job.ref_gpu, factors.get(POOLED, DEFAULT_EFFICIENCY))
    return job.step_time_s_ref * peak * 1e12 * eff


REFERENCE_GPU = "A100"
"""The GPU model a job's size is counted on (`reference_run_s`): any fixed one orders alike."""


def reference_run_s(job: JobRequest) -> float:
    """Seconds `job` would compute alone on its fewest GPUs of `REFERENCE_GPU`, without
    exchanges: its size, which the queue orders a tenant's jobs by (`rules.order_queue`)."""
    per_gpu = job_work_flops(job) * job.steps / job.min_gpus
    return per_gpu / (GPU_PEAK_TFLOPS[REFERENCE_GPU] * 1e12 * DEFAULT_EFFICIENCY)


class WanTerms:
    """One WAN exchange among a set of clusters with one compressor.

    A plain class, not a dataclass: the search builds one per (cluster set, compressor) it
    scores, and a dataclass's generated `__init__` runs interpreted even in the compiled build
    (`scheduler.native`). Nothing mutates one after it is built (they are cached)."""

    __slots__ = (
        "bandwidth_s",
        "bottleneck",
        "bytes",
        "egress_cost",
        "latency_s",
        "overhead_s",
        "ring",
        "tree",
    )

    def __init__(
        self,
        latency_s: float,
        bandwidth_s: float,
        overhead_s: float,
        bytes: float,
        egress_cost: float,
        ring: tuple[str, ...],
        bottleneck: tuple[str, str] | None,
        tree: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.latency_s = latency_s
        self.bandwidth_s = bandwidth_s
        self.overhead_s = overhead_s
        self.bytes = bytes
        self.egress_cost = egress_cost
        self.ring = ring
        self.bottleneck = bottleneck
        self.tree = tree
        """(child, parent) of each non-root cluster when the exchange runs over the tree
        (`grammar.graph.reduction_tree`); empty: the ring."""


NO_WAN = WanTerms(0.0, 0.0, 0.0, 0.0, 0.0, (), None)


def crowded(wan: WanTerms, crowd: float) -> WanTerms:
    """`wan` with its fixed cost (coding, a call to a server: work on the workers' cores)
    `crowd` times as long (`Snapshot.crowding`); the same object at 1."""
    if crowd == 1.0:
        return wan
    return WanTerms(
        wan.latency_s,
        wan.bandwidth_s,
        wan.overhead_s * crowd,
        wan.bytes,
        wan.egress_cost,
        wan.ring,
        wan.bottleneck,
        wan.tree,
    )


# a ring order, its edges' (latency s, bandwidth bytes/s, egress $/GB) in order, their egress sum
_Ring = tuple[tuple[str, ...], list[tuple[float, float, float]], float]


def step_time(compute_s: float, intra_s: float, wan: WanTerms, sync: SyncModel) -> float:
    """One optimiser step given its parts (`grammar.auto.step_seconds`)."""
    return step_seconds(
        sync.value, compute_s + intra_s, wan.latency_s, wan.overhead_s + wan.bandwidth_s
    )


def setup_of(snapshot: Snapshot, names: Iterable[str], gpus: int = 0) -> float:
    """A run's seconds outside its steps on `names` with `gpus` GPUs: the longest member's
    (they set up in parallel; a member without its own fit takes the snapshot's), plus the
    snapshot's per-GPU part."""
    by, default = snapshot.by_name, snapshot.setup_s
    base = max(
        (c.setup_s if c.setup_s is not None else default for c in (by[n] for n in names)),
        default=default,
    )
    return base + snapshot.setup_per_gpu_s * gpus


# a snapshot's per-cluster GPU rate (FLOP/s), GPU-hour price and intra bandwidth (bytes/s)
_Tables = tuple[dict[str, float], dict[str, float], dict[str, float]]


def _cluster_tables(
    snapshot: Snapshot, qos_class: str | None, efficiency: Mapping[str, float] | None
) -> _Tables:
    """Each cluster's rate, price and intra bandwidth. Without calibrated factors a cluster's
    rate depends only on its model and overrides, so it is worked out once per kind of GPU."""
    rate: dict[str, float] = {}
    price: dict[str, float] = {}
    intra_bw: dict[str, float] = {}
    kinds: dict[tuple[str, float | None, float | None], float] = {}
    for c in snapshot.clusters:
        if efficiency:
            r = c.peak_tflops * 1e12 * efficiency_of(c, efficiency)
        else:
            kind = (c.gpu_model, c.gpu_tflops, c.efficiency)
            hit = kinds.get(kind)
            if hit is None:
                hit = kinds[kind] = c.peak_tflops * 1e12 * efficiency_of(c)
            r = hit
        rate[c.name] = r
        price[c.name] = c.price(qos_class) if c.class_prices else c.price_per_gpu_hour
        intra_bw[c.name] = c.intra_bandwidth_gbps * 1e9 / 8
    return rate, price, intra_bw


@dataclass(frozen=True, slots=True)
class RankIndex:
    """A snapshot's clusters in the orders the planner's seed rankings (`optimizer._rankings`)
    and the hold's bound (`waiting`) read, which depend only on rates and prices (kept in
    `Snapshot.memo`, so shared by its reallocated copies).

    `by_rate`: (rate, member names ascending) per distinct GPU rate, fastest first.
    `by_value`: every cluster by (price / rate, name), with that ratio."""

    by_rate: tuple[tuple[float, tuple[str, ...]], ...]
    by_value: tuple[tuple[float, str], ...]


class CostModel:
    """The cost model bound to one snapshot and one job, with caches for the optimizer."""

    def __init__(
        self,
        snapshot: Snapshot,
        job: JobRequest,
        efficiency: Mapping[str, float] | None = None,
        steps_factors: Mapping[str, float] | None = None,
    ) -> None:
        """`steps_factors` overrides a sync mode's statistical efficiency with one fitted from
        observed runs (`scheduler.calibrate.fit_steps_factor`), by exact value ("partial:8")
        or by kind ("partial")."""
        self.snapshot = snapshot
        self.steps_factors = dict(steps_factors or {})
        self.job = job
        self.work = job_work_flops(job, efficiency)
        self.nbytes = float(job.params * BYTES_PER_PARAM)
        qos_class = job.qos.qos_class
        # one pass over the fleet (thousands of clusters a plan): without calibrated factors
        # the tables depend on nothing a placement changes, so reallocated copies of the
        # snapshot share them (`Snapshot.memo`); they are read, never written, after this
        key = ("cost-model", qos_class)
        # where this model's tables live in `snapshot.memo` (None: calibrated, not kept), so
        # that what is derived from them alone can be kept there too
        self.memo_key: tuple[str, str | None] | None = None if efficiency else key
        hit = None if efficiency else snapshot.memo.get(key)
        if hit is None:
            tables = _cluster_tables(snapshot, qos_class, efficiency)
            if not efficiency:
                snapshot.memo[key] = tables
        else:
            tables = cast(_Tables, hit)
        self.rate, self.price, self._intra_bw = tables
        self._wan_cache: dict[tuple[tuple[str, ...], str], WanTerms] = {}
        self._ring_cache: dict[tuple[str, ...], tuple[_Ring, ...]] = {}
        self._comp_cache: dict[str, CompressorModel] = {}
        self._sync_cache: dict[str, SyncModel] = {}
        self._gossip_cache: dict[tuple[tuple[str, ...], str], WanTerms] = {}
        self._ps_cache: dict[
            tuple[tuple[str, ...], str], tuple[WanTerms, tuple[tuple[str, WanTerms], ...]]
        ] = {}
        self._pace_cache: dict[tuple[str, ...], tuple[float, dict[str, int]]] = {}
        self._edges: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._intra_rows: dict[str, list[float]] = {}
        self._modes: dict[tuple[str, str], tuple[int, bool, bool, float, int]] = {}
        self._quality_cache: dict[tuple[str, str], float] = {}
        self._streams: dict[tuple[str, str], Sync] = {}
        """The streaming values among `_modes`, which `score_set` times by `step_seconds`."""

    def rank_index(self) -> RankIndex | None:
        """The snapshot's `RankIndex` for this model's rates and prices; None when the
        model's tables are its own (calibrated factors)."""
        if self.memo_key is None:
            return None
        memo = self.snapshot.memo
        key = ("rank-index", *self.memo_key)
        hit = memo.get(key)
        if hit is None:
            rate, price = self.rate, self.price
            groups: dict[float, list[str]] = {}
            for n, r in rate.items():
                groups.setdefault(r, []).append(n)
            hit = memo[key] = RankIndex(
                tuple((r, tuple(sorted(ns))) for r, ns in sorted(groups.items(), reverse=True)),
                tuple(sorted((price[n] / rate[n], n) for n in rate)),
            )
        assert isinstance(hit, RankIndex)
        return hit

    # --- parts -----------------------------------------------------------------------------

    def compressor(self, spec: str) -> CompressorModel:
        m = self._comp_cache.get(spec)
        if m is None:
            m = compressor_model(spec, self.job.params, self.job.layer_shapes)
            self._comp_cache[spec] = m
        return m

    def quality(self, compression: str, sync: str) -> float:
        """What (compression, sync) costs in quality: `grammar.quality.quality_cost`, with
        the sync mode's cost as fitted from observed runs where there are some."""
        q = self._quality_cache.get((compression, sync))
        if q is None:
            c = compression_cost(compression, sync)
            # on local data, what the mode's drift costs more (`grammar.quality`)
            local = local_data_cost(parse_sync(sync)) if self.job.data_clusters else 0.0
            q = (1.0 + c) * (self.sync(sync).steps_factor + local) - 1.0
            self._quality_cache[(compression, sync)] = q
        return q

    def sync(self, spec: str) -> SyncModel:
        m = self._sync_cache.get(spec)
        if m is None:
            m = sync_model(spec)
            fitted = self.steps_factors.get(m.spec, self.steps_factors.get(m.spec.split(":")[0]))
            if fitted is not None:
                m = replace(m, steps_factor=max(1.0, fitted))
            self._sync_cache[spec] = m
        return m

    def pace(self, names: tuple[str, ...]) -> tuple[float, dict[str, int]]:
        """The slowest member's per-GPU rate and each member's steps per step of it under the
        modes that run ahead (`steps_per_tick` of the runtime, bounded by SPEED_BOUND)."""
        hit = self._pace_cache.get(names)
        if hit is None:
            slow = min(self.rate[n] for n in names)
            ticks = {n: max(1, min(SPEED_BOUND, int(self.rate[n] / slow + 1e-9))) for n in names}
            hit = (slow, ticks)
            self._pace_cache[names] = hit
        return hit

    def bandwidth_price(self, names: tuple[str, ...]) -> float:
        """The members' prices per reserved Gbit/s-hour, summed (`reserved_cost`)."""
        by = self.snapshot.by_name
        return sum(by[n].bandwidth_price_per_gbps_hour for n in names)

    def setup(self, names: tuple[str, ...], gpus: int | None = None) -> float:
        return setup_of(self.snapshot, names, gpus or 0)

    def speeds_differ(self, names: tuple[str, ...]) -> bool:
        """Some member fits a second step into one of the slowest's: running ahead can pay."""
        return len(names) > 1 and max(self.pace(names)[1].values()) > 1

    def ahead_rate(self, names: tuple[str, ...], gpus: Iterable[int]) -> float:
        """Throughput when fast clusters run ahead: sum_c g_c k_c r_min (`pace`)."""
        slow, ticks = self.pace(names)
        return slow * sum(g * ticks[n] for n, g in zip(names, gpus, strict=True))

    def uneven(self, names: tuple[str, ...]) -> bool:
        """The links among `names` differ by UNEVEN_LINK_RATIO or more in bandwidth or RTT."""
        if len(names) < 3:
            return False
        links = [self.snapshot.link(a, b) for a, b in itertools.combinations(names, 2)]
        if any(lk is None for lk in links):
            return False
        bws = [lk.bandwidth_gbps for lk in links if lk is not None]
        rtts = [max(lk.rtt_ms, 0.1) for lk in links if lk is not None]
        return max(bws) >= UNEVEN_LINK_RATIO * min(bws) or max(rtts) >= UNEVEN_LINK_RATIO * min(
            rtts
        )

    def intra(self, cluster: str, gpus: int) -> float:
        return ring_allreduce_time(gpus, self.nbytes, ALPHA_INTRA_S, self._intra_bw[cluster])

    def intra_row(self, cluster: str, upto: int) -> list[float]:
        """`intra(cluster, p)` for p = 1, 2, ... (at least `upto` of them), kept for the plan:
        every set the search scores reads its members' rows again. Read only."""
        row = self._intra_rows.get(cluster)
        if row is None or len(row) < upto:
            row = [self.intra(cluster, p) for p in range(1, upto + 1)]
            self._intra_rows[cluster] = row
        return row

    def wan(self, names: tuple[str, ...], compression: str) -> WanTerms:
        """WAN terms for the sorted cluster names `names`; needs every ring edge linked."""
        if len(names) < 2:
            return NO_WAN
        key = (names, compression)
        hit = self._wan_cache.get(key)
        if hit is not None:
            return hit
        cm = self.compressor(compression)
        d = len(names)
        payload = self.nbytes * cm.ratio
        if cm.allreducible:
            rounds, chunk = 2 * (d - 1), payload / d
        else:
            rounds, chunk = d - 1, payload
        rings = self._rings(names)
        if len(rings) == 1:
            ring, edges, _ = rings[0]
        else:  # by `_ring_key` for this chunk, then by names
            ring, edges, _ = min(
                rings, key=lambda r: ((max(e[0] + chunk / e[1] for e in r[1]), r[2]), r[0])
            )
        times = [e[0] + chunk / e[1] for e in edges]  # the same floats as `_edge_costs`
        i = max(range(d), key=times.__getitem__)  # the first slowest, as max over the edges
        worst = (ring[i], ring[(i + 1) % d])
        alpha, bw = edges[i][0], edges[i][1]
        egress = 0.0
        for e in edges:
            egress += rounds * chunk / 1e9 * e[2]
        # x / r falls as r grows, and so does its rounding: the slowest member's is the max
        overhead = cm.overhead_flops_per_param * self.job.params / self.pace(names)[0]
        terms = WanTerms(
            latency_s=rounds * alpha,
            bandwidth_s=rounds * chunk / bw,
            overhead_s=overhead,
            bytes=d * rounds * chunk,
            egress_cost=egress,
            ring=ring,
            bottleneck=worst,
        )
        if cm.allreducible and d > 2:  # a tree where it is faster (two clusters: one hop)
            shapes = [reduction_tree(names, self._pair_gbps)]
            if d > TREE_FANOUT + 1:  # up to three clusters the binary tree is the hub's star
                shapes.append(hub_tree(names, self._pair_gbps))
            for parents in shapes:
                tree = self._tree_terms(parents, payload, overhead, ring)
                if tree is not None and (
                    tree.latency_s + tree.bandwidth_s < terms.latency_s + terms.bandwidth_s
                ):
                    terms = tree
        self._wan_cache[key] = terms
        return terms

    def _tree_terms(
        self, parents: dict[str, str], payload: float, overhead: float, ring: tuple[str, ...]
    ) -> WanTerms | None:
        """A tree all-reduce (`training.exchange.LeaderExchange.tree`) over `parents` (the
        binary `grammar.graph.reduction_tree`, or the hub's star, `hub_tree`): the whole
        payload up each edge, level by level from the deepest, and down each edge from the
        root, each level as slow as its slowest edge (a + payload / B), or as the children's
        copies through their parent's declared port (`_ports_s`): 2 x depth hops, 2(n-1)
        whole copies. None where an edge of the tree has no link both ways (the ring,
        linked edge by edge, stays)."""
        if any(self._pair_gbps(c, p) <= 0 for c, p in parents.items()):
            return None
        levels = tree_levels(parents)
        latency = bandwidth = egress = 0.0
        worst: tuple[str, str] | None = None
        slowest = -1.0
        for edges in (
            *([(c, parents[c]) for c in level] for level in reversed(levels)),
            *([(parents[c], c) for c in level] for level in levels),
        ):
            costs = {e: self._edge(*e) for e in edges}
            edge = max(edges, key=lambda e: (costs[e][0] + payload / costs[e][1], e))
            alpha, bw, _ = costs[edge]
            latency += alpha
            bandwidth += max(payload / bw, self._ports_s(edges, payload))
            egress += sum(payload / 1e9 * c[2] for c in costs.values())
            if alpha + payload / bw > slowest:
                slowest, worst = alpha + payload / bw, edge
        return WanTerms(
            latency_s=latency,
            bandwidth_s=bandwidth,
            overhead_s=overhead,
            bytes=2 * len(parents) * payload,
            egress_cost=egress,
            ring=ring,
            bottleneck=worst,
            tree=tuple(parents.items()),
        )

    def gossip_graph(self, names: tuple[str, ...]) -> dict[str, list[str]]:
        """The graph a gossip run over `names` exchanges on: the runtime's own
        (`grammar.graph.gossip_graph`) from the links' bandwidth, the slower direction of a
        pair counting (a round waits for its slowest message)."""
        return gossip_graph(names, self._pair_gbps)

    def _pair_gbps(self, a: str, b: str) -> float:
        there, back = self.snapshot.link(a, b), self.snapshot.link(b, a)
        if there is None or back is None:
            return 0.0
        return min(there.bandwidth_gbps, back.bandwidth_gbps)

    def gossip_wan(self, names: tuple[str, ...], compression: str) -> WanTerms:
        """One gossip round on `gossip_graph`: every cluster sends the whole payload to each
        of its neighbours at once, so the round lasts as long as the slowest directed edge of
        the graph, or as a cluster's copies through its declared port (`_ports_s`), and moves
        payload x (sum of the degrees) bytes, growing with the degree, not with the cluster
        count."""
        if len(names) < 2:
            return NO_WAN
        key = (names, compression)
        hit = self._gossip_cache.get(key)
        if hit is not None:
            return hit
        cm = self.compressor(compression)
        payload = self.nbytes * cm.ratio
        graph = self.gossip_graph(names)
        directed = [(a, b) for a, ns in graph.items() for b in ns]
        cost = self._edge_costs(names, payload)
        worst = max(directed, key=lambda e: (cost[e][0], e))
        link = self.snapshot.link(*worst)
        assert link is not None
        terms = WanTerms(
            latency_s=link.rtt_ms / 2000.0,
            bandwidth_s=max(
                payload / (link.bandwidth_gbps * 1e9 / 8), self._ports_s(directed, payload)
            ),
            overhead_s=max(
                cm.overhead_flops_per_param * self.job.params / self.rate[n] for n in names
            ),
            bytes=len(directed) * payload,
            egress_cost=sum(payload / 1e9 * cost[e][1] for e in directed),
            ring=tuple(bandwidth_ring(names, self._pair_gbps)),
            bottleneck=worst,
        )
        self._gossip_cache[key] = terms
        return terms

    def ps_wan(
        self, names: tuple[str, ...], compression: str
    ) -> tuple[WanTerms, tuple[tuple[str, WanTerms], ...]]:
        """An `async-ps` run's WAN, where the runtime puts its servers
        (`grammar.graph.region_hosts`, over the clusters' regions): what a tick waits for and
        sends (each cluster's leader pushes the payload to its server and pulls as much back,
        blocking: the slowest such round trip, and the push's own fixed cost
        (`Snapshot.ps_push_s`: the server's work, a call to it where it is another process)) and
        each regional server's exchange with the global one, by region (there and back; each
        region has one in flight at a time, never waited for, on its own link: `_parts` fixes
        how often, region by region, `relay_ticks`). Flat (one region): no region exchange."""
        if len(names) < 2:
            return NO_WAN, ()
        key = (names, compression)
        hit = self._ps_cache.get(key)
        if hit is not None:
            return hit
        cm = self.compressor(compression)
        payload = self.nbytes * cm.ratio
        by = self.snapshot.by_name
        groups = region_groups(names, {n: by[n].region for n in names})
        top, hosts = region_hosts(groups, self._pair_gbps)
        coding = cm.overhead_flops_per_param * self.job.params / self.pace(names)[0]
        overhead = coding + self.snapshot.ps_push_s  # each call to a server blocks its caller
        ring = tuple(bandwidth_ring(names, self._pair_gbps))

        def star(pairs: list[tuple[str, str]]) -> WanTerms:
            """Round trips member -> host -> member of `pairs`, all at once."""
            if not pairs:
                return WanTerms(0.0, 0.0, overhead, 0.0, 0.0, ring, None)
            legs = {
                (a, h): (self._edge(a, h), self._edge(h, a)) for a, h in pairs
            }  # (alpha, bandwidth, price) there and back

            def wait(e: tuple[str, str]) -> float:
                there, back = legs[e]
                return there[0] + back[0] + payload / there[1] + payload / back[1]

            worst = max(legs, key=lambda e: (wait(e), e))
            there, back = legs[worst]
            shared = self._ports_s(legs, payload) + self._ports_s(
                [(h, a) for a, h in legs], payload
            )  # the pushes into a host's downlink, its answers out of its uplink
            return WanTerms(
                latency_s=there[0] + back[0],
                bandwidth_s=max(payload / there[1] + payload / back[1], shared),
                overhead_s=overhead,
                bytes=2 * len(legs) * payload,
                egress_cost=sum(payload / 1e9 * (t[2] + b[2]) for t, b in legs.values()),
                ring=ring,
                bottleneck=worst,
            )

        members = [(c, hosts[r]) for r, cs in groups.items() for c in cs if c != hosts[r]]
        relays = [(r, h) for r, h in sorted(hosts.items()) if h != top] if len(groups) > 1 else []
        hit = (star(members), tuple((r, star([(h, top)])) for r, h in relays))
        self._ps_cache[key] = hit
        return hit

    def _rings(self, names: tuple[str, ...]) -> tuple[_Ring, ...]:
        """Candidate ring orders for a cluster set: the best for the dense payload (bandwidth
        bound) and the best for a vanishing one (latency bound). Each compressor then uses
        the better of the two for its own chunk size, so a set costs two ring searches.
        Each comes with its edges' (a, B, egress) in ring order and their egress sum."""
        hit = self._ring_cache.get(names)
        if hit is None:
            d = len(names)
            if d <= 2:
                dense = latency = names
            elif d <= EXACT_RING_MAX:
                # `best_ring` on `_edge_costs`, from one table of the set's links
                links = [[self._edge(a, b) if a != b else None for b in names] for a in names]
                price = [[e[2] if e is not None else 0.0 for e in row] for row in links]
                chunk = self.nbytes / d
                dense = _exact_ring(
                    names,
                    [[e[0] + chunk / e[1] if e is not None else 0.0 for e in row] for row in links],
                    price,
                )
                latency = _exact_ring(
                    names,
                    [[e[0] + 0.0 / e[1] if e is not None else 0.0 for e in row] for row in links],
                    price,
                )
            else:
                dense = best_ring(names, self._edge_costs(names, self.nbytes / d))
                latency = best_ring(names, self._edge_costs(names, 0.0))
            hit = tuple(
                (ring, edges, sum(e[2] for e in edges))
                for ring in ((dense,) if dense == latency else (dense, latency))
                for edges in (
                    [self._edge(a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True)],
                )
            )
            self._ring_cache[names] = hit
        return hit

    def _edge(self, a: str, b: str) -> tuple[float, float, float]:
        """(latency a = RTT/2 s, bandwidth B bytes/s, egress $/GB) of the link a -> b, from a
        per-plan table: the search asks for the same few pairs thousands of times."""
        hit = self._edges.get((a, b))
        if hit is None:
            lk = self.snapshot.link(a, b)
            if lk is None:
                raise ValueError(f"clusters {a!r} and {b!r} have no link between them")
            hit = (lk.rtt_ms / 2000.0, lk.bandwidth_gbps * 1e9 / 8, lk.egress_price_per_gb)
            self._edges[(a, b)] = hit
        return hit

    def _ports_s(self, edges: Iterable[tuple[str, str]], payload: float) -> float:
        """Seconds the `edges`' messages of `payload` bytes, sent at once, need through the
        declared ports they share (`Snapshot.ports`): k of them leaving one cluster take k x
        payload over its uplink, k reaching one over its downlink, however fast each path is
        alone. 0 where no declared port carries more than one."""
        ports = self.snapshot.port_of
        if not ports:
            return 0.0
        out: dict[str, int] = {}
        into: dict[str, int] = {}
        for a, b in edges:
            out[a] = out.get(a, 0) + 1
            into[b] = into.get(b, 0) + 1
        worst = 0.0
        for counts, up in ((out, True), (into, False)):
            for name, k in counts.items():
                port = ports.get(name)
                if k < 2 or port is None:
                    continue
                gbps = port.up_gbps if up else port.down_gbps
                if gbps is not None and gbps > 0:
                    worst = max(worst, k * payload / (gbps * 1e9 / 8))
        return worst

    def _edge_costs(
        self, names: tuple[str, ...], chunk: float
    ) -> dict[tuple[str, str], tuple[float, float]]:
        """(round time a + chunk/B, egress price) per directed edge among `names`."""
        out: dict[tuple[str, str], tuple[float, float]] = {}
        for a in names:
            for b in names:
                if a == b:
                    continue
                alpha, bw, price = self._edge(a, b)
                out[(a, b)] = (alpha + chunk / bw, price)
        return out

    # --- whole estimate --------------------------------------------------------------------

    def estimate(self, placement: Placement, compression: str, sync: str) -> Estimate:
        """Predict step time, total time, WAN bytes and cost of one concrete choice."""
        names = tuple(sorted(a.cluster for a in placement))
        rate = sum(a.gpus * self.rate[a.cluster] for a in placement)
        intra = max(self.intra(a.cluster, a.gpus) for a in placement)
        price = sum(a.gpus * self.price[a.cluster] for a in placement)
        gpus = {a.cluster: a.gpus for a in placement}
        est = self.estimate_parts(
            names,
            rate,
            intra,
            price,
            compression,
            sync,
            gpus=sum(gpus.values()),
        )
        total = sum(gpus.values())
        even = not splits_by_rate(self.sync(sync)) and len(names) > 1
        shares = tuple(
            (a.cluster, a.gpus / total if even else a.gpus * self.rate[a.cluster] / rate)
            for a in sorted(placement, key=lambda a: a.cluster)
        )
        return replace(est, batch_shares=shares)

    def estimate_parts(
        self,
        names: tuple[str, ...],
        rate: float,
        intra_s: float,
        price_per_hour: float,
        compression: str,
        sync: str,
        gpus: int | None = None,
    ) -> Estimate:
        """The estimate from aggregate parts (lets the optimizer skip re-summing): `rate` is
        the throughput sum_c g_c r_c and `gpus` the GPU count G; see the module docstring."""
        p = self._parts(names, rate, intra_s, compression, sync, gpus)
        setup = self.setup(names, gpus)
        total = p.eff_steps * p.step + setup
        gpu_cost = price_per_hour * total / 3600.0
        egress = p.exchanges * p.wan.egress_cost
        reserved = reserved_cost(
            self.bandwidth_price(names), len(names), p.exchanges * p.wan.bytes, total, setup
        )
        return Estimate(
            step_time_s=p.step,
            total_time_s=total,
            wan_bytes=round(p.exchanges * p.wan.bytes),
            cost=gpu_cost + egress + reserved,
            bandwidth_cost=reserved,
            compute_s=p.compute,
            intra_s=intra_s,
            wan_s=p.wan.latency_s + p.wan.bandwidth_s,
            overhead_s=p.wan.overhead_s,
            effective_steps=p.eff_steps,
            quality_cost=self.quality(compression, sync),
            gpu_cost=gpu_cost,
            egress_cost=egress,
            ring=p.wan.ring,
            bottleneck=p.wan.bottleneck,
            tree=p.wan.tree,
            step_overhead_s=p.extra,
            relay_ticks=p.relay_ticks,
            setup_s=setup,
            total_time_range_s=(
                total * self.snapshot.spread[0],
                total * self.snapshot.spread[1],
            ),
        )

    def score(
        self,
        names: tuple[str, ...],
        rate: float,
        intra_s: float,
        price_per_hour: float,
        compression: str,
        sync: str,
        gpus: int | None = None,
    ) -> tuple[float, float]:
        """(total time, cost) exactly as `estimate_parts` computes them, without the record."""
        p = self._parts(names, rate, intra_s, compression, sync, gpus)
        setup = self.setup(names, gpus)
        total = p.eff_steps * p.step + setup
        money = price_per_hour * total / 3600.0 + p.exchanges * p.wan.egress_cost
        bw = self.bandwidth_price(names)
        if bw > 0.0:
            money += reserved_cost(bw, len(names), p.exchanges * p.wan.bytes, total, setup)
        return total, money

    def score_set(
        self,
        names: tuple[str, ...],
        choices: Sequence[tuple[str, str]],
        allocs: Iterable[tuple[float, float, float, int]],
    ) -> tuple[list[float], list[float]]:
        """`score` of every (compressor, sync) in `choices` on each allocation of the set
        `names` (rate, intra_s, price per hour, GPUs): the total times and the
        costs, allocation after allocation, each in `choices` order.

        The search's hot path (thousands of choices a plan): what does not depend on the GPU
        split (WAN terms, the sync mode's constants, steps) is worked out once per choice,
        what depends only on the split (compute, the local part of the step) once per
        allocation, and the rest is `_parts` and `step_time` written out, term for term in
        the same order, so the floats are `score`'s bit for bit (the tests hold them to it).
        Two flat lists, not a pair per choice: building and freeing those pairs was a third
        of the compiled search (`scheduler.native`).
        """
        times: list[float] = []
        costs: list[float] = []
        if len(names) < 2:
            for r, i, p, g in allocs:
                for c, s in choices:
                    t, cost = self.score(names, r, i, p, c, s, g)
                    times.append(t)
                    costs.append(cost)
            return times, costs
        extra = self.snapshot.step_overhead_s
        setup0, per_gpu = self.setup(names), self.snapshot.setup_per_gpu_s
        terms: list[_ChoiceTerms] = []
        wans: dict[tuple[str, bool], WanTerms] = {}
        for c, s in choices:
            mode = self._modes.get((c, s))
            if mode is None:
                mode = self._mode(c, s)
            kind, runs_ahead, gossip, eff_steps, period = mode
            if kind == _PS:  # its region exchanges depend on the step: `_parts` itself
                terms.append((kind, runs_ahead, eff_steps, 0.0, 0.0, 0.0, period, 0.0, 0.0))
                continue
            wan = wans.get((c, gossip))
            if wan is None:
                wan = self.gossip_wan(names, c) if gossip else self.wan(names, c)
                wans[(c, gossip)] = wan
            # `step_seconds`' terms: the latency, and the transfer's fixed cost (coding: on
            # the workers' cores, crowded with them) and bytes
            periodic = kind in (_LOCAL, _STREAM)
            exchanges = periodic_exchanges(eff_steps, period) if periodic else eff_steps
            egress = exchanges * wan.egress_cost
            nbytes = exchanges * wan.bytes
            terms.append(
                (
                    kind,
                    runs_ahead,
                    eff_steps,
                    wan.latency_s,
                    wan.overhead_s,
                    wan.bandwidth_s,
                    period,
                    egress,
                    nbytes,
                )
            )
        slow = self.pace(names)[0]
        bw, n_names = self.bandwidth_price(names), len(names)
        for rate, intra_s, price, gpus in allocs:
            setup = setup0 + per_gpu * gpus
            # the batch split by throughput (gradient modes), or equally per worker (the
            # modes of local updates: the slowest member's GPUs set the pace)
            even = gpus * slow
            crowd = self.snapshot.crowding(gpus)
            local_s = self.work / rate * crowd + intra_s
            local_p = self.work / even * crowd + intra_s
            for k, (
                kind,
                runs_ahead,
                eff_steps,
                latency,
                fixed,
                bandwidth,
                every,
                egress,
                nbytes,
            ) in enumerate(terms):
                if kind == _PS:
                    c, s = choices[k]
                    t, money = self.score(names, rate, intra_s, price, c, s, gpus)
                    times.append(t)
                    costs.append(money)
                    continue
                periodic = kind in (_LOCAL, _STREAM)
                # `splits_by_rate`, from the terms
                local = local_p if periodic or runs_ahead else local_s
                # `crowded` and `step_seconds` written out (`max(a, b)` as `b if b > a else
                # a`, the same float: the builtin boxes its arguments in the compiled build)
                transfer = fixed * crowd + bandwidth  # x * 1.0 is x: `crowded`'s float
                if kind == _STALE:
                    floor = latency + transfer
                    step = floor if floor > local else local
                elif kind == _STREAM:
                    step = step_seconds(self._streams[choices[k]], local, latency, transfer)
                elif kind == _EVERY:
                    step = local + (latency + transfer)
                elif kind == _LOCAL:
                    step = local + (latency + transfer) / every
                else:
                    step = local
                step += extra
                total = eff_steps * step + setup
                times.append(total)
                money = price * total / 3600.0 + egress
                if bw > 0.0:
                    money += reserved_cost(bw, n_names, nbytes, total, setup)
                costs.append(money)
        return times, costs

    def _mode(self, compression: str, sync: str) -> tuple[int, bool, bool, float, int]:
        """`score_set`'s constants of one (compressor, sync) on any set: the step formula,
        whether fast clusters run ahead, gossip, the steps (`_parts`') and the period. Kept
        for the plan."""
        sm = self.sync(sync)
        if sm.value.kind is SyncKind.STREAMING:
            kind = _STREAM
            self._streams[(compression, sync)] = sm.value
        elif sm.kind == "async-ps":
            kind = _PS
        elif sm.kind == "local-sgd":
            kind = _LOCAL
        elif sm.kind == "stale" and sm.staleness >= 1:
            kind = _STALE
        else:
            kind = _EVERY
        # the steps the run takes: a lossy option's quality cost is weighed apart
        # (`grammar.quality`), not as steps it never runs
        mode = (
            kind,
            sm.runs_ahead,
            sm.neighbours,
            float(self.job.steps),
            sm.period,
        )
        self._modes[(compression, sync)] = mode
        return mode

    def _parts(
        self,
        names: tuple[str, ...],
        rate: float,
        intra_s: float,
        compression: str,
        sync: str,
        gpus: int | None,
    ) -> _Parts:
        steps = float(self.job.steps)
        crowd = self.snapshot.crowding(gpus)
        if len(names) < 2:
            compute = self.work / rate * crowd
            # one cluster's observed overhead: one worker alone waits on nobody
            extra = self.snapshot.local_step_overhead_s if intra_s > 0 else 0.0
            step = step_time(compute, intra_s, NO_WAN, _EVERY_STEP) + extra
            return _Parts(compute, step, steps, steps, NO_WAN, extra)
        sm = self.sync(sync)
        if not splits_by_rate(sm) and gpus is not None:
            # equal split per worker: the slowest member's GPUs set the pace of a step (a
            # tick, in which the fast clusters of the modes that run ahead take several
            # local steps: more samples, not fewer ticks; the run takes the job's steps)
            compute = self.work / (gpus * self.pace(names)[0]) * crowd
        else:  # the batch split by throughput (`batch_shares`): no cluster waits on another
            compute = self.work / rate * crowd
        extra = self.snapshot.step_overhead_s
        if sm.kind == "async-ps":
            wan, relays = self.ps_wan(names, compression)
            wan = crowded(wan, crowd)
            step = step_time(compute, intra_s, wan, sm) + extra
            ticks: list[tuple[str, int]] = []
            for region, relay in relays:  # one exchange every `relay_ticks` ticks, one in flight
                relay = crowded(relay, crowd)
                every = relay_ticks(step, relay.latency_s + relay.bandwidth_s + relay.overhead_s)
                ticks.append((region, every))
                share = relay_exchanges(steps, every) / steps  # a tick's part of them
                wan = WanTerms(
                    wan.latency_s,
                    wan.bandwidth_s,
                    wan.overhead_s,
                    wan.bytes + share * relay.bytes,
                    wan.egress_cost + share * relay.egress_cost,
                    wan.ring,
                    wan.bottleneck or relay.bottleneck,
                )
            return _Parts(compute, step, steps, steps, wan, extra, tuple(ticks))
        wan = self.gossip_wan(names, compression) if sm.neighbours else self.wan(names, compression)
        wan = crowded(wan, crowd)
        step = step_time(compute, intra_s, wan, sm) + extra
        exchanges = periodic_exchanges(steps, sm.period) if sm.kind == "local-sgd" else steps
        return _Parts(compute, step, steps, exchanges, wan, extra)


def relay_ticks(step_s: float, lasts_s: float) -> int:
    """Every how many ticks an async-ps region's server sends its progress to the global one:
    the ticks one exchange lasts and one more, so that the one in flight has landed when the
    next is due (the server sees a landing only at a push, and a run's ticks jitter: without
    the spare tick a region sent about a tenth fewer than planned, bench/results/promise.md).
    The plan's number, which the run keeps to (`training.TrainSpec.relay_ticks`): the bytes
    are the plan's whatever the run's clock, where "whenever the last one landed" made them
    follow it."""
    if lasts_s <= 0.0 or step_s <= 0.0:
        return 1
    return max(1, min(1_000_000, math.ceil(lasts_s / step_s - 1e-9) + 1))


def relay_exchanges(ticks: float, every: int) -> float:
    """A region's exchanges in a run of `ticks` ticks sent every `every`: one each time that
    many have passed, and the one its server's flush sends after the last tick
    (`training.sync.async_ps.RegionalServer.flush`)."""
    return float(math.floor(ticks / every) + 1) if every > 0 else ticks


def periodic_exchanges(steps: float, period: int) -> float:
    """The exchanges of a run of `steps` synced every `period` steps: one a period, and one
    more where the last step ends no period (the runtime averages that part period too)."""
    return float(math.ceil(steps / period)) if period > 0 else steps


class _Parts:
    """One choice's step time (with the fast clusters' speedup), steps and exchanges. A plain
    class, one per scored choice: see `WanTerms`."""

    __slots__ = ("compute", "eff_steps", "exchanges", "extra", "relay_ticks", "step", "wan")

    def __init__(
        self,
        compute: float,
        step: float,
        eff_steps: float,
        exchanges: float,
        wan: WanTerms,
        extra: float,
        relay_ticks: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.compute = compute
        self.step = step
        self.eff_steps = eff_steps
        self.exchanges = exchanges
        self.wan = wan
        self.extra = extra
        self.relay_ticks = relay_ticks


def reserved_cost(price_sum: float, n: int, wan_bytes: float, total: float, setup: float) -> float:
    """$ for the WAN rate a run of `n` clusters reserves on their ports: each holds its share
    of `wan_bytes` over the steps' time (`total - setup`, as `scheduler.bandwidth`'s
    `wan_rate_kbps`) for the whole run, at `price_sum` (the members' prices per Gbit/s-hour,
    summed)."""
    if price_sum <= 0.0 or n < 2 or wan_bytes <= 0.0 or total <= setup:
        return 0.0
    gbps = wan_bytes * 8.0 / n / (total - setup) / 1e9
    return price_sum * gbps * total / 3600.0


_ChoiceTerms = tuple[int, bool, float, float, float, float, float, float, float]
"""`score_set`'s figures of one (compressor, sync) on one set, whatever the GPU split: kind,
runs ahead (split equally), steps, latency s, the transfer's fixed cost s (coding: crowded
per split, `crowded`) and its bytes' s, the period, the run's egress and WAN bytes. A plain
tuple: the hot loop unpacks it, and a NamedTuple is built through its interpreted `__new__`
even when compiled."""


_EVERY_STEP = sync_model("every-step")
_EVERY, _LOCAL, _STALE, _STREAM, _PS = 0, 1, 2, 3, 4  # `score_set`'s step formulas (`step_time`)


def best_ring(
    names: tuple[str, ...], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[str, ...]:
    """Directed ring order minimising (slowest edge, total egress price); deterministic."""
    d = len(names)
    if d <= 2:
        return names
    if d <= EXACT_RING_MAX:
        return _exact_ring(
            names,
            [[edge[(a, b)][0] if a != b else 0.0 for b in names] for a in names],
            [[edge[(a, b)][1] if a != b else 0.0 for b in names] for a in names],
        )
    return _greedy_ring(names, edge)


def _ring_key(
    ring: Sequence[str], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[float, float]:
    pairs = list(zip(ring, [*ring[1:], ring[0]], strict=True))
    return (max(edge[p][0] for p in pairs), sum(edge[p][1] for p in pairs))


def _exact_ring(
    names: tuple[str, ...], time: list[list[float]], price: list[list[float]]
) -> tuple[str, ...]:
    """Depth-first search over ring orders, pruning paths whose bottleneck is already worse;
    `time[i][j]`, `price[i][j]`: the edge names[i] -> names[j] (index tables, not the edge
    map: it runs twice for every cluster set a plan scores).

    From names[0], the others in index order at every depth; the first of equal keys wins.
    """
    d = len(names)
    if d == 3:  # two orders; the second only if strictly better, as the search finds it
        t, p = time, price
        first = (max(t[0][1], t[1][2], t[2][0]), p[0][1] + p[1][2] + p[2][0])
        if (max(t[0][2], t[2][1], t[1][0]), p[0][2] + p[2][1] + p[1][0]) < first:
            return (names[0], names[2], names[1])
        return names
    path = [0]
    used = [False] * d
    best: list[int] = []
    best_w = best_p = 0.0

    def dfs(worst: float, paid: float) -> None:
        nonlocal best, best_w, best_p
        if best and (worst > best_w or (worst == best_w and paid >= best_p)):
            return
        last = path[-1]
        if len(path) == d:
            w = time[last][0]
            w = w if w > worst else worst  # max(worst, w): the first unless the second is more
            p = paid + price[last][0]
            if not best or w < best_w or (w == best_w and p < best_p):
                best, best_w, best_p = path[:], w, p
            return
        t_row, p_row = time[last], price[last]
        for nxt in range(1, d):
            if used[nxt]:
                continue
            used[nxt] = True
            path.append(nxt)
            w = t_row[nxt]
            dfs(w if w > worst else worst, paid + p_row[nxt])
            path.pop()
            used[nxt] = False

    dfs(0.0, 0.0)
    return tuple(names[i] for i in best)


def _greedy_ring(
    names: tuple[str, ...], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[str, ...]:
    """Nearest-neighbour by edge time, then 2-opt moves while the ring key improves."""
    ring = [names[0]]
    left = list(names[1:])
    while left:
        nxt = min(left, key=lambda n: (edge[(ring[-1], n)][0], n))
        ring.append(nxt)
        left.remove(nxt)
    key = _ring_key(ring, edge)
    improved = True
    rounds = 0
    while improved and rounds < 50:
        improved = False
        rounds += 1
        for i, j in itertools.combinations(range(1, len(ring)), 2):
            cand = ring[:i] + ring[i : j + 1][::-1] + ring[j + 1 :]
            ck = _ring_key(cand, edge)
            if ck < key:
                ring, key, improved = cand, ck, True
    return tuple(ring)


def estimate(
    snapshot: Snapshot,
    job: JobRequest,
    placement: Iterable[Assignment],
    compression: str = "none",
    sync: str = "every-step",
    efficiency: Mapping[str, float] | None = None,
) -> Estimate:
    """Cost-model estimate of one placement with a given compression and sync mode."""
    return CostModel(snapshot, job, efficiency).estimate(tuple(placement), compression, sync)
