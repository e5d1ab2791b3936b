"""`cpn plan`: the what-if planner over a snapshot file and a job file.

Exit codes: 0 a feasible plan, 1 no feasible plan (the answer is still printed), 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from api.cli.errors import fail

if TYPE_CHECKING:
    from scheduler import JobRequest, PlanResult, Snapshot

_OBJECTIVES = ("time", "cost", "cost-within-deadline")


def _check_objective(value: str) -> str:
    if value not in _OBJECTIVES:
        raise typer.BadParameter(f"{value!r}: use one of {', '.join(_OBJECTIVES)}")
    return value


def result_to_json(result: PlanResult) -> dict[str, Any]:
    """The --json object (a contract: keep the keys stable)."""
    from dataclasses import asdict

    from scheduler import Plan

    shown: Plan | None = result if isinstance(result, Plan) else result.closest
    out: dict[str, Any] = {
        "feasible": result.feasible,
        "reason": result.reason,
        "constraint": None if isinstance(result, Plan) else result.constraint,
        "objective": shown.objective if shown is not None else None,
        "placement": [
            {"cluster": a.cluster, "gpus": a.gpus} for a in (shown.placement if shown else ())
        ],
        "compression": shown.compression if shown else None,
        "sync": shown.sync if shown else None,
        "estimate": None,
        "victims": list(shown.victims) if shown else [],
        "explanation": list(shown.explanation if shown else result.explanation),
    }
    if shown is not None:
        est = asdict(shown.estimate)
        est["ring"] = list(shown.estimate.ring)
        est["bottleneck"] = list(shown.estimate.bottleneck) if shown.estimate.bottleneck else None
        est["batch_shares"] = dict(shown.estimate.batch_shares)
        est["tree"] = dict(shown.estimate.tree)  # {cluster: parent}; empty: the ring
        out["estimate"] = est
    return out


def parallelism_json(job: Any, snap: Snapshot, req: JobRequest | None = None) -> dict[str, Any]:
    """The job's parallelism over the snapshot: the memory-aware planner (`scheduler.memory`)
    on the job file's optional `model` (a transformer: blocks, dim, seq, vocab, optimizer),
    else a one-layer model of its `params`; `batch` (default 32) is the global batch;
    `parallelism` (default auto) fixes data (the plan above) or asks for a pipeline, which
    may split each stage's layers over GPUs of its cluster (tensor parallel, 3D). A
    pipeline gets its own estimate (`scheduler.pipeline_cost`) over `req`'s steps and QoS
    class: the plan above prices data parallelism."""
    from grammar.parallel import parse_parallelism
    from scheduler.memory import Layer, ModelProfile, plan_parallelism
    from scheduler.pipeline_cost import SCHEDULES

    raw = job if isinstance(job, dict) else {}
    try:
        mode = parse_parallelism(str(raw.get("parallelism", "auto")))
        model = raw.get("model")
        if isinstance(model, dict):
            profile = ModelProfile.transformer(**model)
        else:
            profile = ModelProfile((Layer("model", int(raw.get("params", 1)), 0.0, 0.0, 0.0),))
        batch = int(raw.get("batch", 32))
    except (TypeError, ValueError) as exc:
        raise fail("plan", "job.model", str(exc)) from None
    pipeline = raw.get("pipeline")
    schedule = str(pipeline.get("schedule", "gpipe")) if isinstance(pipeline, dict) else "gpipe"
    if schedule not in SCHEDULES:
        raise fail("plan", "job.pipeline.schedule", f"use one of {', '.join(SCHEDULES)}")
    out: dict[str, Any] = {"requested": str(mode), "mode": "data", "reason": "", "stages": []}
    if str(mode) == "data":
        out["reason"] = "the job file fixes data parallelism"
        return out
    try:
        got = plan_parallelism(profile, snap.clusters, snap.links, batch, schedule=schedule)
    except ValueError as exc:
        out.update(mode=None, reason=str(exc))
        return out
    out.update(
        mode=str(got.parallelism),
        reason=got.reason,
        micro_batches=got.micro_batches,
        bubble=got.bubble,
        step_s=got.step_s,
        tensor=got.tensor,
        fits=list(got.fits),
        stages=[
            {
                "cluster": st.cluster,
                "layers": list(st.layers),
                "memory_gb": round(st.memory.total / 1e9, 3),
                "gpu_gb": round(st.gpu_bytes / 1e9, 3),
                "compute_s": st.compute_s,
                "send_s": st.send_s,
            }
            for st in got.stages
        ],
    )
    if got.stages:
        out["schedule"] = schedule
        out["estimate"] = _pipeline_estimate(profile, got, snap, batch, req, schedule)
    return out


def _pipeline_estimate(
    profile: Any, got: Any, snap: Snapshot, batch: int, req: JobRequest | None, schedule: str
) -> dict[str, Any]:
    """The pipeline plan's step, run time, WAN bytes and price (`scheduler.pipeline_cost`);
    at the micro-batch cost the planner weighed."""
    import math

    from scheduler.pipeline_cost import StageWork, estimate_pipeline

    mb = math.ceil(batch / got.micro_batches)
    last = len(got.stages) - 1
    work = [
        StageWork(
            st.cluster,
            st.compute_s,
            0.0 if i == last else profile.layers[st.layers[1] - 1].activation_bytes * mb,
            got.tensor,
        )
        for i, st in enumerate(got.stages)
    ]
    est = estimate_pipeline(
        work,
        {c.name: c for c in snap.clusters},
        {(x.a, x.b): x for x in snap.links},
        got.micro_batches,
        req.steps if req is not None else 1,
        req.qos.qos_class if req is not None else None,
        micro_overhead_s=got.micro_overhead_s,
        schedule=schedule,
    )
    return {
        "step_s": est.step_s,
        "bottleneck_s": est.bottleneck_s,
        "link_s": list(est.link_s),
        "bubble": est.bubble,
        "steps": est.steps,
        "total_time_s": est.total_time_s,
        "wan_bytes_per_step": {f"{a}->{b}": n for a, b, n in est.wan_bytes_per_step},
        "wan_bytes": est.wan_bytes,
        "gpu_cost": est.gpu_cost,
        "egress_cost": est.egress_cost,
        "cost": est.cost,
    }


def _print_parallel(par: dict[str, Any]) -> None:
    print(f"  parallelism: {par['mode'] or 'none fits'} (asked: {par['requested']})")
    for i, st in enumerate(par["stages"]):
        lo, hi = st["layers"]
        print(
            f"    stage {i} on {st['cluster']}: layers {lo}..{hi - 1}, "
            f"{st['memory_gb']:.3g} of {st['gpu_gb']:.3g} GB a GPU, "
            f"compute {st['compute_s']:.4g} s a micro-batch"
            + (f", split over {par['tensor']} GPUs" if par.get("tensor", 1) > 1 else "")
        )
    if par["stages"]:
        print(
            f"    {par['micro_batches']} micro-batches, bubble {par['bubble'] * 100:.1f} %, "
            f"step {par['step_s']:.4g} s"
        )
    est = par.get("estimate")
    if est:
        print(
            f"    pipeline estimate: step {est['step_s']:.4g} s (bottleneck "
            f"{est['bottleneck_s']:.4g} s a micro-batch)   total {est['total_time_s']:.4g} s   "
            f"WAN {est['wan_bytes'] / 1e9:.4g} GB   cost {est['cost']:.4g} "
            f"(GPUs {est['gpu_cost']:.4g} + egress {est['egress_cost']:.4g})"
        )
    if par["reason"]:
        print(f"    why: {par['reason']}")


def planned(top: dict[str, Any], parallel: dict[str, Any]) -> dict[str, Any]:
    """The top-level answer states the parallel mode actually planned: a model that fits no
    GPU is no feasible data-parallel plan. Where it needs a pipeline, the placement and the
    estimate are the pipeline's; where nothing fits, the answer is infeasible (`memory`)."""
    mode = parallel.get("mode")
    out = {**top, "mode": mode}
    if not top["feasible"]:
        return out
    if mode is None:
        return {
            **out,
            "feasible": False,
            "constraint": "memory",
            "reason": parallel.get("reason", ""),
        }
    if mode != "data" and parallel.get("stages"):
        counts: dict[str, int] = {}
        width = int(parallel.get("tensor", 1))  # a stage's GPUs: its split
        for st in parallel["stages"]:
            counts[st["cluster"]] = counts.get(st["cluster"], 0) + width
        return {
            **out,
            "stages": len(parallel["stages"]),
            "tensor": width,
            "placement": [{"cluster": c, "gpus": g} for c, g in counts.items()],
            "compression": "none",
            "sync": "every-step",
            "estimate": parallel.get("estimate", top["estimate"]),
            "explanation": [parallel.get("reason", ""), *top["explanation"]],
        }
    return out


