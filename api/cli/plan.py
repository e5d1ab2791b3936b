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
    from scheduler import PlanResult

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
        out["estimate"] = est
    return out


def _print_text(result: PlanResult) -> None:
    obj = result_to_json(result)
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
        from api.plan_files import PlanFileError, load_job, load_placement, load_snapshot
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
        if as_json:
            print(json.dumps(result_to_json(result), sort_keys=False))
        else:
            _print_text(result)
        if not isinstance(result, Plan):
            raise typer.Exit(1)
