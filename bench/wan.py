"""cpn against PyTorch DDP on the namespace WAN testbed (package `testbed`), on the same wire.

3 datacenters x 2 workers, every datacenter's uplink shaped with tc tbf (both directions).
Modes: (a) DDP over one flat gloo group, no hook (what Ray Train's TorchTrainer sets up);
(b) DDP + PowerSGD hook; (c) DDP + fp16 hook; (d) cpn's hierarchical modes. Every mode trains
the same task from the same seed on the same global batches to the task's target accuracy.
Bytes are read from the uplinks' interface counters (headers and control traffic included);
compute utilisation is compute time over wall time (cpn: its own counters on rank 0; DDP:
steps x the per-step compute time rank 0 measures alone before training, since DDP overlaps
the all-reduce with backward).

    sudo .venv/bin/python -m bench.wan            # 100 and 1000 Mbit/s, prints tables, plots
    sudo .venv/bin/python -m bench.wan --mbit 100 --validate   # + emulated-vs-real check

Results: bench/results/wan.json, bench/results/wan.png, bench/results/wan.md.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
DCS = ["a", "b", "c"]
WORKERS = 2
DDP_PORTS = itertools.count(29555)  # a fresh rendezvous port per run: no stale store
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "ddp" or "cpn"
    hook: str = "none"  # ddp: none, fp16, powersgd:R
    compression: str = "none"  # cpn
    sync: str = "every-step"  # cpn


MODES = [
    Mode("(a) DDP flat gloo, no hook", "ddp"),
    Mode("(b) DDP + PowerSGD r1", "ddp", hook="powersgd:1"),
    Mode("(b) DDP + PowerSGD r4", "ddp", hook="powersgd:4"),
    Mode("(c) DDP + fp16 hook", "ddp", hook="fp16"),
    Mode("(d) cpn every-step fp32", "cpn"),
    Mode("(d) cpn every-step int8", "cpn", compression="int8"),
    Mode("(d) cpn every-step powersgd:2", "cpn", compression="powersgd:2"),
    Mode("(d) cpn stale:2 int8", "cpn", compression="int8", sync="stale:2"),
    Mode("(d) cpn DiLoCo local-sgd:8 int8", "cpn", compression="int8", sync="local-sgd:8"),
    Mode("(d) cpn adaptive", "cpn", sync="adaptive"),
]


# ----------------------------------------------------------------------------- DDP worker


def ddp_bucket_cap_mb(hook: str, model: Any) -> float | None:
    """DDP's bucket size for `hook` (None: DDP's default): PowerSGD gets one bucket.

    torch's `powerSGD_hook` issues a bucket's P and Q all-reduces from future callbacks (gloo's
    threads) while the training thread issues the next bucket's first all-reduce. DDP rebuilds
    its buckets after the first step (1 MiB first bucket, then 25 MiB ones), and from then on
    the order of those collectives on the shared gloo group differs between ranks: gloo pairs
    them by issue order and aborts with a collective mismatch (`op.preamble.length <=
    op.nbytes`) once PowerSGD takes over from the exact warm-up all-reduces. With one bucket
    every step's collectives form a single chain. The cost is the overlap of the exchange with
    backward, small where the exchange is many times the compute (the regime measured here).
    """
    if not hook.startswith("powersgd:"):
        return None
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return nbytes / 2**20 + 1.0


def ddp_worker(a: argparse.Namespace) -> None:
    """One DDP rank (runs inside its datacenter's namespace)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from training.data import batch_indices, shard
    from training.tasks import as_tensors, evaluate, load_task

    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    torch.set_num_threads(1)
    task = load_task(a.task)
    x, y = as_tensors(task.train)
    xe, ye = as_tensors(task.eval)
    batch = task.batch_size
    torch.manual_seed(a.seed)
    model = task.model()
    # compute alone, before any communication: what a step costs without the network
    probe = copy.deepcopy(model)
    popt = task.optimizer.build(probe.parameters())
    t0 = time.perf_counter()
    for s in range(10):
        mine = shard(batch_indices(len(x), batch, a.seed, s), a.rank, a.world)
        popt.zero_grad()
        task.loss(probe(x[mine]), y[mine]).backward()
        popt.step()
    step_compute = (time.perf_counter() - t0) / 10
    del probe, popt

    dist.init_process_group(
        "gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world
    )
    ddp = DDP(model, bucket_cap_mb=ddp_bucket_cap_mb(a.hook, model))
    if a.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.hook.startswith("powersgd:"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(a.hook.split(":")[1]),
            start_powerSGD_iter=a.powersgd_start,  # a few exact steps first, as its docs advise
            min_compression_rate=2,
        )
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    opt = task.optimizer.build(ddp.parameters())

    history: list[dict[str, float]] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(a.steps):
        mine = shard(batch_indices(len(x), batch, a.seed, step), a.rank, a.world)
        opt.zero_grad()
        task.loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        if a.rank == 0 and ((step + 1) % a.eval_every == 0 or step + 1 == a.steps):
            ev = evaluate(task, model, xe, ye)
            history.append(
                {
                    "wall_s": time.perf_counter() - start,
                    "step": step + 1,
                    "accuracy": ev.accuracy,
                    "eval_loss": ev.loss,
                }
            )
    dist.barrier()
    wall = time.perf_counter() - start
    if a.rank == 0:
        Path(a.out).write_text(
            json.dumps(
                {
                    "wall_s": wall,
                    "compute_s": step_compute * a.steps,
                    "final_accuracy": history[-1]["accuracy"],
                    "history": history,
                }
            )
        )
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- cpn driver


def cpn_driver(a: argparse.Namespace) -> None:
    """One cpn run through `training.run` (runs in the hub namespace: a Ray driver)."""
    from training import TrainSpec, run

    diloco = a.sync.startswith("local-sgd")
    spec = TrainSpec(
        task=a.task,
        clusters=dict.fromkeys(a.dcs.split(","), WORKERS),
        compression=a.compression,
        sync=a.sync,
        steps=a.steps,
        seed=a.seed,
        eval_every=a.eval_every,
        ray_address=a.ray_address,
        link_mbps=a.emulate_mbps,
        rtt_ms=0.0 if a.emulate_mbps else None,
        # long DiLoCo runs with SGD-momentum inner steps: plain averaging outer step
        outer_lr=1.0 if diloco else 0.7,
        outer_momentum=0.0 if diloco else 0.9,
    )
    print(json.dumps(run(spec).to_dict()))


# ----------------------------------------------------------------------------- orchestration


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    for h in history:
        if h.get("accuracy") is not None and h["accuracy"] >= target:
            return float(h["wall_s"])
    return None


def run_mode(bed: Any, mode: Mode, task: str, steps: int, evals: int, seed: int) -> dict[str, Any]:
    from testbed.layout import UPLINK_IF

    eval_every = max(1, steps // evals)
    before = bed.uplink_bytes()
    t0 = time.perf_counter()
    py = [sys.executable, "-m", "bench.wan"]
    if mode.kind == "ddp":
        out = Path(f"/tmp/cpn-wan-ddp-{os.getpid()}.json")
        out.unlink(missing_ok=True)
        procs = []
        master, port = bed.datacenters[0]["ip"], next(DDP_PORTS)
        for rank in range(len(DCS) * WORKERS):
            dc = bed.datacenters[rank // WORKERS]
            argv = ["ip", "netns", "exec", dc["netns"], *py, "ddp-worker"]
            argv += ["--rank", str(rank), "--world", str(len(DCS) * WORKERS)]
            argv += ["--master", master, "--port", str(port), "--task", task]
            argv += ["--steps", str(steps), "--eval-every", str(eval_every), "--seed", str(seed)]
            argv += ["--hook", mode.hook, "--ifname", UPLINK_IF, "--out", str(out)]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        errs = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode != 0:
                errs.append(f"exit {p.returncode}: {err.decode()[-800:]}")
        if errs:
            raise RuntimeError(f"{mode.name}: DDP rank failed: {errs[0]}")
        rep = json.loads(out.read_text())
        out.unlink()
    else:
        argv = [*py, "cpn-driver", "--task", task, "--steps", str(steps), "--seed", str(seed)]
        argv += ["--eval-every", str(eval_every), "--compression", mode.compression]
        argv += ["--sync", mode.sync, "--dcs", ",".join(DCS), "--ray-address", bed.ray_address]
        res = bed.run_in_hub(argv, timeout=RUN_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"{mode.name}: {res.stderr[-800:]}")
        rep = json.loads(res.stdout.strip().splitlines()[-1])
    total = time.perf_counter() - t0
    after = bed.uplink_bytes()
    up = {dc: after[dc][0] - before[dc][0] for dc in after}
    return {
        "mode": mode.name,
        "wall_s": rep["wall_s"],
        "total_s": total,
        "compute_s": rep["compute_s"],
        "final_accuracy": rep["final_accuracy"],
        "uplink_bytes": up,
        "uplink_bytes_total": sum(up.values()),
        "cpn_reported_bytes": rep.get("wan_bytes_total"),
        "history": rep["history"],
    }


def table(rows: list[dict[str, Any]], target: float, mbit: float) -> str:
    base = rows[0]
    psgd = [r for r in rows if "PowerSGD" in r["mode"]]
    lines = [
        f"#### {mbit:g} Mbit/s uplinks, target accuracy {target:.2f}",
        "",
        "| mode | time to target (s) | final acc | wall (s) | uplink bytes (measured) "
        "| compute util | vs (a): time | vs best (b): time | vs (a): bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    best_b = min((r["ttt"] for r in psgd if r["ttt"]), default=None)
    for r in rows:
        ttt = r["ttt"]

        def ratio(x: float | None, y: float | None) -> str:
            return f"{x / y:.1f}x" if x and y else "-"

        lines.append(
            f"| {r['mode']} | {f'{ttt:.1f}' if ttt else 'not reached'} | "
            f"{100 * r['final_accuracy']:.1f} % | {r['wall_s']:.1f} | "
            f"{r['uplink_bytes_total']:,} | {100 * r['compute_s'] / r['wall_s']:.0f} % | "
            f"{ratio(base['ttt'], ttt)} | {ratio(best_b, ttt)} | "
            f"{base['uplink_bytes_total'] / max(r['uplink_bytes_total'], 1):.1f}x |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, (mbit, block) in zip(axes[0], runs.items(), strict=True):
        for r in block["rows"]:
            h = r["history"]
            style = "--" if r["mode"].startswith(("(a)", "(b)", "(c)")) else "-"
            ax.plot(
                [p["wall_s"] for p in h],
                [100 * p["accuracy"] for p in h],
                style,
                marker=".",
                label=r["mode"],
            )
        ax.axhline(100 * block["target"], color="grey", ls=":", lw=1)
        ax.set_title(f"{results['task']} on the testbed, {mbit} Mbit/s uplinks, 3 DC x 2")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("eval accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def emulated_run(task: str, steps: int, evals: int, seed: int, mbit: float) -> dict[str, Any]:
    """The cpn fp32 every-step run on one node (a local Ray), its WAN emulated at `mbit` per
    cluster pair: on the testbed a pair's path is one uplink and one downlink at that rate."""
    argv = [sys.executable, "-m", "bench.wan", "cpn-driver", "--task", task]
    argv += ["--steps", str(steps), "--seed", str(seed), "--eval-every", str(steps // evals)]
    argv += ["--compression", "none", "--sync", "every-step", "--dcs", ",".join(DCS)]
    argv += ["--emulate-mbps", str(mbit)]
    env = {k: v for k, v in os.environ.items() if k not in ("CPN_RAY_ADDRESS",)}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"emulated run: {res.stderr[-800:]}")
    rep: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return rep


def validation_table(
    task: str, steps: int, mbit: float, real: list[dict[str, Any]], emulated: list[dict[str, Any]]
) -> str:
    """Median wall time of the same run real (testbed) and emulated (one node), and the gap."""
    import statistics

    r = statistics.median(x["wall_s"] for x in real)
    e = statistics.median(x["wall_s"] for x in emulated)
    walls = {
        side: ", ".join(f"{x['wall_s']:.1f}" for x in runs)
        for side, runs in (("real", real), ("emulated", emulated))
    }
    rc = statistics.median(x["compute_s"] for x in real)
    ec = statistics.median(x["compute_s"] for x in emulated)
    return "\n".join(
        [
            f"#### emulation vs testbed: cpn every-step fp32, {task}, {steps} steps, "
            f"{mbit:g} Mbit/s, median of {len(real)} runs each",
            "",
            "| run | wall (s) | compute (s) | each run's wall (s) | WAN bytes |",
            "| --- | ---: | ---: | --- | ---: |",
            f"| real (testbed) | {r:.1f} | {rc:.1f} | "
            f"{walls['real']} | "
            f"{real[0]['uplink_bytes_total']:,} (interfaces) |",
            f"| emulated (one node) | {e:.1f} | {ec:.1f} | "
            f"{walls['emulated']} | "
            f"{emulated[0]['wan_bytes_total']:,} (cpn) |",
            f"| gap (emulated vs real) | {100 * (e - r) / r:+.0f} % | "
            f"{100 * (ec - rc) / rc:+.0f} % | | |",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("ddp-worker")
    for k, t in (("rank", int), ("world", int), ("port", int), ("steps", int)):
        w.add_argument(f"--{k}", type=t, required=True)
    w.add_argument("--eval-every", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--powersgd-start", type=int, default=10, help="exact steps before PowerSGD")
    for k in ("master", "task", "hook", "ifname", "out"):
        w.add_argument(f"--{k}", required=True)
    d = sub.add_parser("cpn-driver")
    d.add_argument("--task", required=True)
    d.add_argument("--steps", type=int, required=True)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eval-every", type=int, required=True)
    d.add_argument("--compression", default="none")
    d.add_argument("--sync", default="every-step")
    d.add_argument("--dcs", default=",".join(DCS))
    d.add_argument("--ray-address", default=None)
    d.add_argument("--emulate-mbps", type=float, default=None)
    p.add_argument("--mbit", type=float, nargs="+", default=[100.0, 1000.0])
    p.add_argument("--task", default="builtin:mnist1d-cnn")
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--evals", type=int, default=24)
    p.add_argument("--target", type=float, default=None, help="accuracy to race to (task's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="", help="comma-separated substrings of mode names")
    p.add_argument("--validate", action="store_true", help="also emulate the fp32 run locally")
    p.add_argument("--repeat", type=int, default=3, help="runs of each side of --validate")
    p.add_argument("--name", default="wan", help="results file stem in bench/results/")
    a = p.parse_args(argv)
    if a.cmd == "ddp-worker":
        ddp_worker(a)
        return
    if a.cmd == "cpn-driver":
        cpn_driver(a)
        return

    from testbed import TestbedError, down, parse_dcs, up
    from training.tasks import load_task

    target = a.target or load_task(a.task).target_accuracy or 0.8
    wanted = [s.strip() for s in a.modes.split(",") if s.strip()]
    modes = [m for m in MODES if not wanted or any(s in m.name for s in wanted)]
    results: dict[str, Any] = {"task": a.task, "steps": a.steps, "runs": {}}
    md: list[str] = []
    RESULTS.mkdir(exist_ok=True)
    try:
        for mbit in a.mbit:
            spec = ",".join(f"{dc}:{mbit}:{WORKERS}" for dc in DCS)
            try:
                bed = up(parse_dcs(spec, mbit, WORKERS))
            except TestbedError as exc:
                sys.exit(f"bench.wan: {exc}")
            rows = []
            for mode in modes:
                r = run_mode(bed, mode, a.task, a.steps, a.evals, a.seed)
                r["ttt"] = time_to(r["history"], target)
                rows.append(r)
                print(
                    f"{mbit:g} Mbit/s {mode.name}: wall {r['wall_s']:.1f}s "
                    f"ttt {r['ttt']} acc {r['final_accuracy']:.3f} "
                    f"bytes {r['uplink_bytes_total']:,}",
                    flush=True,
                )
            results["runs"][f"{mbit:g}"] = {"target": target, "rows": rows}
            md.append(table(rows, target, mbit))
            print(md[-1], flush=True)
            if a.validate:
                fp32 = next(m for m in MODES if m.name == "(d) cpn every-step fp32")
                real = [r for r in rows if r["mode"] == fp32.name]
                while len(real) < a.repeat:
                    real.append(run_mode(bed, fp32, a.task, a.steps, a.evals, a.seed))
            down()
            if a.validate:  # the testbed's Ray is gone: the emulated runs have the host alone
                emulated = [
                    emulated_run(a.task, a.steps, a.evals, a.seed, mbit) for _ in range(a.repeat)
                ]
                results["runs"][f"{mbit:g}"]["validation"] = {
                    "real_wall_s": [x["wall_s"] for x in real],
                    "emulated_wall_s": [x["wall_s"] for x in emulated],
                }
                md.append(validation_table(a.task, a.steps, mbit, real, emulated))
                print(md[-1], flush=True)
    finally:
        down()
    cmd = "sudo .venv/bin/python -m bench.wan " + shlex.join(argv or sys.argv[1:])
    header = f"`{cmd}` ({a.task}, {a.steps} steps, 3 datacenters x {WORKERS} workers)\n\n"
    (RESULTS / f"{a.name}.md").write_text(header + "\n\n".join(md) + "\n")
    (RESULTS / f"{a.name}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"{a.name}.png")
    print(f"wrote {RESULTS / a.name}.{{md,json,png}}")


if __name__ == "__main__":
    main()
