"""A WAN-contended trace: link-aware placement against link-blind cpn (issue 49, item 5).

The network: `--dcs` datacenters, one cluster of `--gpus` A100s each, a full mesh of
`--link-gbps` links, and each datacenter's uplink and downlink of `--port-gbps`, shared by
all its paths. The trace: jobs of 8-48 GPUs (those above a cluster's size must span
datacenters), models of 50 M-1 B parameters, compression and sync left to the planner
(`auto`), Poisson arrivals.

What runs (the ground truth, the same for every policy): a fluid max-min share of each port.
A job crossing the WAN sends, from each of its clusters, its plan's bytes per step (with the
compression and sync its plan chose); its step takes its plan's compute, intra-cluster and
overhead time plus its WAN time at the bandwidth it gets. On each
port the jobs crossing it share its capacity: the largest bandwidth b, the same for all not
held lower elsewhere, at which their average rates (bytes per step over the step time at b)
fit the capacity; a job gets the least over its ports and its links. Rates are recomputed at
every arrival and completion. One pass over the ports (no iteration between them): an
approximation, the same for every policy.

Policies:
- `cpn-link-aware`: the reconcile loop's decisions (`engine.Cpn`) on the network as
  `controller.network.snapshot` shows it: each path at the least of its link and the free
  uplink and downlink it crosses (capacity less what placed jobs reserve: their plans'
  average rates, `scheduler.bandwidth.wan_need_kbps`); a path with nothing free is left out;
- `cpn-link-blind`: the same decisions on every link at its full bandwidth (cpn before
  issue 49: each job plans as if it had the WAN to itself);
- `kueue-first-fit`, `skypilot-cheapest`: whole jobs on one cluster (`engine.SingleCluster`):
  a job larger than any cluster never runs (counted as unfinished).

Run: `.venv/bin/python -m bench.sim.contended [--jobs 300] [--seed 0]`; writes
bench/results/sim-contended.{md,json}. Run nothing beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import scheduler
from bench.sim.engine import Cpn, Decision, Policy, kueue, request_of, skypilot
from bench.sim.network import Network
from bench.sim.trace import REF_GPU, STEP_S, TraceJob
from controller.network.snapshot import World
from scheduler.bandwidth import KBPS_PER_GBPS, free_gbps, path_gbps, wan_need_kbps
from scheduler.rules import release

RESULTS = Path(__file__).resolve().parents[1] / "results"


def build(dcs: int, gpus: int, link_gbps: float) -> Network:
    clusters = tuple(
        scheduler.Cluster(
            name=f"dc{i}",
            region=f"r{i}",
            gpu_model="A100",
            gpus_free=gpus,
            intra_bandwidth_gbps=200.0,
            price_per_gpu_hour=2.0 + 0.1 * i,
        )
        for i in range(dcs)
    )
    links = tuple(
        scheduler.Link(f"dc{a}", f"dc{b}", link_gbps, 10.0, 0.02)
        for a in range(dcs)
        for b in range(a + 1, dcs)
    )
    return Network(scheduler.Snapshot(clusters=clusters, links=links), dcs)


def trace(n: int, seed: int, mean_gap_s: float) -> list[TraceJob]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for k in range(n):
        t += rng.expovariate(1.0 / mean_gap_s)
        gpus = rng.choice((8, 16, 24, 32, 48))
        run = rng.uniform(600.0, 3600.0)
        params = int(math.exp(rng.uniform(math.log(5e7), math.log(1e9))))
        jobs.append(TraceJob(f"j{k:04d}", f"t{k % 4}", t, gpus, run, params, None))
    return jobs


@dataclass
class Running:
    decision: Decision
    request: scheduler.JobRequest
    start_s: float
    ready_s: float  # set-up done: steps begin
    steps_left: float
    need_kbps: dict[str, int]
    base_s: float  # step time less its WAN time
    wan_bits: float  # bits each cluster sends a step
    link_gbps: float  # the slowest link of its placement, at full bandwidth
    rate: float = 0.0  # steps a second now


def _shape(network: Network, d: Decision, steps: int) -> tuple[float, float, float]:
    """(step time less WAN time, bits each cluster sends a step, slowest link at full
    bandwidth) of the job as its plan runs it (its compression and sync)."""
    names = [a.cluster for a in d.placement]
    est = d.estimate
    base = max(est.step_time_s - est.wan_s, est.compute_s, 1e-6)  # wan_s may be amortised
    if len(names) < 2 or est.wan_bytes <= 0:
        return est.step_time_s, 0.0, math.inf
    links = network.snapshot.directed_links
    slowest = min(
        links[(a, b)].bandwidth_gbps for a in names for b in names if a != b and (a, b) in links
    )
    return base, est.wan_bytes * 8 / len(names) / max(steps, 1), slowest


def _rates(running: Sequence[Running], port_gbps: float) -> None:
    """Each running job's steps a second under the fluid max-min share of every port."""
    crossing: dict[str, list[Running]] = {}
    for r in running:
        if r.wan_bits > 0:
            for a in r.decision.placement:
                crossing.setdefault(a.cluster, []).append(r)

    def step_s(r: Running, gbps: float) -> float:
        return r.base_s + r.wan_bits / (gbps * 1e9)

    share: dict[str, float] = {}
    capacity = port_gbps * 1e9
    for port, jobs in crossing.items():

        def load(b: float, jobs: list[Running] = jobs) -> float:
            return sum(r.wan_bits / step_s(r, min(b, r.link_gbps)) for r in jobs)

        hi = max(r.link_gbps for r in jobs)
        if load(hi) <= capacity:
            share[port] = hi
            continue
        lo = 1e-6
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if load(mid) <= capacity else (lo, mid)
        share[port] = lo
    for r in running:
        if r.wan_bits <= 0:
            r.rate = 1.0 / r.base_s
            continue
        gbps = min([r.link_gbps, *(share[a.cluster] for a in r.decision.placement)])
        r.rate = 1.0 / step_s(r, gbps)


