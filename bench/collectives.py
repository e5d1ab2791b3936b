"""Ring, tree and hub all-reduce between datacenters, on emulated links: where each wins.

Each case trains the same job (4 datacenters x 1 worker, `builtin:mnist1d-mlp`, every step,
uncompressed) on a local Ray over the ring, over the planner's binary tree
(`grammar.graph.reduction_tree`) and over the hub's star (`grammar.graph.hub_tree`), with
every link emulated at its regime's bandwidth and RTT (one for all, or the spokes' own links
slow), and prints the WAN seconds a step waited (`wan_s` / steps) beside the cost model's
prediction for the same links (`scheduler.estimate`'s terms, the planner's own numbers) and
which one it picks. Run alone on the machine (2 cores: nothing beside it):

    .venv/bin/python -m bench.collectives [--steps 30] [--no-save]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTERS = ("a", "b", "c", "d")
HUB = "a"
REGIMES = (  # (name, Mbit/s, RTT ms, Mbit/s between two spokes: None, the same)
    ("bandwidth-bound: 25 Mbit/s, 2 ms", 25.0, 2.0, None),
    ("25 Mbit/s, 10 ms", 25.0, 10.0, None),
    ("latency-bound: 1 Gbit/s, 150 ms", 1000.0, 150.0, None),
    ("slow spokes: a's links 1 Gbit/s, the others' 25 Mbit/s, 20 ms", 1000.0, 20.0, 25.0),
)
COLLECTIVES = ("ring", "tree", "hub")


def links_of(mbps: float, rtt_ms: float, spokes: float | None) -> dict[tuple[str, str], float]:
    """Each pair's Mbit/s: `mbps` on every link of the hub `a`, `spokes` (or `mbps`) between
    two others."""
    return {
        (x, y): mbps if HUB in (x, y) or spokes is None else spokes
        for i, x in enumerate(CLUSTERS)
        for y in CLUSTERS[i + 1 :]
    }


@dataclass(frozen=True)
class Row:
    regime: str
    collective: str
    planner_pick: str
    est_wan_s: float
    wan_s_per_step: float
    wall_s: float
    wan_bytes: int
    final_accuracy: float


def _params() -> int:
    from training.tasks import load_task

    model = load_task("builtin:mnist1d-mlp").model()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _estimates(
    pairs: dict[tuple[str, str], float], rtt_ms: float, params: int
) -> tuple[str, dict[str, float], tuple[str, ...], dict[str, dict[str, str]]]:
    """The planner's pick on these links, its WAN seconds a step for each collective, the
    ring it would run and each tree's parents."""
    from grammar.graph import hub_tree, reduction_tree
    from scheduler import Assignment, Cluster, JobRequest, Link, Snapshot, estimate
    from scheduler.cost import CostModel

    clusters = tuple(
        Cluster(name=n, region="r", gpu_model="H100", gpus_free=1, intra_bandwidth_gbps=100.0,
                price_per_gpu_hour=1.0)
        for n in CLUSTERS
    )  # fmt: skip
    links = tuple(Link(a, b, mbps / 1000.0, rtt_ms) for (a, b), mbps in pairs.items())
    snap = Snapshot(clusters, links)
    job = JobRequest(params=params, steps=1, min_gpus=4, max_gpus=4, flops_per_step=1e9)
    picked = estimate(snap, job, [Assignment(n, 1) for n in CLUSTERS])
    model = CostModel(snap, job)
    names = tuple(CLUSTERS)
    payload = params * 4.0
    ring = model.wan(names, "none").ring
    d = len(names)
    # `CostModel.wan`'s ring: 2(d - 1) rounds, each as slow as its slowest edge
    hop = max(
        model._edge(a, b)[0] + payload / d / model._edge(a, b)[1]
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True)
    )
    trees = {
        "tree": reduction_tree(names, model._pair_gbps),
        "hub": hub_tree(names, model._pair_gbps),
    }
    est = {"ring": 2 * (d - 1) * hop}
    for kind, parents in trees.items():
        terms = model._tree_terms(parents, payload, 0.0, ring)
        assert terms is not None  # every pair is linked
        est[kind] = terms.latency_s + terms.bandwidth_s
    shape = dict(picked.tree)
    pick = "ring" if not shape else "hub" if shape == trees["hub"] else "tree"
    return pick, est, ring, trees


