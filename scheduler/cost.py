"""The cost model: compute, intra-cluster and WAN communication time, and money.

One step of hierarchical data parallelism on clusters S with g_c GPUs each:

- compute: the global batch is split in proportion to GPU throughput, so every GPU finishes
  its share at the same time: T_c = W / sum_c g_c r_c, with r_c = peak TFLOPS x efficiency.
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
- total time: steps x steps_factor(compressor) x steps_factor(sync) x step time.
- money: sum_c g_c x price_c(QoS class) x total hours + WAN GB per directed ring edge x that
  link's egress price.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler.calibrate import POOLED
from scheduler.compression import CompressorModel, SyncModel, compressor_model, sync_model
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
    ) -> None:
        self.snapshot = snapshot
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
            self._sync_cache[spec] = m
        return m

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
        est = self.estimate_parts(names, rate, intra, price, compression, sync)
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
    ) -> Estimate:
        """The estimate from aggregate parts (lets the optimizer skip re-summing)."""
        compute = self.work / rate
        if len(names) < 2:
            wan, steps_factor, sm = NO_WAN, 1.0, self.sync("every-step")
        else:
            wan = self.wan(names, compression)
            sm = self.sync(sync)
            steps_factor = self.compressor(compression).steps_factor * sm.steps_factor
        # the fleet's observed overhead: one worker alone waits on nobody
        extra = self.snapshot.step_overhead_s if len(names) > 1 or intra_s > 0 else 0.0
        step = step_time(compute, intra_s, wan, sm) + extra
        eff_steps = self.job.steps * steps_factor
        total = eff_steps * step
        exchanges = eff_steps / sm.period if sm.kind == "local-sgd" else eff_steps
        gpu_cost = price_per_hour * total / 3600.0
        egress = exchanges * wan.egress_cost
        return Estimate(
            step_time_s=step,
            total_time_s=total,
            wan_bytes=round(exchanges * wan.bytes),
            cost=gpu_cost + egress,
            compute_s=compute,
            intra_s=intra_s,
            wan_s=wan.latency_s + wan.bandwidth_s,
            overhead_s=wan.overhead_s,
            effective_steps=eff_steps,
            gpu_cost=gpu_cost,
            egress_cost=egress,
            ring=wan.ring,
            bottleneck=wan.bottleneck,
            step_overhead_s=extra,
        )

    def score(
        self,
        names: tuple[str, ...],
        rate: float,
        intra_s: float,
        price_per_hour: float,
        compression: str,
        sync: str,
    ) -> tuple[float, float]:
        """(total time, cost) exactly as `estimate_parts` computes them, without the record."""
        compute = self.work / rate
        if len(names) < 2:
            step = step_time(compute, intra_s, NO_WAN, _EVERY_STEP)
            total = self.job.steps * step
            return total, price_per_hour * total / 3600.0
        wan = self.wan(names, compression)
        sm = self.sync(sync)
        eff_steps = self.job.steps * self.compressor(compression).steps_factor * sm.steps_factor
        total = eff_steps * step_time(compute, intra_s, wan, sm)
        exchanges = eff_steps / sm.period if sm.kind == "local-sgd" else eff_steps
        return total, price_per_hour * total / 3600.0 + exchanges * wan.egress_cost


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
