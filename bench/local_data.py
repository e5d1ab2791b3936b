"""Local data: every sync mode on label-skewed local data against synchronous training on
shared data, several seeds (issue 47, item 6).

3 clusters x 1 worker on one machine, every inter-cluster link emulated (default 100 Mbit/s,
10 ms RTT), builtin:mnist1d-mlp, fp32 payloads. Local data is `data: local`'s built-in split:
each cluster holds only its own labels (label l in cluster l mod 3). The reference is every-step
on shared data at the same steps. The modes with an outer step (local SGD, partial, streaming)
run with DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9) and with what cpn runs on local
data (`training.spec.OUTER_BY_DATA`: the plain average); local SGD and streaming also with
SCAFFOLD's drift correction (`TrainSpec.drift_correction`); streaming as cpn runs it on
local data (one fragment, `grammar.parse_sync`) and with its fragments named. Each row
gives the final accuracy over the seeds (mean, min, max) and its gap to the reference's
mean. Writes bench/results/local-data.{md,json,png}.

    .venv/bin/python -m bench.local_data [--steps 600] [--seeds 1,2,3] [--only local-sgd:16]
        [--missing]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTERS = {"a": 1, "b": 1, "c": 1}
TASK = "builtin:mnist1d-mlp"
DILOCO = (0.7, 0.9)

# (label, sync, data, outer (lr, momentum) or None: the run's default for its data,
#  SCAFFOLD's drift correction)
RUNS: tuple[tuple[str, str, str, tuple[float, float] | None, bool], ...] = (
    ("every-step, shared data (reference)", "every-step", "shared", None, False),
    ("every-step", "every-step", "local", None, False),
    ("local-sgd:16, DiLoCo outer step", "local-sgd:16", "local", DILOCO, False),
    ("local-sgd:16, plain average (default)", "local-sgd:16", "local", None, False),
    ("local-sgd:16, plain average + SCAFFOLD", "local-sgd:16", "local", None, True),
    ("local-sgd:8, plain average (default)", "local-sgd:8", "local", None, False),
    ("local-sgd:8, plain average + SCAFFOLD", "local-sgd:8", "local", None, True),
    ("partial:16, DiLoCo outer step", "partial:16", "local", DILOCO, False),
    ("partial:16, plain average (default)", "partial:16", "local", None, False),
    # streaming:16 on local data is one fragment, delay 3 (`grammar.parse_sync`)
    ("streaming:16 (f1:d3), DiLoCo outer step", "streaming:16", "local", DILOCO, False),
    ("streaming:16 (f1:d3), plain average (default)", "streaming:16", "local", None, False),
    ("streaming:16 (f1:d3), plain average + SCAFFOLD", "streaming:16", "local", None, True),
    # fragments named: what of their cost is the staggering, what the delay
    ("streaming:16:f4:d3, four fragments", "streaming:16:f4:d3", "local", None, False),
    ("streaming:16:f4:d0, four fragments, no delay", "streaming:16:f4:d0", "local", None, False),
    ("streaming:16:f2:d1, two fragments", "streaming:16:f2:d1", "local", None, False),
    ("streaming:16:f1:d1, one fragment, delay 1", "streaming:16:f1:d1", "local", None, False),
    ("gossip:16", "gossip:16", "local", None, False),
    ("async-ps:4", "async-ps:4", "local", None, False),
)


@dataclass(frozen=True)
class Setup:
    steps: int
    seeds: tuple[int, ...]
    mbps: float
    rtt_ms: float


def run_one(
    label: str, sync: str, data: str, outer: Any, drift: bool, seed: int, s: Setup
) -> dict[str, Any]:
    import training
    from training import TrainSpec

    lr, momentum = outer if outer is not None else (None, None)
    r = training.run(
        TrainSpec(
            task=TASK,
            clusters=dict(CLUSTERS),
            sync=sync,
            compression="none",
            steps=s.steps,
            seed=seed,
            data=data,
            link_mbps=s.mbps,
            rtt_ms=s.rtt_ms,
            eval_every=max(1, s.steps // 6),
            outer_lr=lr,
            outer_momentum=momentum,
            drift_correction=drift,
        )
    )
    return {
        "label": label,
        "sync": sync,
        "data": data,
        "outer": list(outer) if outer is not None else None,
        "drift_correction": drift,
        "seed": seed,
        "final_accuracy": r.final_accuracy,
        "final_eval_loss": r.final_eval_loss,
        "wall_s": r.wall_s,
        "wan_mb": r.wan_bytes_total / 1e6,
        "history": [
            {"step": h["step"], "accuracy": h.get("accuracy")}
            for h in r.history
            if h.get("accuracy") is not None
        ],
    }


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per label: mean, min and max final accuracy over the seeds, and the gap to the
    reference's mean (points)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    acc = {lb: [r["final_accuracy"] for r in rows if r["label"] == lb] for lb in labels}
    ref = statistics.mean(acc[RUNS[0][0]]) if acc.get(RUNS[0][0]) else float("nan")
    return [
        {
            "label": lb,
            "mean": statistics.mean(acc[lb]),
            "min": min(acc[lb]),
            "max": max(acc[lb]),
            "gap": 100 * (ref - statistics.mean(acc[lb])),
            "n": len(acc[lb]),
        }
        for lb in labels
    ]


def table(rows: list[dict[str, Any]], s: Setup, command: str) -> str:
    lines = [
        "# Local data: sync modes on label-skewed local data (issue 47, item 6)",
        "",
        f"`{command}`",
        "",
        f"Task {TASK}, 3 clusters x 1 worker on one 2-core machine (nothing else ran), links "
        f"emulated at {s.mbps:g} Mbit/s and {s.rtt_ms:g} ms RTT, fp32 payloads, {s.steps} "
        f"steps, seeds {', '.join(map(str, s.seeds))}. Local data: each cluster holds only its "
        "own labels (label l in cluster l mod 3). Gap: points below the reference's mean "
        "(every-step on shared data at the same steps). Goal: every local-data mode within 5 "
        "points.",
        "",
        "| run | final accuracy, mean | min | max | gap (points) | within 5 |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary(rows):
        ok = "reference" if r["label"] == RUNS[0][0] else ("yes" if r["gap"] <= 5 else "no")
        lines.append(
            f"| {r['label']} | {r['mean']:.3f} | {r['min']:.3f} | {r['max']:.3f} | "
            f"{r['gap']:+.1f} | {ok} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = summary(rows)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(summ) + 1.2))
    for i, r in enumerate(summ):
        ax.plot([r["min"], r["max"]], [i, i], color="0.6")
        ax.plot([r["mean"]], [i], "o", color="C0" if r["gap"] <= 5 else "C3")
    ref = summ[0]["mean"]
    ax.axvline(ref, color="k", lw=0.8)
    ax.axvline(ref - 0.05, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(summ)), [r["label"] for r in summ])
    ax.invert_yaxis()
    ax.set_xlabel("final accuracy (mean, min-max over seeds); dashed: 5 points below reference")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--only", default="", help="re-run these syncs, merge into the json")
    parser.add_argument(
        "--missing", action="store_true", help="run only the rows the json lacks, merge them"
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    setup = Setup(args.steps, tuple(int(x) for x in args.seeds.split(",")), args.mbps, args.rtt_ms)
    only = frozenset(x for x in args.only.split(",") if x)
    out = Path(args.out)
    saved = json.loads((out / "local-data.json").read_text()) if only or args.missing else None
    have = {r["label"] for r in saved["runs"]} if saved is not None else set()
    command = ".venv/bin/python -m bench.local_data " + shlex.join(sys.argv[1:])

    import ray

    from training.runner import local_resources

    ray.init(
        num_cpus=2,
        resources=local_resources(CLUSTERS),
        include_dashboard=False,
        log_to_driver=False,
    )
    rows: list[dict[str, Any]] = []
    try:
        for label, sync, data, outer, drift in RUNS:
            if (only and sync not in only) or (args.missing and label in have):
                continue
            for seed in setup.seeds:
                rows.append(run_one(label, sync, data, outer, drift, seed, setup))
                print(f"{label} seed {seed}: {rows[-1]['final_accuracy']:.3f}", flush=True)
    finally:
        ray.shutdown()
    if saved is not None:
        rerun = {r["label"] for r in rows}
        rows = [r for r in saved["runs"] if r["label"] not in rerun] + rows
        order = {lb: i for i, (lb, *_) in enumerate(RUNS)}
        rows = [r for r in rows if r["label"] in order]  # what the bench no longer runs
        rows.sort(key=lambda r: (order[r["label"]], r["seed"]))
        command = saved["command"] + " ; then " + command
    report = table(rows, setup, command)
    print("\n" + report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "local-data.md").write_text(report)
    (out / "local-data.json").write_text(
        json.dumps({"command": command, "setup": setup.__dict__, "runs": rows}, indent=1)
    )
    plot(rows, out / "local-data.png")


if __name__ == "__main__":
    main()
