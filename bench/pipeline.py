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

With `--testbed` (root), the same runs go over real shaped links instead: the namespace
testbed (package `testbed`, as `bench.peers` uses it) with one namespace and Ray node per
cluster, each advertising its cluster's resource (`cpn-cluster-<name>`, which is where the
pipeline driver pins a stage), uplinks `tc tbf`-shaped at `--mbps` (no added delay), the
driver in the hub namespace. Per mode it adds the uplink bytes from the interface counters
next to the runtime's counted activation (or gradient) bytes; the planner estimates over the
same links (RTT 0). That section is written beside the emulated one (each keeps the command
that made it):

    CPN_TESTBED_PREFIX=cpl .venv/bin/python -m bench.pipeline --testbed --steps 4

Writes bench/results/pipeline.json and bench/results/pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.spec import TrainSpec

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
TASKS = ("builtin:char-transformer", "builtin:wide-mlp")
"""Activations larger than the model (a transformer on short sequences), and the reverse."""
CLUSTERS = {"a": 1, "b": 1}
TESTBED_RTT_MS = 0.0
"""tbf shapes the rate only; a veth hop adds well under a millisecond."""
MACHINE = "one machine with 2 CPU cores shared with other work running at the same time"


def measure_profile(task_name: str, batch: int) -> tuple[Any, float]:
    """The task's model as the planner sees it (its pieces, measured) and a worker's training
    speed on this machine in FLOP/s (forward + backward of a batch, 3x the forward FLOPs, on
    one thread as a stage worker runs)."""
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
        Layer(
            f"piece{i}",
            p.params,
            p.flops,
            float(p.activation_bytes),
            float(p.stored_bytes),
            # a block that says how it splits over GPUs (`training.tensor_parallel`)
            getattr(part, "heads", 0) if getattr(part, "tensor_plan", None) else 0,
        )
        for i, (p, part) in enumerate(zip(prof, parts, strict=True))
    )
    profile = ModelProfile(layers, task.optimizer.name)
    opt = task.optimizer.build(model.parameters())
    xb, yb = x[:batch], y[:batch]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs (`training.pipeline.stage`): one thread
    try:
        for _ in range(2):  # warm up
            task.loss(model(xb), yb).backward()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            model.zero_grad()
            task.loss(model(xb), yb).backward()
            opt.step()
        per_step = (time.perf_counter() - t0) / reps
    finally:
        torch.set_num_threads(threads)
    flops = 3.0 * sum(p.flops for p in prof) * batch
    return profile, flops / per_step


def plan(
    profile: Any,
    speed: float,
    batch: int,
    mbps: float,
    rtt_ms: float,
    micro_overhead_s: float | None = None,
    schedule: str = "gpipe",
) -> Any:
    """The planner's pipeline over two declared clusters, each with 80 % of the memory the
    whole model needs (so no single one holds it), or just over its largest piece's share;
    each micro-batch adding `micro_overhead_s` to its slot (None: the planner's prior)."""
    from scheduler.memory import USABLE, memory, plan_parallelism
    from scheduler.pipeline_cost import MICRO_BATCH_OVERHEAD_S
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
    overhead = MICRO_BATCH_OVERHEAD_S if micro_overhead_s is None else micro_overhead_s
    got = plan_parallelism(
        profile,
        clusters,
        links,
        batch,
        dict.fromkeys(CLUSTERS, gb),
        micro_overhead_s=overhead,
        schedule=schedule,
    )
    return got, whole, gb


def _train_spec(
    task: str, steps: int, batch: int, mbps: float | None, rtt: float | None, ray: str | None
) -> TrainSpec:
    """The run both modes share: the bench's clusters, one evaluation at the end."""
    from training.spec import TrainSpec

    return TrainSpec(
        task=task,
        clusters=dict(CLUSTERS),
        steps=steps,
        batch_size=batch,
        eval_every=steps,
        link_mbps=mbps,
        rtt_ms=rtt,
        ray_address=ray,
    )