def _view(world: World, reserved: dict[str, int], port_gbps: float, aware: bool) -> World:
    """The world as the policy plans on it: with each path at the free share of its ports."""
    if not aware:
        return world
    free = {c.name: free_gbps(port_gbps, reserved.get(c.name, 0)) for c in world.snapshot.clusters}
    paths = ((k, path_gbps(k.bandwidth_gbps, free[k.a], free[k.b])) for k in world.snapshot.links)
    links = tuple(replace(k, bandwidth_gbps=gbps) for k, gbps in paths if gbps > 0)
    return World(replace(world.snapshot, links=links), world.origins)


@dataclass(frozen=True)
class Result:
    policy: str
    finished: int
    unfinished: int
    mean_jct_s: float
    p95_jct_s: float
    estimate_error_median: float
    estimate_error_p90: float
    port_utilisation: float
    most_reserved_of_capacity: float


def simulate(
    policy: Policy, network: Network, jobs: Sequence[TraceJob], port_gbps: float, aware: bool
) -> Result:
    world = World(network.snapshot, {})
    pending: list[TraceJob] = []
    running: list[Running] = []
    reserved: dict[str, int] = {}
    jct: list[float] = []
    errors: list[float] = []
    used_area, span, most = 0.0, 0.0, 0.0
    now, i = 0.0, 0
    while i < len(jobs) or running:
        _rates(running, port_gbps)
        ends = [(max(r.ready_s, now) + r.steps_left / r.rate, k) for k, r in enumerate(running)]
        nxt_end = min(ends, default=(math.inf, -1))
        nxt_arrival = jobs[i].arrival_s if i < len(jobs) else math.inf
        t = max(min(nxt_end[0], nxt_arrival), now)
        if math.isinf(t):
            break  # nothing runs and nothing arrives: the rest can never be placed
        demand = 0.0
        for r in running:  # advance
            stepping = max(0.0, t - max(r.ready_s, now))
            r.steps_left -= r.rate * stepping
            demand += len(r.decision.placement) * r.wan_bits * r.rate if r.wan_bits else 0.0
        used_area += demand * (t - now)
        span += t - now
        now = t
        # ends at `t` (its own estimate of its end, not a float's remainder of steps)
        done = [r for (end, _), r in zip(ends, running, strict=True) if end <= t * (1 + 1e-12)]
        for r in done:
            running.remove(r)
            jct.append(now - r.decision.job.arrival_s)
            actual = now - r.start_s
            errors.append(abs(r.decision.estimate.total_time_s - actual) / actual)
            for cluster, kbps in r.need_kbps.items():
                reserved[cluster] -= kbps
        if done:
            gone = {r.decision.job.id for r in done}
            world = World(
                release(world.snapshot, [j for j in world.snapshot.running if j.id in gone]),
                world.origins,
            )
        while i < len(jobs) and jobs[i].arrival_s <= now:
            pending.append(jobs[i])
            i += 1
        if not pending:
            continue
        decisions = policy.schedule(now, pending, _view(world, reserved, port_gbps, aware))
        placed = []
        cap = port_gbps * KBPS_PER_GBPS
        for d in decisions:
            need = wan_need_kbps(d.estimate, d.placement) if aware else {}
            if any(reserved.get(c, 0) + k > cap for c, k in need.items()):
                continue  # the reservation's conditional update refuses it: it waits
            placed.append(d)
            world = d.applied(world, now)
            request = request_of(d.job, now)
            for cluster, kbps in need.items():
                reserved[cluster] = reserved.get(cluster, 0) + kbps
                most = max(most, reserved[cluster] / (port_gbps * KBPS_PER_GBPS))
            base, bits, slowest = _shape(network, d, request.steps)
            running.append(
                Running(d, request, now, now + d.estimate.setup_s, float(request.steps), need,
                        base, bits, slowest)
            )  # fmt: skip
        gone = {d.job.id for d in placed}
        pending = [j for j in pending if j.id not in gone]
    ports = len(network.snapshot.clusters)
    return Result(
        policy.name,
        len(jct),
        len(jobs) - len(jct),
        statistics.fmean(jct) if jct else math.nan,
        sorted(jct)[int(0.95 * (len(jct) - 1))] if jct else math.nan,
        statistics.median(errors) if errors else math.nan,
        sorted(errors)[int(0.9 * (len(errors) - 1))] if errors else math.nan,
        used_area / span / (ports * port_gbps * 1e9) if span else 0.0,
        most,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dcs", type=int, default=6)
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--link-gbps", type=float, default=10.0)
    p.add_argument("--port-gbps", type=float, default=10.0)
    p.add_argument("--mean-gap-s", type=float, default=120.0)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    network = build(args.dcs, args.gpus, args.link_gbps)
    jobs = trace(args.jobs, args.seed, args.mean_gap_s)
    results = []
    for policy, aware in (
        (Cpn(network), True),
        (Cpn(network), False),
        (kueue(), False),
        (skypilot(), False),
    ):
        if isinstance(policy, Cpn):
            policy.name = "cpn-link-aware" if aware else "cpn-link-blind"
        t0 = time.process_time()
        result = simulate(policy, network, jobs, args.port_gbps, aware)
        results.append(result)
        print(json.dumps({**result.__dict__, "cpu_s": round(time.process_time() - t0, 1)}))
    if args.no_save:
        return
    regime = (
        f"{args.dcs} datacenters x {args.gpus} A100, links {args.link_gbps:g} Gbit/s, ports "
        f"{args.port_gbps:g} Gbit/s, {args.jobs} jobs, mean gap {args.mean_gap_s:g} s, seed "
        f"{args.seed}; compression and sync auto; reference GPU {REF_GPU}, {STEP_S} s steps"
    )
    (RESULTS / "sim-contended.json").write_text(
        json.dumps({"regime": regime, "results": [r.__dict__ for r in results]}, indent=1) + "\n"
    )
    print(regime)


if __name__ == "__main__":
    main()