def run_case(
    pairs: dict[tuple[str, str], float],
    rtt_ms: float,
    order: tuple[str, ...],
    tree: dict[str, str],
    steps: int,
) -> dict[str, Any]:
    """One run: the clusters in ring `order`, all-reducing over `tree` (empty: the ring)."""
    import training
    from training import TrainSpec
    from training.spec import LinkSpec

    spec = TrainSpec(
        task="builtin:mnist1d-mlp",
        clusters=dict.fromkeys(order, 1),
        steps=steps,
        eval_every=steps,
        compression="none",
        sync="every-step",
        links=[LinkSpec(a, b, mbps, rtt_ms) for (a, b), mbps in pairs.items()],
        tree=tree,
    )
    report = training.run(spec)
    return {
        "wan_s": report.wan_s,
        "wall_s": report.wall_s,
        "wan_bytes": report.wan_bytes_total - report.wan_setup_bytes,
        "accuracy": report.final_accuracy,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    import ray

    from training.runner import local_resources

    params = _params()
    rows: list[Row] = []
    ray.init(
        num_cpus=4,  # one worker a datacenter: 4 actors on 2 cores, mostly waiting on links
        resources=local_resources(dict.fromkeys(CLUSTERS, 1)),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        for name, mbps, rtt, spokes in REGIMES:
            pairs = links_of(mbps, rtt, spokes)
            pick, est, ring, trees = _estimates(pairs, rtt, params)
            for collective in COLLECTIVES:
                tree = trees.get(collective, {})
                got = run_case(pairs, rtt, ring, tree, args.steps)
                rows.append(
                    Row(name, collective, pick, est[collective], got["wan_s"] / args.steps,
                        got["wall_s"], got["wan_bytes"], got["accuracy"])
                )  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    lines = [
        "# Ring, tree and hub all-reduce between datacenters",
        "",
        f"`.venv/bin/python -m bench.collectives --steps {args.steps}`, "
        f"{time.strftime('%Y-%m-%d')}, on 2 CPU cores, nothing beside it. 4 datacenters x 1 "
        f"worker, `builtin:mnist1d-mlp` ({params:,} parameters, {params * 4 / 1e3:.0f} kB "
        "fp32), every step, uncompressed, every link emulated at the regime's bandwidth and "
        "RTT (`training.wan`: each hop waits for its link, timed from the sender's start). "
        "Tree: the binary tree (2 children a node; 4 datacenters make it 2 levels deep); hub: "
        "every datacenter under the best-connected one (`a` in the slow-spokes regime). "
        "WAN s/step: what the steps waited on the exchange; estimate: the cost model's for "
        "the same links; the planner's pick is the faster by its estimate.",
        "",
        "| regime | collective | planner's pick | est WAN s/step | WAN s/step | wall s | "
        "WAN bytes | final acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.regime} | {r.collective} | {r.planner_pick} | {r.est_wan_s:.4f} | "
            f"{r.wan_s_per_step:.4f} | {r.wall_s:.1f} | {r.wan_bytes:,} | "
            f"{r.final_accuracy:.3f} |"
        )
    lines += [
        "",
        "The links here are pairwise and independent, as the cost model's paths are: a hub's "
        "n - 1 transfers at once share no port. Where a datacenter reaches every peer through "
        "one uplink, the hub's carries n - 1 payloads each way; its reservation counts that "
        "(`scheduler.bandwidth.wan_need_kbps` shares a tree's bytes by each node's edges), "
        "its time estimate does not.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        (RESULTS / "collectives.md").write_text(text)
        (RESULTS / "collectives.json").write_text(
            json.dumps([r.__dict__ for r in rows], indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
