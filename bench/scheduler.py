"""Scheduler benchmark: plan latency, plan quality against exhaustive search and baselines,
and plans on a topology built from published inter-region measurements.

    .venv/bin/python -m bench.scheduler [--quick]

Prints tables; no timing is asserted anywhere. Everything is seeded, so reruns give the same
instances (latencies vary with the machine).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from dataclasses import replace

from scheduler import (
    Assignment,
    Cluster,
    CostModel,
    JobRequest,
    Link,
    Objective,
    Plan,
    QoS,
    Snapshot,
    evaluate,
    plan,
)
from scheduler.rules import is_clique

GPU_MODELS = ("H100", "A100", "L40S", "L4", "V100", "T4", "MI300X", "A10", "H20", "B200")
PRICE = {
    "H100": 2.5,
    "A100": 1.4,
    "L40S": 1.0,
    "L4": 0.5,
    "V100": 0.6,
    "T4": 0.3,
    "MI300X": 2.2,
    "A10": 0.6,
    "H20": 0.9,
    "B200": 4.5,
}
AUTO = ("auto", "auto")


# --- random instances -------------------------------------------------------------------------


def random_snapshot(rng: random.Random, n: int, per_region: int = 10) -> Snapshot:
    """n clusters in regions on a 2-D 'map'; RTT ~ distance, bandwidth falls with distance.

    Links: full mesh inside a region, and every cluster to every cluster of the 3 nearest
    other regions (a measured sparse WAN, as agents would probe it).
    """
    n_regions = max(1, math.ceil(n / per_region))
    pos = [(rng.uniform(0, 300), rng.uniform(0, 100)) for _ in range(n_regions)]
    clusters = []
    for i in range(n):
        r = i % n_regions
        model = rng.choice(GPU_MODELS)
        clusters.append(
            Cluster(
                name=f"c{i:04d}",
                region=f"r{r:03d}",
                gpu_model=model,
                gpus_free=rng.choice([4, 8, 8, 16, 16, 32, 64]),
                intra_bandwidth_gbps=rng.choice([100.0, 200.0, 400.0, 800.0]),
                price_per_gpu_hour=round(PRICE[model] * rng.uniform(0.8, 1.3), 2),
            )
        )
    by_region: dict[int, list[str]] = {}
    for i, c in enumerate(clusters):
        by_region.setdefault(i % n_regions, []).append(c.name)

    def dist(a: int, b: int) -> float:
        return math.dist(pos[a], pos[b])

    links: list[Link] = []
    for names in by_region.values():
        for a, b in itertools.combinations(names, 2):
            links.append(Link(a, b, rng.choice([25.0, 50.0, 100.0]), rng.uniform(0.5, 3.0), 0.01))
    seen: set[tuple[int, int]] = set()
    for r in by_region:

        def from_r(o: int, r: int = r) -> float:
            return dist(r, o)

        near = sorted((o for o in by_region if o != r), key=from_r)[:3]
        for o in near:
            key = (min(r, o), max(r, o))
            if key in seen:
                continue
            seen.add(key)
            d = dist(r, o)
            for a in by_region[r]:
                for b in by_region[o]:
                    links.append(
                        Link(
                            a,
                            b,
                            max(0.5, 20.0 / (1 + d / 20)) * rng.uniform(0.7, 1.3),
                            2 + d,
                            0.02 if d < 100 else 0.05,
                        )
                    )
    return Snapshot(tuple(clusters), tuple(links))


def random_job(rng: random.Random, max_gpus: int = 64) -> JobRequest:
    params = rng.choice([125_000_000, 350_000_000, 1_300_000_000, 7_000_000_000])
    tokens = rng.choice([0.5e6, 1e6, 2e6])  # global batch in tokens
    gpus = rng.choice([g for g in (8, 16, 32, 64) if g <= max_gpus])
    return JobRequest(
        params=params,
        steps=rng.choice([1000, 5000]),
        min_gpus=gpus,
        max_gpus=gpus,
        flops_per_step=6 * params * tokens,
    )


# --- exhaustive search (same model, every allocation) ----------------------------------------


def brute_force_time(snap: Snapshot, job: JobRequest) -> float | None:
    """Best total time over every allocation, compression and sync mode."""
    model = CostModel(snap, job)
    names = [c.name for c in snap.clusters]
    free = [c.gpus_free for c in snap.clusters]
    comps = ("none", "bf16", "int8", "powersgd:8", "powersgd:2", "topk:0.01", "sign")
    syncs = ("every-step", "stale:1", "local-sgd:8", "local-sgd:32")
    best: float | None = None
    for gpus in itertools.product(*(range(f + 1) for f in free)):
        total = sum(gpus)
        if not job.min_gpus <= total <= job.max_gpus:
            continue
        used = tuple(sorted(n for n, g in zip(names, gpus, strict=True) if g))
        if not is_clique(snap, used):
            continue
        pl = tuple(Assignment(n, g) for n, g in zip(names, gpus, strict=True) if g)
        rate = sum(a.gpus * model.rate[a.cluster] for a in pl)
        intra = max(model.intra(a.cluster, a.gpus) for a in pl)
        price = sum(a.gpus * model.price[a.cluster] for a in pl)
        combos = [("none", "every-step")] if len(used) == 1 else itertools.product(comps, syncs)
        for c, s in combos:
            t = model.estimate_parts(used, rate, intra, price, c, s).total_time_s
            if best is None or t < best:
                best = t
    return best


def small_instance(rng: random.Random, n: int) -> tuple[Snapshot, JobRequest]:
    names = [f"s{i}" for i in range(n)]
    clusters = tuple(
        Cluster(
            nm,
            "r",
            rng.choice(GPU_MODELS),
            rng.choice([1, 2, 2, 3]),
            rng.choice([25.0, 100.0]),
            rng.choice([0.5, 1.0, 2.0]),
        )
        for nm in names
    )
    links = tuple(
        Link(
            a,
            b,
            rng.choice([0.2, 1.0, 5.0, 25.0]),
            rng.choice([2.0, 40.0, 150.0]),
            rng.choice([0.0, 0.02, 0.08]),
        )
        for a, b in itertools.combinations(names, 2)
        if rng.random() < 0.9
    )
    params = rng.choice([50_000_000, 350_000_000, 1_300_000_000])
    g = rng.randint(2, 6)
    job = JobRequest(
        params=params,
        steps=1000,
        min_gpus=g,
        max_gpus=g,
        flops_per_step=6 * params * rng.choice([2e5, 1e6]),
    )
    return Snapshot(clusters, links), job


# --- baselines --------------------------------------------------------------------------------


def greedy_most_free(snap: Snapshot, job: JobRequest) -> tuple[Assignment, ...] | None:
    """Kueue-style: largest free pools first, ignoring links beyond feasibility."""
    picked: list[Assignment] = []
    need = job.min_gpus
    for c in sorted(snap.clusters, key=lambda c: (-c.gpus_free, c.name)):
        if need == 0:
            break
        if not c.schedulable or c.gpus_free < 1:
            continue
        if not is_clique(snap, [a.cluster for a in picked] + [c.name]):
            continue
        take = min(c.gpus_free, need)
        picked.append(Assignment(c.name, take))
        need -= take
    return tuple(picked) if need == 0 else None


def oblivious(snap: Snapshot) -> Snapshot:
    """The same snapshot with every link at the median bandwidth and RTT."""
    bw = statistics.median(lk.bandwidth_gbps for lk in snap.links)
    rtt = statistics.median(lk.rtt_ms for lk in snap.links)
    return replace(
        snap, links=tuple(replace(lk, bandwidth_gbps=bw, rtt_ms=rtt) for lk in snap.links)
    )


def measure_of(
    snap: Snapshot,
    job: JobRequest,
    pl: tuple[Assignment, ...] | None,
    objective: Objective = "time",
) -> float | None:
    """Estimated completion time (objective time) or cost (objective cost) of a placement,
    with the compression and sync the planner would pick for it."""
    if pl is None:
        return None
    r = evaluate(snap, job, pl, objective)
    if not isinstance(r, Plan):
        return None
    return r.estimate.total_time_s if objective == "time" else r.estimate.cost


# --- real-world topology ----------------------------------------------------------------------

# RTT (ms): IBM Cloud VPC inter-region latency dashboard, monthly averages 29 Mar - 27 Apr 2025
# (https://cloud.ibm.com/docs/vpc?topic=vpc-network-latency-dashboard; source text in
# github.com/ibm-cloud-docs/vpc, _include-segments/network-latency.md).
RTT_MS = {
    ("dallas", "washington"): 31,
    ("dallas", "frankfurt"): 123,
    ("dallas", "london"): 113,
    ("dallas", "tokyo"): 142,
    ("dallas", "osaka"): 149,
    ("washington", "frankfurt"): 87,
    ("washington", "london"): 76,
    ("washington", "tokyo"): 168,
    ("washington", "osaka"): 176,
    ("frankfurt", "london"): 13,
    ("frankfurt", "tokyo"): 225,
    ("frankfurt", "osaka"): 233,
    ("london", "tokyo"): 236,
    ("london", "osaka"): 243,
    ("tokyo", "osaka"): 9,
}
# Bandwidth (Gb/s): Skyplane's inter-region iperf3 throughput grid (Jain et al., "Skyplane",
# NSDI 2023; github.com/skyplane-project/skyplane, profiles/throughput_mini.csv, 2022-01-17,
# one VM pair, 64 TCP connections), taking a measured pair of the same geography for each class:
# near same-continent gcp europe-west4 -> europe-west6 7.11; far same-continent aws us-east-2 ->
# us-west-2 4.81; N. America - Europe aws us-west-1 -> azure norwayeast 3.79; N. America - Asia
# Pacific gcp northamerica-northeast2 -> azure australiaeast 3.61; Europe - Asia aws
# ap-northeast-3 -> eu-west-2 2.71.
CONTINENT = {
    "dallas": "na",
    "washington": "na",
    "frankfurt": "eu",
    "london": "eu",
    "tokyo": "asia",
    "osaka": "asia",
}
BW_GBPS = {
    ("eu", "eu"): 7.11,
    ("asia", "asia"): 7.11,
    ("na", "na"): 4.81,
    ("eu", "na"): 3.79,
    ("asia", "na"): 3.61,
    ("asia", "eu"): 2.71,
}
# Egress $/GB: illustrative list-price order of magnitude (same continent 0.02, across 0.08).


def real_world() -> Snapshot:
    clusters = (
        Cluster("dallas", "us", "H100", 16, 400.0, 2.5),
        Cluster("washington", "us", "H100", 8, 400.0, 2.8),
        Cluster("frankfurt", "eu", "A100", 16, 200.0, 1.6),
        Cluster("london", "eu", "H100", 8, 400.0, 3.0),
        Cluster("tokyo", "ap", "A100", 32, 200.0, 1.4),
        Cluster("osaka", "ap", "L40S", 16, 100.0, 1.0),
    )
    links = []
    for (a, b), rtt in RTT_MS.items():
        ca, cb = sorted((CONTINENT[a], CONTINENT[b]))
        links.append(Link(a, b, BW_GBPS[(ca, cb)], float(rtt), 0.02 if ca == cb else 0.08))
    return Snapshot(clusters, tuple(links))


# --- main -------------------------------------------------------------------------------------


def fmt_pl(pl: tuple[Assignment, ...]) -> str:
    return "+".join(f"{a.cluster}:{a.gpus}" for a in pl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer instances (smoke run)")
    args = ap.parse_args()
    rng = random.Random(20261121)
    reps = 5 if args.quick else 20
    quality_n = 20 if args.quick else 120
    base_n = 10 if args.quick else 40

    print("## Plan latency (objective time and cost alternating, compression/sync auto;")
    print("## wall clock, and CPU time of this process, which a shared machine inflates less)")
    print("| clusters | links | GPU models | plans | median ms | p95 ms | max ms | median CPU ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (10, 100, 1000):
        snap = random_snapshot(rng, n)
        plan(snap, random_job(random.Random(0)))  # warm the snapshot's link index
        times = []
        cpu = []
        for i in range(reps):
            job = random_job(rng)
            t0, c0 = time.perf_counter(), time.process_time()
            plan(snap, job, "time" if i % 2 == 0 else "cost")
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        times.sort()
        p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
        models = len({c.gpu_model for c in snap.clusters})
        print(
            f"| {n} | {len(snap.links)} | {models} | {reps} | {statistics.median(times):.1f} "
            f"| {p95:.1f} | {times[-1]:.1f} | {statistics.median(cpu):.1f} |"
        )

    print()
    print("## Plan quality vs exhaustive search (objective time; 1-3 free GPUs per cluster,")
    print("## 2-6 GPUs per job, 90 % of cluster pairs linked)")
    print("| clusters | instances | feasible | within 2 % | worst ratio | mean ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows: dict[str, list[float]] = {"3-8 (exact search)": [], "9-10 (heuristic)": []}
    counts = dict.fromkeys(rows, 0)
    for i in range(quality_n):
        n = 3 + i % 8
        snap, job = small_instance(rng, n)
        key = "3-8 (exact search)" if n <= 8 else "9-10 (heuristic)"
        counts[key] += 1
        best = brute_force_time(snap, job)
        got = plan(snap, job, "time")
        if best is None:
            assert not isinstance(got, Plan), "planner found a plan exhaustive search did not"
            continue
        assert isinstance(got, Plan), "exhaustive search found a plan the planner missed"
        rows[key].append(got.estimate.total_time_s / best)
    allr = [r for v in rows.values() for r in v]
    for key, rs in [*rows.items(), ("all", allr)]:
        c = counts.get(key, sum(counts.values()))
        within = sum(1 for r in rs if r <= 1.02)
        print(
            f"| {key} | {c} | {len(rs)} | {within}/{len(rs)} "
            f"({100 * within / max(1, len(rs)):.0f} %) "
            f"| {max(rs, default=1):.4f} | {statistics.fmean(rs) if rs else 1:.4f} |"
        )

    print()
    print("## Against baselines (40-cluster random WAN, jobs of 8-64 GPUs; ratio = baseline")
    print("## estimated completion time / planner's, both scored by the same model)")
    print(
        "| baseline | instances | median ratio | geo-mean ratio | worst ratio | planner not worse |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    greedy_r: list[float] = []
    obl_r: list[float] = []
    for _ in range(base_n):
        snap = random_snapshot(rng, 40, per_region=5)
        job = random_job(rng)
        p = plan(snap, job, "time")
        if not isinstance(p, Plan):
            continue
        t = p.estimate.total_time_s
        g = measure_of(snap, job, greedy_most_free(snap, job))
        if g is not None:
            greedy_r.append(g / t)
        ob = plan(oblivious(snap), job, "time")
        o = measure_of(snap, job, ob.placement) if isinstance(ob, Plan) else None
        if o is not None:
            obl_r.append(o / t)
    for name, rs in (
        ("most-free-GPUs-first greedy", greedy_r),
        ("bandwidth-oblivious planner", obl_r),
    ):
        gm = math.exp(statistics.fmean(math.log(r) for r in rs))
        ok = sum(1 for r in rs if r >= 1 - 1e-9)
        print(
            f"| {name} | {len(rs)} | {statistics.median(rs):.2f} | {gm:.2f} | {max(rs):.2f} "
            f"| {ok}/{len(rs)} |"
        )

    print()
    print(
        "## Real-world topology: 6 clusters on 3 continents (IBM Cloud RTTs, Skyplane bandwidths)"
    )
    print("## (ratios: the baseline's time / the plan's for objective time, cost / cost for cost)")
    print(
        "| job | objective | planner placement | compression | sync | time h | cost $ "
        "| greedy ratio | oblivious ratio |"
    )
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    snap = real_world()
    jobs = {
        "350M, 16 GPUs": JobRequest(350_000_000, 20000, 16, 16, 6 * 350e6 * 1e6),
        "1.3B, 32 GPUs": JobRequest(1_300_000_000, 10000, 32, 32, 6 * 1.3e9 * 2e6),
        "7B, 48 GPUs": JobRequest(7_000_000_000, 5000, 48, 48, 6 * 7e9 * 4e6),
        "7B, 48 GPUs, EU+US only": JobRequest(
            7_000_000_000, 5000, 40, 48, 6 * 7e9 * 4e6, qos=QoS(regions=("us", "eu"))
        ),
    }
    for label, job in jobs.items():
        objective: Objective
        for objective in ("time", "cost"):
            p = plan(snap, job, objective)
            if not isinstance(p, Plan):
                print(f"| {label} | {objective} | infeasible: {p.reason} | | | | | | |")
                continue
            t = p.estimate.total_time_s
            mine = t if objective == "time" else p.estimate.cost
            g = measure_of(snap, job, greedy_most_free(snap, job), objective)
            ob = plan(oblivious(snap), job, objective)
            o = measure_of(snap, job, ob.placement, objective) if isinstance(ob, Plan) else None
            print(
                f"| {label} | {objective} | {fmt_pl(p.placement)} | {p.compression} | {p.sync} "
                f"| {t / 3600:.2f} | {p.estimate.cost:.0f} "
                f"| {'-' if g is None else f'{g / mine:.2f}'} "
                f"| {'-' if o is None else f'{o / mine:.2f}'} |"
            )


if __name__ == "__main__":
    main()