def _print_text(result: PlanResult, answer: dict[str, Any] | None = None) -> None:
    obj = answer or result_to_json(result)
    if obj["feasible"] and obj.get("mode") not in (None, "data"):
        stages, split = obj.get("stages", 1), obj.get("tensor", 1)
        if obj["mode"] == "tensor":
            shape = f"tensor parallel, each layer split over {split} GPUs"
        else:
            shape = f"a {obj['mode']} of {stages} stages" + (
                f", each split over {split} GPUs (3D)" if split > 1 else ""
            )
        print(f"feasible plan ({obj['objective']}): {shape}")
        print(
            "  placement:   " + ", ".join(f"{p['cluster']} x{p['gpus']}" for p in obj["placement"])
        )
        for line in obj["explanation"][:1]:
            print(f"  - {line}")
        return
    if obj["feasible"]:
        print(f"feasible plan ({obj['objective']})")
    else:
        print(f"infeasible: {obj['constraint']}: {obj['reason']}")
        if obj["placement"]:
            print("closest plan (breaks that rule):")
    if obj["placement"]:
        print(
            "  placement:   " + ", ".join(f"{p['cluster']} x{p['gpus']}" for p in obj["placement"])
        )
        print(f"  compression: {obj['compression']}   sync: {obj['sync']}")
        est = obj["estimate"]
        print(
            f"  step {est['step_time_s']:.4g} s   total {est['total_time_s']:.4g} s   "
            f"WAN {est['wan_bytes'] / 1e9:.4g} GB   cost {est['cost']:.4g}"
        )
    if obj["victims"]:
        print("  preempts:    " + ", ".join(obj["victims"]))
    for line in obj["explanation"]:
        print(f"  - {line}")


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI app."""

    @app.command("plan")
    def plan_cmd(
        snapshot: Path = typer.Option(
            ..., "--snapshot", help="SNAPSHOT.json: clusters and links", dir_okay=False
        ),
        job: Path = typer.Option(..., "--job", help="JOB.json: the job to place", dir_okay=False),
        objective: str = typer.Option(
            "time",
            "--objective",
            help="time | cost | cost-within-deadline",
            callback=_check_objective,
        ),
        evaluate: Path | None = typer.Option(
            None,
            "--evaluate",
            help='PLACEMENT.json [{"cluster", "gpus"}]: evaluate this placement instead',
            dir_okay=False,
        ),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Plan a job over a snapshot (what-if): placement, compression, sync and estimate.

        Exit 0 when feasible, 1 when not (the reason is printed), 2 on bad input.
        """
        from api.plan_files import (
            PlanFileError,
            _load_json,
            load_job,
            load_placement,
            load_snapshot,
        )
        from scheduler import Plan
        from scheduler import evaluate as evaluate_placement
        from scheduler import plan as make_plan

        try:
            snap = load_snapshot(snapshot)
            req = load_job(job)
            placement = load_placement(evaluate) if evaluate is not None else None
        except PlanFileError as exc:
            raise fail("plan", exc.field, exc.message) from None
        if objective == "cost-within-deadline" and req.qos.deadline_s is None:
            raise fail(
                "plan",
                "job.qos.deadline_s",
                "--objective cost-within-deadline needs a deadline; add qos.deadline_s",
            )
        if placement is not None:
            result = evaluate_placement(snap, req, placement, objective)  # type: ignore[arg-type]
        else:
            result = make_plan(snap, req, objective)  # type: ignore[arg-type]
        parallel = parallelism_json(_load_json(job, "job"), snap, req)
        answer = planned(result_to_json(result), parallel)
        if as_json:
            print(json.dumps({**answer, "parallelism": parallel}, sort_keys=False))
        else:
            _print_text(result, answer)
            _print_parallel(parallel)
        if not isinstance(result, Plan) or not answer["feasible"]:
            raise typer.Exit(1)
