"""A lost datacenter: fault domains (shrink, then rejoin from a peer) against checkpoint-restart
(issue 50), on one machine's local Ray with the WAN emulated (not the namespace testbed).

Three clusters a, b, c (one worker each) train `--task` with `--sync` over emulated links of
`--mbit` / `--rtt-ms`, `--steps` steps, a checkpoint every tenth of the run. Three runs:

- `clean`: no failure;
- `fault-domains` (cpn now): c's worker is killed (SIGKILL, `ray.kill`) once the run passes a
  third of its steps; a and b go on without it; at two thirds the caller asks for c again
  (`membership`) and it joins, taking the model and outer state from a peer;
- `restart` (cpn before, `fault_domains=False`): the same kill; every cluster restarts from
  the newest checkpoint. On a local Ray c's slot is free again at once, so this run gets c
  back at the restart, sooner than at two thirds: the comparison favours it.

Per run: wall time, goodput (useful samples per second, the global batch times the steps, over
the clean run's: the steps a restart does again are not useful), time to the target accuracy
(`--target` of the clean run's final), final accuracy and what was recovered how fast.
Goals (issue 50, item 4): goodput >= 0.9, time to target >= 1.5x sooner than restart, final
accuracy within 1 point of the clean run.

    .venv/bin/python -m bench.fault_domains          # writes bench/results/fault-domains.*

Two cores: run nothing beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
CLUSTERS = {"a": 1, "b": 1, "c": 1}


def _one(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import ray

    from training import Progress, TrainSpec
    from training.faults import Membership
    from training.runner import run

    spec = TrainSpec(
        task=args.task,
        clusters=dict(CLUSTERS),
        sync=args.sync,
        compression="none",
        steps=args.steps,
        link_mbps=args.mbit,
        rtt_ms=args.rtt_ms,
        checkpoint=str(root / mode),
        checkpoint_every=max(1, args.steps // 10),
        eval_every=max(1, args.steps // 20),
        fault_domains=mode != "restart",
        fault_grace_s=args.grace_s,
    )
    state: dict[str, Any] = {"killed_at": None, "want": Membership(0, dict(CLUSTERS))}

    def on_progress(p: Progress) -> None:
        if mode == "clean":
            return
        if state["killed_at"] is None and p.step >= args.steps // 3:
            for name in ray.util.list_named_actors():
                if name.endswith("-w2"):  # c's worker
                    ray.kill(ray.get_actor(name), no_restart=True)
            state["killed_at"] = (p.step, p.wall_s)
        elif state["want"].version == 0 and p.step >= 2 * args.steps // 3:
            state["want"] = Membership(1, dict(CLUSTERS))

    report = run(spec, on_progress=on_progress, membership=lambda: state["want"])
    return {
        "mode": mode,
        "wall_s": report.wall_s,
        "final_accuracy": report.final_accuracy,
        "restarts": report.restarts,
        "resumed_from_step": report.resumed_from_step,
        "killed_at_step": state["killed_at"][0] if state["killed_at"] else None,
        "membership": report.membership,
        "history": report.history,
        "batch": spec.batch_size,
        "wan_setup_bytes": report.wan_setup_bytes,
    }


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _time_to(history: list[dict[str, Any]], target: float) -> float | None:
    for h in history:
        if h.get("accuracy") is not None and h["accuracy"] >= target:
            return float(h["wall_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="builtin:mnist1d-mlp")
    parser.add_argument("--sync", default="local-sgd:8")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mbit", type=float, default=25.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--grace-s", type=float, default=20.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import ray

    from training import cluster_resource

    ray.init(
        num_cpus=2,
        resources={cluster_resource(c): 2.0 for c in CLUSTERS},
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = [_one(m, args, Path(tmp)) for m in ("clean", "fault-domains", "restart")]
    finally:
        ray.shutdown()
    clean = runs[0]
    target = args.target * clean["final_accuracy"]
    rows = []
    for r in runs:
        r["goodput"] = clean["wall_s"] / r["wall_s"]
        r["time_to_target_s"] = _time_to(r["history"], target)
        r["accuracy_delta"] = r["final_accuracy"] - clean["final_accuracy"]
        rows.append(r)
    fd, rs = rows[1], rows[2]
    sooner = (
        rs["time_to_target_s"] / fd["time_to_target_s"]
        if fd["time_to_target_s"] and rs["time_to_target_s"]
        else None
    )
    regime = (
        f"local Ray on 2 cores, clusters a, b, c x 1 worker, {args.task}, {args.sync}, "
        f"compression none, {args.steps} steps, emulated links {args.mbit:g} Mbit/s "
        f"{args.rtt_ms:g} ms RTT, grace {args.grace_s:g} s; c killed at 1/3, asked back at 2/3"
    )
    lines = [
        "# A lost datacenter: fault domains against checkpoint-restart",
        "",
        f"Regime: {regime}. Made by `.venv/bin/python -m bench.fault_domains`, nothing beside it.",
        f"Target accuracy: {target:.4f} ({args.target:g} of the clean run's final).",
        "",
        "| run | wall s | goodput | time to target s | final accuracy | Δ vs clean | restarts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["time_to_target_s"]
        lines.append(
            f"| {r['mode']} | {r['wall_s']:.1f} | {r['goodput']:.2f} | "
            f"{'-' if t is None else f'{t:.1f}'} | {r['final_accuracy']:.4f} | "
            f"{r['accuracy_delta']:+.4f} | {r['restarts']} |"
        )
    lines += ["", "Membership of the fault-domain run:", ""]
    for m in fd["membership"]:
        reformed = "" if m["change"] == "seated" else f", re-formed in {m['recovery_s']:.2f} s"
        lines.append(f"- step {m['step']}: {m['cluster']} {m['change']} ({m['why']}){reformed}")
    lines += [
        "",
        "Goals (issue 50, item 4): goodput >= 0.9 "
        f"({'met' if fd['goodput'] >= 0.9 else 'not met'}: {fd['goodput']:.2f}); time to target "
        ">= 1.5x sooner than restart ("
        + ("n/a" if sooner is None else f"{'met' if sooner >= 1.5 else 'not met'}: {sooner:.2f}x")
        + f"); final accuracy within 1 point ({_met(abs(fd['accuracy_delta']) <= 0.01)}"
        f": {fd['accuracy_delta']:+.4f}). The restart run got c back at once (local Ray), sooner "
        "than the fault-domain run did.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fault-domains.md").write_text("\n".join(lines) + "\n")
    (args.out / "fault-domains.json").write_text(
        json.dumps({"regime": regime, "runs": rows}, indent=2, default=str)
    )
    _plot(rows, target, args.out / "fault-domains.png")
    print("\n".join(lines))
    return 0


def _plot(rows: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        h = [x for x in r["history"] if x.get("accuracy") is not None]
        ax.plot([x["wall_s"] for x in h], [x["accuracy"] for x in h], label=r["mode"])
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval accuracy")
    ax.set_title("c lost at 1/3 of the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
