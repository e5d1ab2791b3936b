"""A compute market on the simulator: three providers pricing differently over time.

Run: `.venv/bin/python -m bench.market [--clusters 10] [--jobs 3000] [--load 0.9] [--seed 0]`.
Writes bench/results/market.{json,png} unless `--no-save`; bench/results/market.md holds the
table with its reading.

The simulated network of `bench.sim` (the trace, links and list prices of `bench.sim.network`)
with its clusters owned by three providers in turn (each has clusters in every region):

- `steady` offers its list prices all the time;
- `nights` offers 40 % off from 00:00 to 08:00 of each simulated day and 15 % over list by day;
- `surge` prices by its own utilisation: list x (0.7 + 0.8 u), cheap while idle.

Two regimes, the same trace and placement code (`bench.sim.engine.Cpn`): `offers`, where
each placement clears against the offers in force (the planner sees them; the job pays what it
was placed at: a held quote), and `list`, one operator price list (the list prices, placed and
billed). Each with cpn's loop objective (`cpn`: time for jobs without a deadline, so prices
steer only deadline jobs) and the cost-aware one (`cpn-cost`: the cheapest plan at most 10 %
slower than the fastest). Providers are credited their GPU-hours at the price paid, less the
platform's fee (`FEE`, as `controller.money.settlement.split`); egress is reported apart.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import scheduler
from bench.sim.engine import Cpn, Outcome, simulate
from bench.sim.metrics import measure
from bench.sim.network import Network, build_network
from bench.sim.trace import synthetic

RESULTS = Path(__file__).resolve().parent / "results"
PROVIDERS = ("steady", "nights", "surge")
FEE = 0.1
DAY_S = 86400.0
Strategy = Callable[[float, float], float]
"""A provider's price multiplier over list at time t (s) and its utilisation u in [0, 1]."""
STRATEGIES: dict[str, Strategy] = {
    "steady": lambda t, u: 1.0,
    "nights": lambda t, u: 0.6 if (t % DAY_S) < 8 * 3600 else 1.15,
    "surge": lambda t, u: 0.7 + 0.8 * u,
}


def owners(network: Network) -> dict[str, str]:
    """Cluster name -> provider: the clusters in turn, so each has some in every region."""
    return {c.name: PROVIDERS[i % len(PROVIDERS)] for i, c in enumerate(network.snapshot.clusters)}


def offers(network: Network) -> Callable[[float, scheduler.Snapshot], scheduler.Snapshot]:
    """The snapshot's prices as each provider offers them at `now` (`engine.Reprice`)."""
    owner = owners(network)
    capacity = {c.name: c.gpus_free for c in network.snapshot.clusters}
    listed = {c.name: c.price_per_gpu_hour for c in network.snapshot.clusters}
    total = {p: sum(capacity[n] for n in owner if owner[n] == p) for p in PROVIDERS}

    def reprice(now: float, snap: scheduler.Snapshot) -> scheduler.Snapshot:
        busy = dict.fromkeys(PROVIDERS, 0)
        for c in snap.clusters:
            busy[owner[c.name]] += capacity[c.name] - c.gpus_free
        factor = {p: STRATEGIES[p](now, busy[p] / total[p] if total[p] else 0.0) for p in PROVIDERS}
        clusters = tuple(
            replace(c, price_per_gpu_hour=round(listed[c.name] * factor[owner[c.name]], 4))
            for c in snap.clusters
        )
        return replace(snap, clusters=clusters)

    return reprice


@dataclass(frozen=True)
class Party:
    revenue: float  # $ credited: GPU-hours at the prices paid, less the fee
    gpu_hours: float
    utilisation: float  # GPU-hours held / (its GPUs x the run's span)
    mean_price: float  # $ per GPU-hour paid on its clusters


@dataclass(frozen=True)
class Row:
    regime: str
    policy: str
    tenants_cost: float  # $: GPU-hours at the prices paid + egress
    gpu_cost: float
    mean_jct_s: float
    p95_jct_s: float
    mean_queue_s: float
    finished: int
    parties: dict[str, Party]
    platform_fee: float


