"""Pipeline parallelism across emulated datacenters against the memory-aware planner's estimate
and against data parallelism.

Two clusters on one machine, one worker each, the link between them emulated (100 Mbit/s,
20 ms RTT by default). Each cluster *declares* a GPU memory too small for the whole model (its
parameters, gradients and Adam state at one sample a step): the planner
(`scheduler.memory.plan_parallelism`, over the model's measured pieces and this machine's
measured speed) must split it, and picks the cut and the micro-batch count. The bench runs
that pipeline (GPipe, and 1F1B) and reports throughput, step time and idle share against the
planner's step time and bubble; then data parallelism on the same two workers (possible here
because the declared memory is not enforced on a CPU), to show what each moves over the WAN.

    .venv/bin/python -m bench.pipeline [--steps N] [--mbps X] [--rtt-ms Y] [--tasks T ...]

Writes bench/results/pipeline.json and bench/results/pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ("builtin:char-transformer", "builtin:wide-mlp")
"""Activations larger than the model (a transformer on short sequences), and the reverse."""
CLUSTERS = {"a": 1, "b": 1}


def measure_profile(task_name: str, batch: int) -> tuple[Any, float]:
    """The task's model as the planner sees it (its pieces, measured) and this machine's
    training speed in FLOP/s (forward + backward of a batch, 3x the forward FLOPs)."""
    import torch

    from scheduler.memory import Layer, ModelProfile
    from training.stages import pieces, profile_pieces
    from training.tasks import load_task

    task = load_task(task_name)
    torch.manual_seed(0)
    model = task.model()
    parts = pieces(model)
    x, y = task.train  # type: ignore[misc]
    prof = profile_pieces(parts, x[:1])
    layers = tuple(
        Layer(f"piece{i}", p.params, p.flops, float(p.activation_bytes), float(p.stored_bytes))
        for i, p in enumerate(prof)
    )
    profile = ModelProfile(layers, task.optimizer.name)
    opt = task.optimizer.build(model.parameters())
    xb, yb = x[:batch], y[:batch]
    for _ in range(2):  # warm up
        task.loss(model(xb), yb).backward()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        model.zero_grad()
        task.loss(model(xb), yb).backward()
        opt.step()
    per_step = (time.perf_counter() - t0) / reps
    flops = 3.0 * sum(p.flops for p in prof) * batch
    return profile, flops / per_step


def plan(profile: Any, speed: float, batch: int, mbps: float, rtt_ms: float) -> Any:
    """The planner's pipeline over two declared clusters, each with 80 % of the memory the
    whole model needs (so no single one holds it), or just over its largest piece's share."""
    from scheduler.memory import USABLE, memory, plan_parallelism
    from scheduler.types import Cluster, Link

    n = len(profile.layers)
    whole = memory(profile, 0, n, 1, 1).total
    biggest = max(memory(profile, i, i + 1, 1, 1).total for i in range(n))
    share = min(0.995, max(0.8, biggest / whole + 0.01))  # the largest piece must still fit
    gb = whole * share / USABLE / 1e9
    clusters = [
        Cluster(name, name, "CPU", 1, 10.0, 1.0, gpu_tflops=speed / 1e12, efficiency=1.0)
        for name in CLUSTERS
    ]
    links = [Link("a", "b", mbps / 1000, rtt_ms)]
    got = plan_parallelism(profile, clusters, links, batch, {c: gb for c in CLUSTERS})
    return got, whole, gb


def run_pipeline_mode(
    task: str,
    schedule: str,
    cuts: tuple[int, ...],
    micro: int,
    steps: int,
    batch: int,
    mbps: float,
    rtt: float,
) -> dict[str, Any]:
    from training.pipeline import PipelineSpec, Schedule, place, run_pipeline
    from training.spec import TrainSpec

    train = TrainSpec(
        task=task,
        clusters=dict(CLUSTERS),
        steps=steps,
        batch_size=batch,
        eval_every=steps,
        link_mbps=mbps,
        rtt_ms=rtt,
    )
    spec = PipelineSpec(
        train, place(dict(CLUSTERS), None, False), micro, Schedule(schedule), cuts, "none"
    )
    r = run_pipeline(spec)
    return {
        "mode": f"pipeline {schedule}",
        "micro_batches": micro,
        "steps": r.steps,
        "wall_s": r.wall_s,
        "step_s": r.wall_s / r.steps,
        "samples_per_s": r.steps * batch / r.wall_s,
        "bubble_schedule": r.bubble_fraction,
        "idle_measured": r.measured_bubble,
        "stage_compute_s": r.stage_compute_s,
        "wan_bytes": r.activation_bytes.total,
        "final_loss": r.final_loss,
    }


