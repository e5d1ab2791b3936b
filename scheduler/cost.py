"""The cost model: compute, intra-cluster and WAN communication time, and money.

One step of hierarchical data parallelism on clusters S with g_c GPUs each:

- compute: the runtime splits the global batch equally per worker, so the slowest cluster's
  GPUs set the pace of a step: T_c = W / (G r_min), G = sum_c g_c, r_c = peak TFLOPS x
  efficiency, r_min the slowest member's. Under `partial:H` and `async-ps:S` (`runs_ahead`)
  the fast clusters do not wait: in one step of the slowest, cluster c takes
  k_c = min(SPEED_BOUND, floor(r_c / r_min)) steps (the runtime's `steps_per_tick`), so the
  same samples take G / sum_c g_c k_c times the steps: the step time below is divided by that
  speedup, and so are the exchanges. (Called without the GPU count, `estimate_parts` and
  `score` fall back to a split by throughput, W / sum_c g_c r_c.)
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
- overlap: the exchange of one step overlaps its backward pass (BACKWARD_FRACTION of compute):
  every-step: (1-f)T_c + max(f T_c, T_i + O + T_w);
  local-sgd:H: (1-f)T_c + max(f T_c, T_i) + (O + T_w)/H;
  stale:s (s >= 1): max(local step, O + T_w,bandwidth, (O + T_w)/(s+1)) — up to s exchanges in
  flight hide latency but not bandwidth; stale:0 is every-step.
- gossip:P (`neighbours`): every P steps each cluster sends the payload n' to its neighbours
  in the runtime's gossip graph (`grammar.graph.gossip_graph`: the bandwidth-ordered ring
  plus exponential-graph chords as fast as its slowest edge), all at once: max over the
  graph's directed edges of a_e + n'/B_e, bytes (sum of degrees) x n'; otherwise local SGD
  of period P.
- total time: steps x steps_factor(compressor) x steps_factor(sync) x step time.
- money: sum_c g_c x price_c(QoS class) x total hours + WAN GB per directed ring edge x that
  link's egress price.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from grammar.graph import bandwidth_ring, gossip_graph
from scheduler.calibrate import POOLED
from scheduler.compression import (
    SPEED_BOUND,
    UNEVEN_LINK_RATIO,
    CompressorModel,
    SyncModel,
    compressor_model,
    sync_model,
)
from scheduler.gpus import DEFAULT_EFFICIENCY, peak_tflops
from scheduler.types import Assignment, Cluster, Estimate, JobRequest, Placement, Snapshot

BYTES_PER_PARAM = 4
ALPHA_INTRA_S = 10e-6
BACKWARD_FRACTION = 2.0 / 3.0
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


@dataclass(frozen=True)
class WanTerms:
    """One WAN exchange among a set of clusters with one compressor."""

    latency_s: float
    bandwidth_s: float
    overhead_s: float
    bytes: float
    egress_cost: float
    ring: tuple[str, ...]
    bottleneck: tuple[str, str] | None


NO_WAN = WanTerms(0.0, 0.0, 0.0, 0.0, 0.0, (), None)


def step_time(compute_s: float, intra_s: float, wan: WanTerms, sync: SyncModel) -> float:
    """One optimiser step given its parts (see the module docstring for the overlap model)."""
    f = BACKWARD_FRACTION
    wan_s = wan.latency_s + wan.bandwidth_s
    if sync.kind == "local-sgd":
        return (
            (1 - f) * compute_s
            + max(f * compute_s, intra_s)
            + (wan.overhead_s + wan_s) / sync.period
        )
    if sync.kind == "stale" and sync.staleness >= 1:
        local = (1 - f) * compute_s + max(f * compute_s, intra_s)
        return max(
            local,
            wan.overhead_s + wan.bandwidth_s,
            (wan.overhead_s + wan_s) / (sync.staleness + 1),
        )
    return (1 - f) * compute_s + max(f * compute_s, intra_s + wan.overhead_s + wan_s)


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
        self.rate: dict[str, float] = {
            c.name: c.peak_tflops * 1e12 * efficiency_of(c, efficiency) for c in snapshot.clusters
        }
        self.price: dict[str, float] = {
            c.name: c.price(job.qos.qos_class) for c in snapshot.clusters
        }
        self._intra_bw = {c.name: c.intra_bandwidth_gbps * 1e9 / 8 for c in snapshot.clusters}
        self._wan_cache: dict[tuple[tuple[str, ...], str], WanTerms] = {}
        self._ring_cache: dict[tuple[str, ...], tuple[tuple[str, ...], ...]] = {}
        self._comp_cache: dict[str, CompressorModel] = {}
        self._sync_cache: dict[str, SyncModel] = {}
        self._gossip_cache: dict[tuple[tuple[str, ...], str], WanTerms] = {}
        self._pace_cache: dict[tuple[str, ...], tuple[float, dict[str, int]]] = {}

    # --- parts -----------------------------------------------------------------------------

    def compressor(self, spec: str) -> CompressorModel:
        m = self._comp_cache.get(spec)
        if m is None:
            m = compressor_model(spec, self.job.params, self.job.layer_shapes)
            self._comp_cache[spec] = m
        return m

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
        edge = self._edge_costs(names, chunk)
        ring = min(self._rings(names), key=lambda r: (_ring_key(r, edge), r))
        worst = max(zip(ring, ring[1:] + ring[:1], strict=True), key=lambda e: edge[e][0])
        link = self.snapshot.link(*worst)
        assert link is not None
        alpha = link.rtt_ms / 2000.0
        bw = link.bandwidth_gbps * 1e9 / 8
        egress = 0.0
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            lk = self.snapshot.link(a, b)
            assert lk is not None
            egress += rounds * chunk / 1e9 * lk.egress_price_per_gb
        overhead = max(cm.overhead_flops_per_param * self.job.params / self.rate[n] for n in names)
        terms = WanTerms(
            latency_s=rounds * alpha,
            bandwidth_s=rounds * chunk / bw,
            overhead_s=overhead,
            bytes=d * rounds * chunk,
            egress_cost=egress,
            ring=ring,
            bottleneck=worst,
        )
        self._wan_cache[key] = terms
        return terms

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
        the graph and moves payload x (sum of the degrees) bytes, growing with the degree,
        not with the cluster count."""
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
            bandwidth_s=payload / (link.bandwidth_gbps * 1e9 / 8),
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

    def _rings(self, names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """Candidate ring orders for a cluster set: the best for the dense payload (bandwidth
        bound) and the best for a vanishing one (latency bound). Each compressor then uses
        the better of the two for its own chunk size, so a set costs two ring searches."""
        hit = self._ring_cache.get(names)
        if hit is None:
            dense = best_ring(names, self._edge_costs(names, self.nbytes / len(names)))
            latency = best_ring(names, self._edge_costs(names, 0.0))
            hit = (dense,) if dense == latency else (dense, latency)
            self._ring_cache[names] = hit
        return hit

    def _edge_costs(
        self, names: tuple[str, ...], chunk: float
    ) -> dict[tuple[str, str], tuple[float, float]]:
        """(round time, egress price) per directed edge among `names`."""
        out: dict[tuple[str, str], tuple[float, float]] = {}
        for a in names:
            for b in names:
                if a == b:
                    continue
                lk = self.snapshot.link(a, b)
                if lk is None:
                    raise ValueError(f"clusters {a!r} and {b!r} have no link between them")
                out[(a, b)] = (
                    lk.rtt_ms / 2000.0 + chunk / (lk.bandwidth_gbps * 1e9 / 8),
                    lk.egress_price_per_gb,
                )
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
            ahead=self.ahead_rate(names, (gpus[n] for n in names)),
        )
        shares = tuple(
            (a.cluster, a.gpus * self.rate[a.cluster] / rate)
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
        ahead: float | None = None,
    ) -> Estimate:
        """The estimate from aggregate parts (lets the optimizer skip re-summing): `rate` is
        the throughput sum_c g_c r_c, `gpus` the GPU count G and `ahead` the throughput with
        fast clusters running ahead (`ahead_rate`); see the module docstring."""
        p = self._parts(names, rate, intra_s, compression, sync, gpus, ahead)
        total = p.eff_steps * p.step
        gpu_cost = price_per_hour * total / 3600.0
        egress = p.exchanges * p.wan.egress_cost
        return Estimate(
            step_time_s=p.step,
            total_time_s=total,
            wan_bytes=round(p.exchanges * p.wan.bytes),
            cost=gpu_cost + egress,
            compute_s=p.compute,
            intra_s=intra_s,
            wan_s=p.wan.latency_s + p.wan.bandwidth_s,
            overhead_s=p.wan.overhead_s,
            effective_steps=p.eff_steps,
            gpu_cost=gpu_cost,
            egress_cost=egress,
            ring=p.wan.ring,
            bottleneck=p.wan.bottleneck,
            step_overhead_s=p.extra,
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
        ahead: float | None = None,
    ) -> tuple[float, float]:
        """(total time, cost) exactly as `estimate_parts` computes them, without the record."""
        p = self._parts(names, rate, intra_s, compression, sync, gpus, ahead)
        total = p.eff_steps * p.step
        return total, price_per_hour * total / 3600.0 + p.exchanges * p.wan.egress_cost

    def _parts(
        self,
        names: tuple[str, ...],
        rate: float,
        intra_s: float,
        compression: str,
        sync: str,
        gpus: int | None,
        ahead: float | None,
    ) -> _Parts:
        steps = float(self.job.steps)
        if len(names) < 2:
            compute = self.work / rate
            # the fleet's observed overhead: one worker alone waits on nobody
            extra = self.snapshot.step_overhead_s if intra_s > 0 else 0.0
            step = step_time(compute, intra_s, NO_WAN, _EVERY_STEP) + extra
            return _Parts(compute, step, steps, steps, NO_WAN, extra)
        sm = self.sync(sync)
        # equal split per worker: the slowest member's GPUs set the pace of a step
        even = gpus * self.pace(names)[0] if gpus is not None else rate
        speedup = (ahead if ahead is not None else even) / even if sm.runs_ahead else 1.0
        compute = self.work / even
        wan = self.gossip_wan(names, compression) if sm.neighbours else self.wan(names, compression)
        extra = self.snapshot.step_overhead_s
        step = (step_time(compute, intra_s, wan, sm) + extra) / speedup
        eff_steps = steps * self.compressor(compression).steps_factor * sm.steps_factor
        exchanges = eff_steps / speedup
        if sm.kind == "local-sgd":
            exchanges /= sm.period
        return _Parts(compute, step, eff_steps, exchanges, wan, extra)