def settle(network: Network, out: Outcome, regime: str) -> Row:
    owner = owners(network)
    capacity = {c.name: c.gpus_free for c in network.snapshot.clusters}
    m = measure(out)
    span = (
        max(r.finish_s for r in out.runs) - min(r.job.arrival_s for r in out.runs)
        if out.runs
        else 0.0
    )
    paid = dict.fromkeys(PROVIDERS, 0.0)
    hours = dict.fromkeys(PROVIDERS, 0.0)
    for r in out.runs:
        h = (r.finish_s - r.start_s) / 3600
        for a, price in zip(r.placement, r.prices, strict=True):
            paid[owner[a.cluster]] += a.gpus * h * price
            hours[owner[a.cluster]] += a.gpus * h
    parties = {}
    for p in PROVIDERS:
        gpus = sum(capacity[n] for n in owner if owner[n] == p)
        parties[p] = Party(
            revenue=paid[p] * (1 - FEE),
            gpu_hours=hours[p],
            utilisation=hours[p] * 3600 / (gpus * span) if span and gpus else 0.0,
            mean_price=paid[p] / hours[p] if hours[p] else math.nan,
        )
    gpu_cost = sum(paid.values())
    return Row(
        regime=regime,
        policy=out.policy,
        tenants_cost=m.cost,
        gpu_cost=gpu_cost,
        mean_jct_s=m.mean_jct_s,
        p95_jct_s=m.p95_jct_s,
        mean_queue_s=m.queue_s,
        finished=m.finished,
        parties=parties,
        platform_fee=gpu_cost * FEE,
    )


def run(n_clusters: int, n_jobs: int, load: float, seed: int) -> tuple[list[Row], list[Outcome]]:
    network = build_network(n_clusters, seed)
    trace = synthetic(n_jobs, network.capacity, load, seed)
    rows, outcomes = [], []
    for slack in (None, 0.1):
        for regime in ("list", "offers"):
            policy = Cpn(network, slack=slack)
            out = simulate(policy, network, trace, offers(network) if regime == "offers" else None)
            rows.append(settle(network, out, regime))
            outcomes.append(out)
    return rows, outcomes


def table(rows: list[Row]) -> str:
    head = (
        "| policy | regime | tenants' cost $ | GPU $ | mean JCT s | p95 JCT s | mean queue s "
        + "".join(f"| {p}: revenue $, util, $/GPU-h " for p in PROVIDERS)
        + "| platform fee $ |"
    )
    out = [head, "|" + " --- |" * (8 + len(PROVIDERS))]
    for r in rows:
        cells = "".join(
            f"| {r.parties[p].revenue:,.0f}, {r.parties[p].utilisation:.0%}, "
            f"{r.parties[p].mean_price:.2f} "
            for p in PROVIDERS
        )
        out.append(
            f"| {r.policy} | {r.regime} | {r.tenants_cost:,.0f} | {r.gpu_cost:,.0f} "
            f"| {r.mean_jct_s:,.0f} | {r.p95_jct_s:,.0f} | {r.mean_queue_s:,.0f} {cells}"
            f"| {r.platform_fee:,.0f} |"
        )
    return "\n".join(out) + "\n"


def plot(network: Network, outcomes: list[Outcome], path: Path) -> None:
    """GPUs each provider has busy over time, per regime, for the cost-aware policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    owner = owners(network)
    chosen = [o for o in outcomes if o.policy == "cpn-cost"]
    fig, axes = plt.subplots(1, len(chosen), figsize=(6.5 * len(chosen), 4.2), sharey=True)
    for ax, out, regime in zip(axes, chosen, ("one operator price list", "offers"), strict=True):
        events: dict[str, list[tuple[float, int]]] = {p: [] for p in PROVIDERS}
        for r in out.runs:
            for a in r.placement:
                events[owner[a.cluster]] += [(r.start_s, a.gpus), (r.finish_s, -a.gpus)]
        for p in PROVIDERS:
            xs, ys, level = [0.0], [0], 0
            for t, d in sorted(events[p]):
                level += d
                xs.append(t / 3600)
                ys.append(level)
            ax.step(xs, ys, where="post", label=p, linewidth=0.8)
        for day in range(int(max((r.finish_s for r in out.runs), default=0) // DAY_S) + 1):
            ax.axvspan(day * 24, day * 24 + 8, color="grey", alpha=0.1, linewidth=0)
        ax.set_title(f"cpn-cost, {regime}")
        ax.set_xlabel("simulated time, h (grey: the nights provider's discount)")
    axes[0].set_ylabel("GPUs busy on the provider's clusters")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--clusters", type=int, default=10)
    p.add_argument("--jobs", type=int, default=3000, help="3,000 at 10 clusters: two days.")
    p.add_argument("--load", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    rows, outcomes = run(args.clusters, args.jobs, args.load, args.seed)
    text = table(rows)
    print(text)
    if args.no_save:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "market.json").write_text(
        json.dumps({"args": vars(args), "fee": FEE, "rows": [asdict(r) for r in rows]}, indent=2)
    )
    plot(build_network(args.clusters, args.seed), outcomes, RESULTS / "market.png")
    print("wrote market.json and market.png; the table above goes in bench/results/market.md")


if __name__ == "__main__":
    main()
