"""Every parallelism on one model: data, pipeline, hybrid, tensor and 3D, planned against run.

One model (`builtin:char-gpt`, the char transformer written so its blocks split over GPUs),
two emulated clusters `a` and `b` of two CPU workers each, the link between them emulated
(100 Mbit/s, 20 ms RTT by default), the same global batch and steps for every strategy, one
evaluation at the end. Per strategy: the step the cost model plans (`scheduler.pipeline_cost`
with the planner's split profile, `ModelProfile.split`, and a split's all-reduces,
`tensor_collective_s`; the micro-batch cost fitted from this bench's own pipeline run and a
split all-reduce's from its tensor run, as the control plane fits them from finished jobs),
the measured step, the idle share, WAN bytes, the
memory a worker holds (the model's, per the planner's memory model) and the parameters it
holds (counted by the run), and the final evaluation against one process training the same
batches. Data parallelism's step is the data-parallel cost model's (`bench.promise`), so it
is run, not planned, here.

    .venv/bin/python -m bench.strategies [--steps N] [--batch B] [--mbps X] [--rtt-ms Y]

Writes bench/results/strategies.json, .md and .png. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TASK = "builtin:char-gpt"
CLUSTERS = {"a": 2, "b": 2}
INTRA_GBPS = 10.0
"""What the planner is told a cluster's own links carry (gloo over loopback here)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    stages: tuple[str, ...]
    """Cluster of each stage (empty: data parallel)."""
    replicas: int = 1
    tensor: int = 1
    micro_batches: int = 1
    pipelines: tuple[tuple[str, ...], ...] = ()
    """Whole pipeline replicas' clusters (empty: every replica in its stage's cluster)."""


STRATEGIES = (
    Strategy("data (fp32, every step)", ()),
    Strategy("pipeline (4 stages)", ("a", "a", "b", "b"), micro_batches=8),
    Strategy("hybrid (2 stages x 2 replicas)", ("a", "b"), replicas=2, micro_batches=4),
    Strategy(
        "hybrid (2 whole pipelines, a and b)",
        ("a", "a"),
        replicas=2,
        micro_batches=4,
        pipelines=(("a", "a"), ("b", "b")),
    ),
    Strategy("tensor (a: 2 GPUs split)", ("a",), tensor=2),
    Strategy("3D (2 stages x 2-GPU split)", ("a", "b"), tensor=2, micro_batches=4),
)


def reference(steps: int, batch: int) -> dict[str, float]:
    """One process, the same batches: the quality every strategy must match."""
    import torch

    from training.data import batch_indices
    from training.tasks import as_tensors, evaluate, load_task

    task = load_task(TASK)
    torch.manual_seed(0)
    model = task.model()
    opt = task.optimizer.build(model.parameters())
    x, y = as_tensors(task.train)
    t0 = time.perf_counter()
    for step in range(steps):
        idx = batch_indices(len(x), batch, 0, step)
        opt.zero_grad()
        task.loss(model(x[idx]), y[idx]).backward()
        opt.step()
    wall = time.perf_counter() - t0
    xe, ye = as_tensors(task.eval)
    ev = evaluate(task, model, xe, ye)
    return {"step_s": wall / steps, "eval_loss": ev.loss, "accuracy": ev.accuracy}