def run_pipeline_mode(
    task: str,
    schedule: str,
    cuts: tuple[int, ...],
    micro: int,
    steps: int,
    batch: int,
    mbps: float | None,
    rtt: float | None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """One pipeline run; `mbps`/`rtt` None: no emulation (the links are real)."""
    from training.pipeline import PipelineSpec, Schedule, place, run_pipeline

    train = _train_spec(task, steps, batch, mbps, rtt, ray_address)
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


def run_data_mode(
    task: str,
    steps: int,
    batch: int,
    mbps: float | None,
    rtt: float | None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    import training

    spec = replace(
        _train_spec(task, steps, batch, mbps, rtt, ray_address),
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


LEGACY_COMMAND = (
    ".venv/bin/python -m bench.pipeline --steps 10 "
    "(recorded before the file kept its commands; inferred from the run's parameters)"
)


def load_results(raw: Any) -> dict[str, Any]:
    """The results document: {"emulated": ..., "testbed": ...}, each {"command", "tasks"}; an
    older file (a bare list of emulated tasks) becomes its emulated section."""
    if isinstance(raw, list):
        return {"emulated": {"command": LEGACY_COMMAND, "machine": MACHINE, "tasks": raw}}
    return dict(raw) if isinstance(raw, dict) else {}


def uplink_delta(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Bytes each datacenter sent on its uplink between two counter readings (tx: every byte
    between datacenters leaves one uplink, so the sum counts each byte once)."""
    return {dc: after[dc][0] - before[dc][0] for dc in after}


def markdown(doc: dict[str, Any]) -> str:
    lines = ["# Pipeline parallelism across 2 datacenters", ""]
    em = doc.get("emulated")
    if em:
        lines += [
            "## Emulated links (in-process)",
            "",
            f"Command: `{em['command']}`",
            "",
            f"Machine: {em.get('machine', MACHINE)}; timings are noisy.",
            "",
        ]
        for out in em["tasks"]:
            lines += _section(out)
    tb = doc.get("testbed")
    if tb:
        lines += [
            "## On the testbed",
            "",
            f"Command: `{tb['command']}`",
            "",
            f"Machine: {tb.get('machine', MACHINE)}; timings are noisy.",
            "",
        ]
        for out in tb["tasks"]:
            lines += _testbed_section(out, tb.get("idle_uplink_bytes_per_s"))
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _declared(out: dict[str, Any]) -> str:
    from scheduler.memory import USABLE

    p = out["plan"]
    return (
        f"Each cluster declares {p['declared_gb']:.4f} GB a GPU "
        f"({p['declared_gb'] * USABLE:.4f} usable): the whole model needs {p['model_gb']:.4f} GB "
        "(parameters, gradients, Adam state), so it fits neither."
    )


def _planner(out: dict[str, Any]) -> list[str]:
    p = out["plan"]
    return [
        f"Planner: {p['reason']}",
        f"Planner estimate: step {p['step_s']:.4f} s, bubble {p['bubble'] * 100:.1f} %, "
        f"{p['micro_batches']} micro-batches, cut {p['cuts']}.",
        "",
    ]


def _section(out: dict[str, Any]) -> list[str]:
    lines = [
        f"### {out['task']}",
        "",
        f"Task {out['task']}, batch {out['batch']}, {out['steps']} steps, "
        f"link {out['mbps']} Mbit/s "
        f"{out['rtt_ms']} ms RTT, one CPU worker a cluster (2-core machine). " + _declared(out),
        "",
        *_planner(out),
        "| mode | micro-batches | step (s) | samples/s | schedule bubble | measured idle "
        "| WAN bytes | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        lines.append(
            f"| {r['mode']} | {r['micro_batches'] or '-'} | {r['step_s']:.4f} | "
            f"{r['samples_per_s']:.1f} | {_pct(r['bubble_schedule'])} | "
            f"{_pct(r['idle_measured'])} | {r['wan_bytes']:,} | {r['final_loss']:.3f} |"
        )
    lines += [
        "",
        "Measured idle is 1 - compute / step time per stage (bubble, emulated link delay and "
        "the runtime's per-micro-batch cost together); the schedule bubble is (S-1)/(M+S-1). "
        "Data parallelism runs only because a CPU does not enforce the declared memory: on "
        "GPUs of that size it would not fit. Numbers from one machine, 2 shared cores.",
        "",
    ]
    return lines + _calibrated(out)


def _calibrated(out: dict[str, Any]) -> list[str]:
    """The planner's step against the measured one (GPipe), on the prior micro-batch cost and
    on the cost fitted from the prior plan's run."""
    cal = out.get("calibrated")
    if not cal:
        return []
    gpipe = next(r for r in out["runs"] if r["mode"] == "pipeline gpipe")
    rows = [
        ("GPipe", "prior", cal["prior_s"], out["plan"], gpipe),
        ("GPipe", "fitted from the prior plan's run", cal["fitted_s"], cal["plan"], cal["run"]),
    ]
    if "run_1f1b" in cal:
        fitted = "fitted from the prior plan's run"
        rows.append(("1F1B", fitted, cal["fitted_s"], cal["plan_1f1b"], cal["run_1f1b"]))
    lines = [
        "Planned against measured: the planner on its prior micro-batch cost, then on the cost "
        "fitted from that run (`scheduler.pipeline_cost.fit_micro_overhead`, as the control "
        "plane fits it from finished pipeline jobs), for each schedule:",
        "",
        "| schedule | micro-batch cost | ms | micro-batches | planned step (s) | measured step (s) "
        "| error | measured idle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for schedule, label, cost, p, r in rows:
        err = (p["step_s"] - r["step_s"]) / r["step_s"]
        lines.append(
            f"| {schedule} | {label} | {cost * 1e3:.1f} | {p['micro_batches']} | "
            f"{p['step_s']:.4f} | {r['step_s']:.4f} | {err * 100:+.0f} % | "
            f"{_pct(r['idle_measured'])} |"
        )
    return [*lines, ""]


def _testbed_section(out: dict[str, Any], idle_rate: float | None) -> list[str]:
    p = out["plan"]
    lines = [
        f"### {out['task']}",
        "",
        f"Task {out['task']}, batch {out['batch']}, {out['steps']} steps, every uplink "
        f"tc-tbf-shaped at {out['mbps']} Mbit/s both ways (no added delay), one namespace and "
        "Ray node a cluster, one CPU worker a cluster. " + _declared(out),
        "",
        *_planner(out),
        "| mode | micro-batches | step (s) | samples/s | planner step (s) | schedule bubble "
        "| measured idle | uplink bytes (counters) | runtime-counted bytes | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        if r.get("error"):
            lines.append(f"| {r['mode']} | FAILED: {r['error']} |||||||||")
            continue
        est = f"{p['step_s']:.4f}" if r["micro_batches"] else "-"
        lines.append(
            f"| {r['mode']} | {r['micro_batches'] or '-'} | {r['step_s']:.4f} | "
            f"{r['samples_per_s']:.1f} | {est} | {_pct(r['bubble_schedule'])} | "
            f"{_pct(r['idle_measured'])} | {r['uplink_bytes_total']:,} | {r['wan_bytes']:,} | "
            f"{r['final_loss']:.3f} |"
        )
    idle = f" (idle Ray traffic alone: {idle_rate:,.0f} B/s)" if idle_rate is not None else ""
    lines += [
        "",
        "Step time is the run's wall time (its evaluation pass included) over its steps. Uplink "
        "bytes: tx counters of both uplinks over the whole run, link-layer (Ethernet, IP, TCP "
        "headers) and everything else crossing them too: actor start-up, Ray control traffic"
        f"{idle}; runtime-counted: the payload the runtime put on the WAN (activations and "
        "their gradients, or the data-parallel gradients and start-up digests). Measured idle "
        "as above, with the real link's serialisation in place of the emulated delay.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["testbed-driver"]:
        testbed_driver(argv[1:])
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mbps", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="emulated links only")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--testbed", action="store_true", help="real shaped links (root)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per testbed run")
    args = ap.parse_args(argv)
    path = RESULTS / "pipeline.json"
    doc = load_results(json.loads(path.read_text())) if path.exists() else {}
    if args.testbed:
        prefix = os.environ.get("CPN_TESTBED_PREFIX", "cpntb")
        command = f"CPN_TESTBED_PREFIX={prefix} .venv/bin/python -m bench.pipeline "
        doc["testbed"] = {
            "command": command + shlex.join(argv),
            "machine": MACHINE,
            **bench_testbed(args),
        }
    else:
        doc["emulated"] = {
            "command": ".venv/bin/python -m bench.pipeline " + shlex.join(argv),
            "machine": MACHINE,
            "tasks": [bench_task(task, args) for task in args.tasks],
        }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    (RESULTS / "pipeline.md").write_text(markdown(doc))
    print(markdown(doc))


def _planned(task: str, args: argparse.Namespace, rtt: float) -> tuple[Any, dict[str, Any]]:
    """The planner's pipeline for `task` over the bench's links, and its record."""
    profile, speed = measure_profile(task, args.batch)
    got, whole, declared = plan(profile, speed, args.batch, args.mbps, rtt)
    if not got.stages:
        raise SystemExit(f"the planner chose {got.parallelism}: {got.reason}")
    cuts = tuple(s.layers[0] for s in got.stages[1:])
    print(f"{task} planner: {got.reason}; step {got.step_s:.4f} s", flush=True)
    record = {
        "task": task,
        "batch": args.batch,
        "steps": args.steps,
        "mbps": args.mbps,
        "rtt_ms": rtt,
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
    }
    return got, record


def calibrate(
    task: str, args: argparse.Namespace, record: dict[str, Any], measured_step_s: float
) -> dict[str, Any]:
    """The control plane's calibration, done here: a micro-batch's fixed cost fitted from the
    prior plan's GPipe run (`scheduler.pipeline_cost.fit_micro_overhead`, as
    `controller.network.snapshot.observed` fits it from finished jobs), the planner asked
    again with it, and that plan run: its planned step against its measured one."""
    from scheduler.pipeline_cost import MICRO_BATCH_OVERHEAD_S, fit_micro_overhead

    p = record["plan"]
    stages = len(p["stages"])
    fitted = max(
        0.0,
        fit_micro_overhead(
            measured_step_s, p["step_s"], p["micro_batches"], stages, MICRO_BATCH_OVERHEAD_S
        ),
    )
    profile, _ = measure_profile(task, args.batch)
    out: dict[str, Any] = {"prior_s": MICRO_BATCH_OVERHEAD_S, "fitted_s": fitted}
    for schedule in ("gpipe", "1f1b"):
        speed = record["speed_flops"]
        got, _, _ = plan(profile, speed, args.batch, args.mbps, args.rtt_ms, fitted, schedule)
        cuts = tuple(s.layers[0] for s in got.stages[1:])
        run = run_pipeline_mode(
            task, schedule, cuts, got.micro_batches, args.steps, args.batch, args.mbps, args.rtt_ms
        )
        print(run)
        plan_of = {"step_s": got.step_s, "micro_batches": got.micro_batches, "cuts": list(cuts)}
        key = "" if schedule == "gpipe" else "_1f1b"  # GPipe's keys as results kept them
        out["plan" + key], out["run" + key] = plan_of, run
    return out


def bench_task(task: str, args: argparse.Namespace) -> dict[str, Any]:
    got, record = _planned(task, args, args.rtt_ms)
    cuts = tuple(record["plan"]["cuts"])
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
    calibrated = calibrate(task, args, record, runs[0]["step_s"])
    return {**record, "runs": runs, "calibrated": calibrated}


# ----------------------------------------------------------------------------- the testbed


def bench_testbed(args: argparse.Namespace) -> dict[str, Any]:
    """Every task's runs on one testbed (a namespace per cluster at `--mbps`), taken down at
    the end whatever happens."""
    from testbed import down, parse_dcs, up

    layout = ",".join(f"{c}:{args.mbps}:{n}" for c, n in CLUSTERS.items())
    records = [_planned(task, args, TESTBED_RTT_MS) for task in args.tasks]
    try:
        bed = up(parse_dcs(layout, args.mbps, 1))
        before = bed.uplink_bytes()
        time.sleep(5.0)
        idle = sum(uplink_delta(before, bed.uplink_bytes()).values()) / 5.0
        tasks = []
        for _, record in records:
            runs = []
            for mode in ("gpipe", "1f1b", "data"):
                runs.append(testbed_run(bed, record["task"], mode, record["plan"], args))
                print(runs[-1], flush=True)
            tasks.append({**record, "runs": runs})
    finally:
        down()
    return {"layout": layout, "idle_uplink_bytes_per_s": idle, "tasks": tasks}


def testbed_run(
    bed: Any, task: str, mode: str, plan: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """One mode as a Ray driver in the hub namespace; a failure is a row, not the end."""
    micro, cuts = plan["micro_batches"], plan["cuts"]
    argv = [sys.executable, "-m", "bench.pipeline", "testbed-driver", "--task", task]
    argv += ["--mode", mode, "--micro", str(micro), "--steps", str(args.steps)]
    argv += ["--batch", str(args.batch), "--ray-address", bed.ray_address]
    argv += ["--cuts", ",".join(str(c) for c in cuts)]
    before = bed.uplink_bytes()
    try:
        res = bed.run_in_hub(argv, timeout=args.timeout_s, cwd=str(ROOT))
    except Exception as exc:  # a timeout: the other modes still run
        return {"mode": mode, "error": repr(exc)[:200]}
    after = bed.uplink_bytes()
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()
        return {"mode": mode, "error": tail[-1][:200] if tail else f"exit {res.returncode}"}
    row: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    up = uplink_delta(before, after)
    return {**row, "uplink_bytes": up, "uplink_bytes_total": sum(up.values())}


def testbed_driver(argv: list[str]) -> None:
    """Inside the hub namespace: one run on the testbed's Ray, no emulation; its row as JSON."""
    ap = argparse.ArgumentParser(prog="bench.pipeline testbed-driver")
    ap.add_argument("--task", required=True)
    ap.add_argument("--mode", choices=("gpipe", "1f1b", "data"), required=True)
    ap.add_argument("--cuts", required=True)
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--ray-address", required=True)
    a = ap.parse_args(argv)
    if a.mode == "data":
        row = run_data_mode(a.task, a.steps, a.batch, None, None, a.ray_address)
    else:
        cuts = tuple(int(c) for c in a.cuts.split(",") if c)
        row = run_pipeline_mode(
            a.task, a.mode, cuts, a.micro, a.steps, a.batch, None, None, a.ray_address
        )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
