"""Settlement: a finished run's outcome applied to its job in one transaction.

`controller.loop.policy` says how the run ended and what to do; this module does it: it records
the error, counts the failed attempt, ends the run on the books (`lifecycle.end_run`: GPUs
back, usage metered and priced) and moves the job to the state the decision names. A
pipeline that lost a cluster has only the stages there re-placed (`controller.loop.restage`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from controller.access import scrub
from controller.jobs import lifecycle
from controller.loop import restage
from controller.loop.policy import FAILURES, Decision, StopReason, decide, next_state, stop_of
from controller.loop.runs import RunHandle
from controller.store import failpoints
from controller.store.models import Job, JobEvent
from training import TrainReport

REPORT_KEYS = (
    "steps",
    "final_loss",
    "final_accuracy",
    "final_eval_loss",
    "best_step",
    "best_accuracy",
    "best_eval_loss",
    "warning",
    "wall_s",
    "hosts",
    "host_cores",
    "compute_s",
    "comm_s",
    "intra_s",
    "wan_wait_s",
    "wan_s",
    "wan_bytes",
    "wan_bytes_total",
    "wan_setup_bytes",
    "compression_ratio",
    "wan_emulated",
    "compression",
    "sync",
    "restarts",
    "resumed_from_step",
    "membership",
    "artefact",
)
"""What the SUCCEEDED event keeps of the run's report (`wan_wait_s`: the links' share of the
steps, which `bench.promise` sets against the plan's; `membership`: the clusters that left or
joined a run under fault domains, which the demo and the console read; `wan_setup_bytes`: of
the WAN bytes, the start-up's, which go round gloo's ring whatever collective the plan
chose, so what ran is checked against the plan without them)."""

log = logging.getLogger("cpn.settle")


def settle(
    factory: sessionmaker[Session], handle: RunHandle, replica_id: str, max_attempts: int
) -> Decision | None:
    """Record how the run ended; returns the decision (None when the job row is gone)."""
    with factory() as session, session.begin():
        job = session.get(Job, handle.job_id)
        if job is None:
            return None
        requested = handle.stop.reason if handle.stop else None
        # A superseded run settles nothing: the job's GPUs and bill are its newer run's now. An
        # adoption committed after this read bumped the job's version: every settlement that
        # writes the job then fails (StaleDataError) and the next pass reads the new fence.
        current = handle.fence is None or job.fence == handle.fence
        stop = stop_of(
            requested,
            handle.error,
            job_state=job.state,
            owned=job.owner == replica_id,
            current=current,
        )
        if stop is StopReason.SUPERSEDED:
            log.warning("job %s: run of fence %s superseded by %s", job.id, handle.fence, job.fence)
        error = ""
        if stop in FAILURES:
            assert handle.error is not None
            # The tenant reads this: masked and bounded; the log keeps it whole for admins.
            log.warning("job %s: run failed: %r", job.id, handle.error)
            error = scrub.tenant_error(handle.error)
            session.add(JobEvent(job_id=job.id, kind="error", message=error))
            job.attempts += 1
        decision = decide(stop, job.attempts, max_attempts)
        if decision is Decision.LEAVE:
            return decision
        if stop is StopReason.CANCELLED:
            session.add(JobEvent(job_id=job.id, kind="info", message="workers stopped"))
        if stop is StopReason.PREEMPTED:
            job.preempted_by = None
        # A pipeline that lost a cluster moves only the stages there (read before its GPUs
        # go back: the stages that stay keep theirs); anything else is placed again whole.
        moved = (
            restage.decide(session, job, handle.stop.detail)
            if stop is StopReason.CLUSTER_DOWN and handle.stop is not None
            else None
        )
        lifecycle.end_run(session, job, handle.ended_at)
        if moved is not None:
            restage.apply(session, job, moved, handle.stop.detail if handle.stop else "")
            failpoints.failpoint("settle.after_usage")
            return decision
        to = next_state(stop, decision)
        if to is not None:
            detail = handle.stop.detail if handle.stop else ""
            reason, data = _why(stop, decision, job, detail, error, handle.report)
            if stop is StopReason.COMPLETED and handle.report and handle.report.warning:
                # a run that diverged says so where the tenant looks: an event of its own
                session.add(JobEvent(job_id=job.id, kind="warning", message=handle.report.warning))
            lifecycle.transition(session, job, to, reason, **data)
        failpoints.failpoint("settle.after_usage")  # books written, not committed
        return decision


def _why(
    stop: StopReason,
    decision: Decision,
    job: Job,
    detail: str,
    error: str,
    report: TrainReport | None,
) -> tuple[str, dict[str, Any]]:
    """The transition's reason and event data."""
    if stop is StopReason.COMPLETED:
        assert report is not None
        data = report.to_dict()
        kept = {
            k: data[k]
            for k in REPORT_KEYS
            # JSON has no NaN (PostgreSQL refuses it): a figure the run never measured is left out
            if k in data and not (isinstance(data[k], float) and not math.isfinite(data[k]))
        }
        said = f"finished {report.steps} steps: accuracy {report.final_accuracy:.4f}"
        if report.warning and math.isfinite(report.best_eval_loss):
            # the best is by eval loss: its accuracy may well be below the final one, so the
            # final figures come first, named as final, then the best's
            said = (
                f"finished {report.steps} steps: final accuracy {report.final_accuracy:.4f}, "
                f"eval loss {report.final_eval_loss:.4g}; its best evaluation by eval loss was "
                f"step {report.best_step} (eval loss {report.best_eval_loss:.4g}, accuracy "
                f"{report.best_accuracy:.4f})"
            )
        elif report.warning:
            said += (
                f" (its best evaluation: accuracy {report.best_accuracy:.4f} at step "
                f"{report.best_step})"
            )
        art = report.artefact
        if art.get("which") == "best" and art.get("step") != report.steps:
            said += f"; its model is the best evaluation's, of step {art['step']}"
        return said, {"report": kept}
    if stop is StopReason.PREEMPTED:
        # Another tenant's job, maybe: the victim's tenant is not told which (the log says).
        log.info("job %s preempted by job %s", job.id, detail)
        return (
            "preempted by a higher-priority job; checkpointed, resumes later",
            {"step": job.checkpoint_step},
        )
    if stop is StopReason.CLUSTER_DOWN:
        return (
            f"cluster {detail} is DOWN; placing again on what is left",
            {"step": job.checkpoint_step},
        )
    if stop is StopReason.BUDGET:
        return (
            f"budget exhausted: {detail}; stopped at step {job.checkpoint_step or 0} "
            "(checkpointed); an admin may raise the budget, then submit the job again",
            {"step": job.checkpoint_step, "stop": str(stop)},
        )
    if decision is Decision.RETRY:
        return f"attempt {job.attempts} failed; retrying from the last checkpoint", {}
    why = "the job cannot run" if stop is StopReason.INVALID else f"failed {job.attempts} times"
    return f"{why}: {error}", {}