def planned(
    s: Strategy,
    profile: Any,
    costs: list[float],
    speed: float,
    args: argparse.Namespace,
    micro_s: float,
    tensor_s: float = 0.0,
) -> tuple[float | None, list[float]]:
    """The cost model's step of `s` and each stage's memory per worker (GB): the runtime's
    cut (`training.pipeline.split.balance` over the pieces' costs), a stage's pieces' FLOPs
    over its split, its blocks' all-reduces and its replicas' gradient all-reduce (each
    all-reduce also costing `tensor_s`), each micro-batch's fixed cost. `costs`: the
    pieces' costs the runtime cuts by (`training.stages.piece_costs`)."""
    from scheduler.memory import memory
    from scheduler.pipeline_cost import StageWork, estimate_whole_pipelines, tensor_collective_s
    from scheduler.types import Cluster, Link
    from training.pipeline.split import balance

    batch = args.batch
    if not s.stages:
        whole = memory(profile, 0, len(profile.layers), batch // sum(CLUSTERS.values()), 1)
        return None, [whole.total / 1e9]
    clusters = {
        n: Cluster(n, n, "CPU", k, INTRA_GBPS, 1.0, gpu_tflops=speed / 1e12, efficiency=1.0)
        for n, k in CLUSTERS.items()
    }
    links = {("a", "b"): Link("a", "b", args.mbps / 1000, args.rtt_ms)}
    split = profile.split(s.tensor)
    cuts = balance(costs, len(s.stages))
    bounds = [0, *cuts, len(profile.layers)]
    mb = batch / s.replicas / s.micro_batches
    rows = s.pipelines or (s.stages,)
    width = 1 if s.pipelines else s.replicas  # replicas a stage has in its own cluster
    work: list[list[StageWork]] = [[] for _ in rows]
    mems = []
    for i in range(len(s.stages)):
        lo, hi = bounds[i], bounds[i + 1]
        layers = split.layers[lo:hi]
        blocks = sum(1 for x in layers if x.heads)
        act = layers[0].activation_bytes * mb if blocks else 0.0
        compute = 3.0 * sum(x.flops for x in layers) * mb / speed
        compute += tensor_collective_s(act, blocks, s.tensor, INTRA_GBPS, tensor_s)
        # what crosses to the next stage: every replica's micro-batch in this stage's cluster
        send = 0.0 if i == len(s.stages) - 1 else layers[-1].activation_bytes * mb * width
        grads = 4.0 * sum(x.params for x in layers)  # a part's own, under a split
        for row, stages in zip(rows, work, strict=True):
            stages.append(StageWork(row[i], compute, send, width * s.tensor, width, grads))
        in_flight = min(s.micro_batches, len(s.stages) - i)
        mems.append(memory(split, lo, hi, max(1, round(mb)), in_flight).total / 1e9)
    est = estimate_whole_pipelines(
        work,
        clusters,
        links,
        s.micro_batches,
        1,
        micro_overhead_s=micro_s,
        schedule="gpipe",
        all_reduce_overhead_s=tensor_s,
    )
    return est.step_s, mems


def run(s: Strategy, steps: int, batch: int, mbps: float, rtt_ms: float) -> dict[str, Any]:
    """One real run of `s` on Ray (the emulated link between a and b)."""
    from training.spec import TrainSpec

    train = TrainSpec(
        task=TASK,
        clusters=dict(CLUSTERS),
        steps=steps,
        batch_size=batch,
        eval_every=steps,
        link_mbps=mbps,
        rtt_ms=rtt_ms,
        compression="none",
        sync="every-step",
    )
    if not s.stages:
        import training

        r = training.run(train)
        return {
            "step_s": r.wall_s / r.steps,
            "idle": None,
            "wan_bytes": r.wan_bytes_total,
            "params_per_worker": [],
            "eval_loss": r.final_eval_loss,
            "accuracy": r.final_accuracy,
        }
    from training.pipeline import PipelineSpec, Placement, Schedule, run_pipeline

    placement = Placement(s.stages, s.replicas, s.tensor, s.pipelines)
    spec = PipelineSpec(
        replace(train, clusters=placement.workers()),
        placement,
        micro_batches=s.micro_batches,
        schedule=Schedule.GPIPE,
        activations="none",
    )
    pr = run_pipeline(spec)
    return {
        "step_s": pr.wall_s / pr.steps,
        "idle": pr.measured_bubble,
        "wan_bytes": pr.activation_bytes.total,
        "params_per_worker": pr.stage_params,
        "eval_loss": pr.final_eval_loss,
        "accuracy": pr.final_accuracy,
    }


def markdown(doc: dict[str, Any]) -> str:
    a = doc["args"]
    ref = doc["reference"]
    lines = [
        "# Every parallelism on one model: planned against run",
        "",
        f"`{doc['command']}`, {doc['date']}, on 2 CPU cores, nothing beside it. "
        f"`{TASK}` ({doc['params']:,} parameters), clusters a and b of 2 CPU workers each, "
        f"the link between them emulated at {a['mbps']:g} Mbit/s and {a['rtt_ms']:g} ms RTT "
        "(shared by the replicas that cross it at once), "
        f"global batch {a['batch']}, {a['steps']} steps, fp32 everywhere, GPipe; every "
        "strategy starts from the same seed and trains on the same batches. Planned: "
        "`scheduler.pipeline_cost` over this machine's measured speed "
        f"({doc['speed_flops'] / 1e9:.3g} GFLOP/s a worker, on one thread as workers run; "
        "GPipe's forward and backward phases timed apart), the clusters' own links declared "
        f"at {INTRA_GBPS:g} Gbit/s, each micro-batch adding to its slot (a stage or a link) "
        f"{doc['micro_overhead_s'] * 1e3:.3g} ms (fitted from the pipeline row's run, as the "
        "control plane fits it from finished jobs) and each all-reduce of a split "
        f"{doc['all_reduce_overhead_s'] * 1e3:.3g} ms beyond its bytes (fitted from the tensor "
        "row's run, likewise; a stage's replicas' gradient all-reduce pays it too): those two "
        "rows' planned steps are therefore not independent checks; hybrid and 3D are. "
        "Memory: what a worker holds per the planner's memory model (parameters, gradients, "
        "Adam state, activations in flight). "
        f"One process on the same batches: eval loss {ref['eval_loss']:.4f}, accuracy "
        f"{ref['accuracy']:.3f}, {ref['step_s'] * 1e3:.1f} ms a step.",
        "",
        "| strategy | workers | planned step (s) | measured step (s) | error | idle | WAN MB | "
        "memory a worker (MB) | parameters a worker | eval loss | Δ loss vs one process | "
        "accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        plan, got = row["planned_step_s"], row["step_s"]
        err = f"{(plan - got) / got * 100:+.0f} %" if plan is not None else "-"
        idle = f"{row['idle'] * 100:.0f} %" if row["idle"] is not None else "-"
        mem = "/".join(f"{m * 1e3:.2f}" for m in row["memory_gb"])
        params = "/".join(f"{p:,}" for p in row["params_per_worker"]) or f"{doc['params']:,}"
        lines.append(
            f"| {row['name']} | {row['workers']} | "
            f"{f'{plan:.4f}' if plan is not None else '-'} | {got:.4f} | {err} | {idle} | "
            f"{row['wan_bytes'] / 1e6:.2f} | {mem} | {params} | {row['eval_loss']:.4f} | "
            f"{row['eval_loss'] - ref['eval_loss']:+.4f} | {row['accuracy']:.3f} |"
        )
    lines += [
        "",
        "Memory and parameters are per stage, in pipeline order. The tensor row uses one "
        "cluster's two workers (a split never crosses the WAN); the others use all four. One "
        "run a strategy: steps vary by a few per cent from run to run on this machine.",
        "",
    ]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    names = [r["name"].split(" (")[0] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([x - 0.2 for x in xs], [r["step_s"] for r in rows], 0.4, label="measured")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["planned_step_s"] or 0.0 for r in rows],
        0.4,
        label="planned (data: not planned here)",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("step (s)")
    a = doc["args"]
    ax.set_title(
        f"{TASK}, 2 x 2 CPU workers, {a['mbps']:g} Mbit/s {a['rtt_ms']:g} ms, batch {a['batch']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    from bench.pipeline import measure_profile
    from scheduler.pipeline_cost import (
        MICRO_BATCH_OVERHEAD_S,
        TENSOR_ALL_REDUCES_PER_BLOCK,
        fit_all_reduce_overhead,
        fit_micro_overhead,
    )
    from training.stages import piece_costs, pieces
    from training.tasks import load_task

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--mbps", type=float, default=100.0)
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    profile, speed = measure_profile(TASK, args.batch)
    costs = piece_costs(pieces(load_task(TASK).model()))
    ref = reference(args.steps, args.batch)
    print("one process:", ref, flush=True)
    results: list[dict[str, Any]] = []
    micro_s, tensor_s = MICRO_BATCH_OVERHEAD_S, 0.0
    for s in STRATEGIES:
        got = run(s, args.steps, args.batch, args.mbps, args.rtt_ms)
        results.append({"strategy": s, **got})
        print(s.name, got, flush=True)
        # the control plane's fits, as it makes them from finished jobs: the micro-batch cost
        # from the pipeline, then a split all-reduce's from the one-stage split
        if s.name.startswith("pipeline"):
            prior, _ = planned(s, profile, costs, speed, args, micro_s)
            assert prior is not None
            micro_s = max(
                0.0,
                fit_micro_overhead(
                    got["step_s"], prior, s.micro_batches, len(s.stages), MICRO_BATCH_OVERHEAD_S
                ),
            )
        elif s.name.startswith("tensor"):
            prior, _ = planned(s, profile, costs, speed, args, micro_s)
            assert prior is not None
            blocks = sum(1 for x in profile.layers if x.heads)
            count = TENSOR_ALL_REDUCES_PER_BLOCK * blocks * s.micro_batches
            tensor_s = max(0.0, fit_all_reduce_overhead(got["step_s"], prior, count, 0.0))
    rows = []
    for r in results:
        s = r.pop("strategy")
        step, mems = planned(s, profile, costs, speed, args, micro_s, tensor_s)
        workers = len(s.stages) * s.replicas * s.tensor or sum(CLUSTERS.values())
        rows.append(
            {"name": s.name, "workers": workers, "planned_step_s": step, "memory_gb": mems, **r}
        )
    doc = {
        "command": ".venv/bin/python -m bench.strategies " + shlex.join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: getattr(args, k) for k in ("steps", "batch", "mbps", "rtt_ms")},
        "params": profile.params,
        "speed_flops": speed,
        "micro_overhead_s": micro_s,
        "all_reduce_overhead_s": tensor_s,
        "reference": ref,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "strategies.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "strategies.md").write_text(markdown(doc))
    plot(doc, args.out / "strategies.png")
    print(markdown(doc))


if __name__ == "__main__":
    main()
