"""Compressed cross-cluster data parallelism against plain synchronous data parallelism.

3 clusters x 2 workers on one machine, every inter-cluster link emulated at 100 Mbit/s and
30 ms RTT. For MNIST-1D CNN and the character transformer, each mode runs the same number of
steps; the table gives time to the target accuracy, final accuracy and WAN bytes, then the
compressors' own throughput. Saves bench/results/training.png (accuracy against wall time) and
bench/results/training.json.

    .venv/bin/python -m bench.training [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTERS = {"a": 2, "b": 2, "c": 2}
MBPS, RTT_MS = 100.0, 30.0

# (label, compression, sync)
MODES = [
    ("sync DP fp32 (baseline)", "none", "every-step"),
    ("cpn topk:0.01 every-step", "topk:0.01", "every-step"),
    ("cpn powersgd:4 every-step", "powersgd:4", "every-step"),
    ("cpn stale:2 int8", "int8", "stale:2"),
    ("cpn DiLoCo local-sgd:16 int8", "int8", "local-sgd:16"),
    ("cpn DiLoCo local-sgd:32 int8", "int8", "local-sgd:32"),
    ("cpn adaptive", "none", "adaptive"),
]
# task -> (steps, target accuracy, evaluations per run)
TASKS = {
    "builtin:mnist1d-cnn": (480, 0.80, 24),
    "builtin:char-transformer": (240, 0.42, 16),
}


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    for h in history:
        if h["accuracy"] is not None and h["accuracy"] >= target:
            return float(h["wall_s"])
    return None


def run_modes(quick: bool) -> list[dict[str, Any]]:
    import training
    from training import TrainSpec
    from training.runner import WorkerPool

    pool = WorkerPool()  # one set of worker processes for every run: startup is not timed anyway
    rows = []
    for task, (steps, target, evals) in TASKS.items():
        if quick:
            steps, evals = steps // 4, max(4, evals // 4)
        for label, comp, sync in MODES:
            spec = TrainSpec(
                task=task,
                clusters=CLUSTERS,
                compression=comp,
                sync=sync,
                steps=steps,
                link_mbps=MBPS,
                rtt_ms=RTT_MS,
                eval_every=max(1, steps // evals),
            )
            t = time.perf_counter()
            r = training.run(spec, pool=pool)
            rows.append(
                {
                    "task": task,
                    "mode": label,
                    "compression": comp,
                    "sync": sync,
                    "steps": r.steps,
                    "target": target,
                    "time_to_target_s": time_to(r.history, target),
                    "final_accuracy": r.final_accuracy,
                    "wall_s": r.wall_s,
                    "compute_s": r.compute_s,
                    "comm_s": r.comm_s,
                    "wan_bytes": r.wan_bytes_total,
                    "compression_ratio": r.compression_ratio,
                    "emulated": r.wan_emulated,
                    "history": r.history,
                    "run_s": time.perf_counter() - t,
                }
            )
            print(
                f"  {task} {label}: acc {r.final_accuracy:.3f} wall {r.wall_s:.1f}s "
                f"WAN {r.wan_bytes_total / 1e6:.2f} MB (run {rows[-1]['run_s']:.0f}s)",
                flush=True,
            )
    pool.close()
    return rows


def compressor_throughput() -> list[dict[str, Any]]:
    """MB of fp32 gradient per second through compress + serialize + parse + decompress."""
    import torch

    from training.compression import make_compressor, packet_from_bytes, packet_to_bytes

    torch.manual_seed(0)
    torch.set_num_threads(1)
    shapes = [(1024, 1024), (1024, 1024), (2048, 512), (4096,), (1024,)]
    grads = [torch.randn(s) for s in shapes]
    mb = sum(g.numel() for g in grads) * 4 / 1e6
    out = []
    for spec in ("none", "fp16", "bf16", "int8", "int8:minmax", "topk:0.01", "powersgd:4", "sign"):
        comp, peer = make_compressor(spec), make_compressor(spec)
        nbytes, reps, t0 = 0, 0, time.perf_counter()
        while reps < 3 or (time.perf_counter() - t0 < 1.0 and reps < 20):
            nbytes = 0
            for i, g in enumerate(grads):
                data = packet_to_bytes(comp.compress(f"p{i}", g))
                nbytes += len(data)
                peer.decompress(packet_from_bytes(data))
            comp.step()
            reps += 1
        dt = (time.perf_counter() - t0) / reps
        out.append({"compressor": spec, "mb_per_s": mb / dt, "ratio": mb * 1e6 / nbytes})
    return out


def _fmt_s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}"


def print_tables(rows: list[dict[str, Any]], comp: list[dict[str, Any]]) -> None:
    print(
        f"\nEmulated WAN: {len(CLUSTERS)} clusters x {next(iter(CLUSTERS.values()))} workers, "
        f"every link {MBPS:g} Mbit/s, {RTT_MS:g} ms RTT (emulated on one machine)\n"
    )
    print(
        "| task | mode | steps | target acc | time to target (s) | final acc | wall (s) "
        "| compute (s) | comm (s) | WAN bytes | vs baseline: speed-up to target | WAN bytes /x |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for task in dict.fromkeys(r["task"] for r in rows):
        group = [r for r in rows if r["task"] == task]
        base = group[0]
        for r in group:
            speed = (
                f"{base['time_to_target_s'] / r['time_to_target_s']:.1f}x"
                if base["time_to_target_s"] and r["time_to_target_s"]
                else "-"
            )
            fewer = f"{base['wan_bytes'] / r['wan_bytes']:.0f}x" if r["wan_bytes"] else "-"
            print(
                f"| {task.removeprefix('builtin:')} | {r['mode']} | {r['steps']} | "
                f"{r['target']:.2f} | {_fmt_s(r['time_to_target_s'])} | "
                f"{r['final_accuracy'] * 100:.1f} % | {r['wall_s']:.1f} | {r['compute_s']:.1f} | "
                f"{r['comm_s']:.1f} | {r['wan_bytes']:,} | {speed} | {fewer} |"
            )
    print(
        "\nCompressor throughput (one CPU thread, 4.2M-element gradient, compress + serialize "
        "+ parse + decompress):\n"
    )
    print("| compressor | MB/s of fp32 gradient | bytes ratio |")
    print("|---|---|---|")
    for c in comp:
        print(f"| {c['compressor']} | {c['mb_per_s']:.0f} | {c['ratio']:.1f}x |")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in rows if r["task"] == task):
            pts = [
                (h["wall_s"], 100 * h["accuracy"])
                for h in r["history"]
                if h["accuracy"] is not None
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=r["mode"])
        ax.axhline(
            100 * rows[[r["task"] for r in rows].index(task)]["target"], color="grey", ls=":", lw=1
        )
        ax.set_title(
            f"{task.removeprefix('builtin:')}: 3x2 workers, {MBPS:g} Mbit/s, "
            f"{RTT_MS:g} ms RTT (emulated)"
        )
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("eval accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the steps")
    args = parser.parse_args()

    import ray

    from training.runner import local_resources

    ray.init(
        num_cpus=2,
        resources=local_resources(CLUSTERS),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        rows = run_modes(args.quick)
    finally:
        ray.shutdown()
    comp = compressor_throughput()
    print_tables(rows, comp)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(rows, RESULTS / "training.png")
    (RESULTS / "training.json").write_text(
        json.dumps({"runs": rows, "compressors": comp}, indent=1)
    )
    print(f"\nplot: {RESULTS / 'training.png'}")


if __name__ == "__main__":
    main()
