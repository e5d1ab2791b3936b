"""Ring against tree all-reduce between datacenters, on emulated links: where each wins.

Each case trains the same job (4 datacenters x 1 worker, `builtin:mnist1d-mlp`, every step,
uncompressed) twice on a local Ray, once over the ring and once over the planner's tree
(`grammar.graph.reduction_tree`), with every link emulated at one bandwidth and RTT, and
prints the WAN seconds a step waited (`wan_s` / steps) beside the cost model's prediction for
the same links (`scheduler.estimate`, the planner's own numbers) and which one it picks. Run
alone on the machine (2 cores: nothing beside it):

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
REGIMES = (  # (name, Mbit/s, RTT ms)
    ("bandwidth-bound: 25 Mbit/s, 10 ms", 25.0, 10.0),
    ("latency-bound: 1 Gbit/s, 150 ms", 1000.0, 150.0),
)


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


def _estimates(mbps: float, rtt_ms: float, params: int) -> tuple[str, dict[str, float]]:
    """The planner's pick on these links and its WAN seconds per step for ring and tree."""
    from scheduler import Assignment, Cluster, JobRequest, Link, Snapshot, estimate
    from scheduler.cost import CostModel

    clusters = tuple(
        Cluster(name=n, region="r", gpu_model="H100", gpus_free=1, intra_bandwidth_gbps=100.0,
                price_per_gpu_hour=1.0)
        for n in CLUSTERS
    )  # fmt: skip
    links = tuple(
        Link(a, b, mbps / 1000.0, rtt_ms) for i, a in enumerate(CLUSTERS) for b in CLUSTERS[i + 1 :]
    )
    snap = Snapshot(clusters, links)
    job = JobRequest(params=params, steps=1, min_gpus=4, max_gpus=4, flops_per_step=1e9)
    where = [Assignment(n, 1) for n in CLUSTERS]
    picked = estimate(snap, job, where)
    model = CostModel(snap, job)
    names = tuple(CLUSTERS)
    payload = params * 4.0
    tree = model._tree_terms(names, payload, 0.0, model.wan(names, "none").ring)
    assert tree is not None  # every pair is linked
    d = len(names)
    alpha, bw = rtt_ms / 2000.0, mbps * 1e6 / 8
    ring_s = 2 * (d - 1) * (alpha + payload / d / bw)  # `CostModel.wan`'s ring, even links
    return ("tree" if picked.tree else "ring"), {
        "ring": ring_s,
        "tree": tree.latency_s + tree.bandwidth_s,
    }


def run_case(mbps: float, rtt_ms: float, tree: bool, steps: int) -> dict[str, Any]:
    import training
    from grammar.graph import reduction_tree
    from training import TrainSpec

    spec = TrainSpec(
        task="builtin:mnist1d-mlp",
        clusters=dict.fromkeys(CLUSTERS, 1),
        steps=steps,
        eval_every=steps,
        compression="none",
        sync="every-step",
        link_mbps=mbps,
        rtt_ms=rtt_ms,
        tree=reduction_tree(CLUSTERS, None) if tree else {},
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
        for name, mbps, rtt in REGIMES:
            pick, est = _estimates(mbps, rtt, params)
            for collective in ("ring", "tree"):
                got = run_case(mbps, rtt, collective == "tree", args.steps)
                rows.append(
                    Row(name, collective, pick, est[collective], got["wan_s"] / args.steps,
                        got["wall_s"], got["wan_bytes"], got["accuracy"])
                )  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    lines = [
        "# Ring against tree all-reduce between datacenters",
        "",
        f"`.venv/bin/python -m bench.collectives --steps {args.steps}`, "
        f"{time.strftime('%Y-%m-%d')}, on 2 CPU cores, nothing beside it. 4 datacenters x 1 "
        f"worker, `builtin:mnist1d-mlp` ({params:,} parameters, {params * 4 / 1e3:.0f} kB "
        "fp32), every step, uncompressed, every link emulated at the regime's bandwidth and "
        "RTT (`training.wan`: each hop waits for its link, timed from the sender's start). "
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
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        (RESULTS / "collectives.md").write_text(text)
        (RESULTS / "collectives.json").write_text(
            json.dumps([r.__dict__ for r in rows], indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