def run_data_mode(task: str, steps: int, batch: int, mbps: float, rtt: float) -> dict[str, Any]:
    import training
    from training.spec import TrainSpec

    spec = TrainSpec(
        task=task,
        clusters=dict(CLUSTERS),
        steps=steps,
        batch_size=batch,
        eval_every=steps,
        link_mbps=mbps,
        rtt_ms=rtt,
        compression="none",
        sync="every-step",
    )
    r = training.run(spec)
    return {
        "mode": "data parallel (fp32, every step)",
        "micro_batches": None,
        "steps": r.steps,
        "wall_s": r.wall_s,
        "step_s": r.wall_s / r.steps,
        "samples_per_s": r.steps * batch / r.wall_s,
        "bubble_schedule": None,
        "idle_measured": None,
        "stage_compute_s": None,
        "wan_bytes": r.wan_bytes_total,
        "final_loss": r.final_loss,
    }


def markdown(outs: list[dict[str, Any]]) -> str:
    lines = ["# Pipeline parallelism across 2 emulated datacenters", ""]
    for out in outs:
        lines += _section(out)
    return "\n".join(lines)


def _section(out: dict[str, Any]) -> list[str]:
    from scheduler.memory import USABLE

    p = out["plan"]
    lines = [
        f"## {out['task']}",
        "",
        f"Task {out['task']}, batch {out['batch']}, {out['steps']} steps, "
        f"link {out['mbps']} Mbit/s "
        f"{out['rtt_ms']} ms RTT, one CPU worker a cluster (2-core machine). Each cluster "
        f"declares {p['declared_gb']:.4f} GB a GPU ({p['declared_gb'] * USABLE:.4f} usable): "
        f"the whole model needs {p['model_gb']:.4f} GB "
        "(parameters, gradients, Adam state), so it fits neither.",
        "",
        f"Planner: {p['reason']}",
        f"Planner estimate: step {p['step_s']:.4f} s, bubble {p['bubble'] * 100:.1f} %, "
        f"{p['micro_batches']} micro-batches, cut {p['cuts']}.",
        "",
        "| mode | micro-batches | step (s) | samples/s | schedule bubble | measured idle "
        "| WAN bytes | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x * 100:.1f} %"

        lines.append(
            f"| {r['mode']} | {r['micro_batches'] or '-'} | {r['step_s']:.4f} | "
            f"{r['samples_per_s']:.1f} | {pct(r['bubble_schedule'])} | "
            f"{pct(r['idle_measured'])} | {r['wan_bytes']:,} | {r['final_loss']:.3f} |"
        )
    lines += [
        "",
        "Measured idle is 1 - compute / step time per stage (bubble, emulated link delay and "
        "the runtime's per-micro-batch cost together); the schedule bubble is (S-1)/(M+S-1). "
        "Data parallelism runs only because a CPU does not enforce the declared memory: on "
        "GPUs of that size it would not fit. Numbers from one machine, 2 shared cores.",
        "",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mbps", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    args = ap.parse_args()
    outs = [bench_task(task, args) for task in args.tasks]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline.json").write_text(json.dumps(outs, indent=2))
    (RESULTS / "pipeline.md").write_text(markdown(outs))
    print(markdown(outs))


def bench_task(task: str, args: argparse.Namespace) -> dict[str, Any]:
    profile, speed = measure_profile(task, args.batch)
    got, whole, declared = plan(profile, speed, args.batch, args.mbps, args.rtt_ms)
    if not got.stages:
        raise SystemExit(f"the planner chose {got.parallelism}: {got.reason}")
    cuts = tuple(s.layers[0] for s in got.stages[1:])
    print(f"{task} planner: {got.reason}; step {got.step_s:.4f} s")
    runs = []
    for schedule in ("gpipe", "1f1b"):
        runs.append(
            run_pipeline_mode(
                task,
                schedule,
                cuts,
                got.micro_batches,
                args.steps,
                args.batch,
                args.mbps,
                args.rtt_ms,
            )
        )
        print(runs[-1])
    runs.append(run_data_mode(task, args.steps, args.batch, args.mbps, args.rtt_ms))
    print(runs[-1])

    return {
        "task": task,
        "batch": args.batch,
        "steps": args.steps,
        "mbps": args.mbps,
        "rtt_ms": args.rtt_ms,
        "speed_flops": speed,
        "plan": {
            "reason": got.reason,
            "step_s": got.step_s,
            "bubble": got.bubble,
            "micro_batches": got.micro_batches,
            "cuts": list(cuts),
            "model_gb": whole / 1e9,
            "declared_gb": declared,
            "stages": [
                {
                    "cluster": s.cluster,
                    "layers": list(s.layers),
                    "memory_gb": s.memory.total / 1e9,
                    "compute_s": s.compute_s,
                    "send_s": s.send_s,
                }
                for s in got.stages
            ],
        },
        "runs": runs,
    }


if __name__ == "__main__":
    main()