@dataclass(slots=True)  # not frozen: one per scored choice (see optimizer._Choice)
class _Parts:
    """One choice's step time (with the fast clusters' speedup), steps and exchanges."""

    compute: float
    step: float
    eff_steps: float
    exchanges: float
    wan: WanTerms
    extra: float


_EVERY_STEP = sync_model("every-step")


def best_ring(
    names: tuple[str, ...], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[str, ...]:
    """Directed ring order minimising (slowest edge, total egress price); deterministic."""
    d = len(names)
    if d <= 2:
        return names
    if d <= EXACT_RING_MAX:
        return _exact_ring(names, edge)
    return _greedy_ring(names, edge)


def _ring_key(
    ring: Sequence[str], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[float, float]:
    pairs = list(zip(ring, [*ring[1:], ring[0]], strict=True))
    return (max(edge[p][0] for p in pairs), sum(edge[p][1] for p in pairs))


def _exact_ring(
    names: tuple[str, ...], edge: Mapping[tuple[str, str], tuple[float, float]]
) -> tuple[str, ...]:
    """Depth-first search over ring orders, pruning paths whose bottleneck is already worse."""
    start = names[0]
    rest = names[1:]
    best: list[tuple[tuple[float, float], tuple[str, ...]]] = []

    def dfs(path: list[str], left: list[str], worst: float, price: float) -> None:
        if best and (worst, price) >= best[0][0]:
            return
        if not left:
            close = edge[(path[-1], start)]
            key = (max(worst, close[0]), price + close[1])
            if not best or key < best[0][0]:
                best[:] = [(key, tuple(path))]
            return
        for i, nxt in enumerate(left):
            e = edge[(path[-1], nxt)]
            dfs([*path, nxt], left[:i] + left[i + 1 :], max(worst, e[0]), price + e[1])

    dfs([start], list(rest), 0.0, 0.0)
    return best[0][1]


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
