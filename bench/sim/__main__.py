"""Trace-driven simulation of cpn's placement against the policies operators use today.

Run: `.venv/bin/python -m bench.sim [--clusters 10,100,1000] [--jobs 2000] [--load 0.9]
[--seed 0] [--cost-slack 0.1] [--quick] [--json]`. Writes bench/results/sim-<clusters>.{md,json,png}
(a table, the numbers, and JCT distributions + utilisation over time) unless `--json` or
`--no-save`.
See bench/sim/engine.py (what is simulated), trace.py (the job trace), network.py (the network).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import scheduler
from bench.sim.engine import Cpn, Outcome, Policy, gavel_like, kueue, simulate, skypilot
from bench.sim.metrics import Metrics, measure
from bench.sim.network import Network, build_network
from bench.sim.trace import synthetic

RESULTS = Path(__file__).resolve().parents[1] / "results"
POLICIES = (
    "cpn",
    "cpn-cost",
    "cpn-no-bw",
    "kueue-first-fit",
    "skypilot-cheapest",
    "gavel-fastest",
)
PLANNER = "compiled" if scheduler.COMPILED else "interpreted"
"""Which build of the scheduler decided (`make compile`, `scheduler.native`): the same decisions,
at different speeds, so every speed figure names it."""
COST_SLACK = 0.1
"""`cpn-cost`: the cheapest plan at most this much slower than the fastest (`engine.Cpn`)."""


def policies(network: Network, names: list[str], slack: float = COST_SLACK) -> list[Policy]:
    make = {
        "cpn": lambda: Cpn(network),
        "cpn-cost": lambda: Cpn(network, slack=slack),
        "cpn-no-bw": lambda: Cpn(network, blind=True),
        "kueue-first-fit": kueue,
        "skypilot-cheapest": skypilot,
        "gavel-fastest": gavel_like,
    }
    return [make[n]() for n in names]


def run(
    n_clusters: int,
    n_jobs: int,
    load: float,
    seed: int,
    names: list[str],
    slack: float = COST_SLACK,
) -> tuple[dict[str, Metrics], list[Outcome]]:
    network = build_network(n_clusters, seed)
    trace = synthetic(n_jobs, network.capacity, load, seed)
    outcomes = [simulate(p, network, trace) for p in policies(network, names, slack)]
    return {o.policy: measure(o) for o in outcomes}, outcomes


def table(n_clusters: int, n_jobs: int, results: dict[str, Metrics]) -> str:
    cpn = results.get("cpn")
    head = (
        "| policy | mean JCT s | p95 JCT s | mean queue s | utilisation | cost $ | WAN GB "
        "| deadline misses | fairness (Jain) | split jobs | cpn mean-JCT gain "
        "| sim jobs per CPU-min |"
    )
    rows = [head, "|" + " --- |" * 12]
    for name, m in results.items():
        gain = cpn.mean_jct_s and m.mean_jct_s / cpn.mean_jct_s if cpn else math.nan
        rows.append(
            f"| {name} | {m.mean_jct_s:,.0f} | {m.p95_jct_s:,.0f} | {m.queue_s:,.0f} "
            f"| {m.utilisation:.1%} | {m.cost:,.0f} | {m.wan_bytes / 1e9:,.0f} "
            f"| {m.deadline_misses} | {m.fairness:.3f} | {m.split_jobs} | {gain:.2f}x "
            f"| {m.sim_jobs_per_cpu_min:,.0f} |"
        )
    return f"### {n_clusters} clusters, {n_jobs} jobs\n\n" + "\n".join(rows) + "\n"


def plot(n_clusters: int, outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for o in outcomes:
        jcts = sorted(r.finish_s - r.job.arrival_s for r in o.runs)
        if jcts:
            a1.plot(jcts, [(i + 1) / len(jcts) for i in range(len(jcts))], label=o.policy)
        xs = [t / 3600 for t, _ in o.busy]
        ys = [b / o.fleet_gpus for _, b in o.busy]
        a2.step(xs, ys, where="post", label=o.policy, linewidth=0.8)
    a1.set_xscale("log")
    a1.set_xlabel("job completion time, s (log)")
    a1.set_ylabel("fraction of jobs")
    a1.set_title(f"JCT distribution ({n_clusters} clusters)")
    a1.legend(fontsize=8)
    a2.set_xlabel("simulated time, h")
    a2.set_ylabel("GPUs held / fleet")
    a2.set_title("utilisation over time")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--clusters", default="100", help="Comma-separated network sizes.")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--load", type=float, default=0.9, help="Offered load / fleet capacity.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--cost-slack",
        type=float,
        default=COST_SLACK,
        help="cpn-cost: how much slower than the fastest plan the cheapest may be (0.1 = 10%%).",
    )
    p.add_argument("--quick", action="store_true", help="Smoke run: 12 clusters, 40 jobs.")
    p.add_argument("--json", action="store_true", help="Print the metrics as JSON only.")
    p.add_argument("--no-save", action="store_true", help="Write nothing to bench/results.")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for n in names:
        if n not in POLICIES:
            p.error(f"--policies: unknown {n!r}; use some of {', '.join(POLICIES)}")
    try:
        sizes = [int(c) for c in args.clusters.split(",") if c.strip()]
    except ValueError:
        p.error("--clusters: give whole numbers separated by commas, e.g. 10,100")
    if args.quick:
        sizes, args.jobs = [12], 40
    if any(s < 1 for s in sizes) or args.jobs < 1 or args.load <= 0:
        p.error("--clusters and --jobs must be >= 1 and --load > 0")
    if args.cost_slack < 0:
        p.error("--cost-slack must be >= 0")
    command = "python -m bench.sim " + " ".join(argv if argv is not None else sys.argv[1:])
    everything: dict[str, dict[str, dict[str, float | int]]] = {}
    tables: list[str] = []
    for size in sizes:
        t0 = time.monotonic()
        results, outcomes = run(size, args.jobs, args.load, args.seed, names, args.cost_slack)
        everything[str(size)] = {k: m.as_dict() for k, m in results.items()}
        tables.append(table(size, args.jobs, results))
        if not args.json:
            print(tables[-1], flush=True)
            took = time.monotonic() - t0
            print(f"({size} clusters simulated in {took:.1f} s, planner {PLANNER})", flush=True)
        if not args.json and not args.no_save:
            RESULTS.mkdir(exist_ok=True)
            plot(size, outcomes, RESULTS / f"sim-{size}.png")
    if args.json:
        last = everything[str(sizes[-1])]
        out = {"policies": last, "by_clusters": everything, "planner": PLANNER}
        print(json.dumps(out, allow_nan=True))
        return
    if not args.no_save:
        stem = "sim-" + "-".join(str(s) for s in sizes)
        (RESULTS / f"{stem}.json").write_text(json.dumps(everything, indent=1) + "\n")
        (RESULTS / f"{stem}.md").write_text(
            f"# Trace-driven simulation\n\nCommand: `{command}` (load {args.load}, seed "
            f"{args.seed}; planner {PLANNER}: `make compile` builds the compiled one).\n\n"
            + "\n".join(tables)
            + "\nPlots: "
            + ", ".join(f"sim-{s}.png" for s in sizes)
            + "\n"
        )


if __name__ == "__main__":
    main()
