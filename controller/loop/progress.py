"""Progress flushing: a run's reports become metrics, events, WAN metering and calibration data.

The run's thread queues reports on its handle; the loop writes a batch per job per pass in one
transaction (no per-step transactions). The batch is fenced: its first write is a conditional
UPDATE on the job's fencing epoch, so a run that was superseded (its job adopted by another
replica, or launched again) writes nothing, whichever commits first. A batch whose
transaction fails for a passing reason (a lock, a lost connection) is kept, in order, for the
next pass: reports are not lost to a race or a database hiccup.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from controller.loop.policy import Stop, StopReason
from controller.loop.runs import RunHandle
from controller.money.metering import meter_wan
from controller.network.snapshot import normalize_gpu_model
from controller.store.models import (
    Job,
    JobEvent,
    JobLog,
    JobMetric,
    StepObservation,
    utcnow,
)
from training import Progress
from training.results import AutoChoice

log = logging.getLogger("cpn.progress")

Compute = tuple[int, dict[str, float]]
"""The last (step, compute seconds per cluster) a run reported."""

Wire = tuple[float, dict[str, int]]
"""The last (exchange seconds, bytes sent by each cluster) a run reported."""

SHORT_SHARE = 0.9
"""A cluster whose exchanges send below this share of its WAN reservation is short of it: the
link delivers less than the plan was promised, even in its bursts."""
SHORT_REPORTS = 2
"""Reports in a row short of the reservation that raise the warning (once, until it recovers)."""

LOGS_KEPT = 20_000
"""A job's newest log lines kept; older ones are deleted a `LOGS_TRIM` lines at a time."""
LOGS_TRIM = 1_000

TRANSIENT = (OperationalError, InterfaceError, PoolTimeout, StaleDataError)
"""Errors after which the same batch may well commit on the next pass (a lock or a deadlock,
a lost connection, an exhausted pool, a row changed meanwhile)."""


def flush(factory: sessionmaker[Session], handle: RunHandle) -> None:
    """Write the run's queued progress: metrics, progress events, new WAN bytes (metered),
    per-cluster compute times, and the step to resume from. A superseded run's batch is
    dropped and the run asked to stop."""
    batch = handle.take()
    if not batch:
        return
    try:
        current = _write(factory, handle, batch)
    except TRANSIENT:
        with handle.lock:  # back in front of what arrived meanwhile, for the next pass
            handle.pending[:0] = batch
        raise
    except Exception:
        # The database refused the batch itself: kept, it would fail every pass after this one.
        log.error("job %s: %d progress reports refused and dropped", handle.job_id, len(batch))
        raise
    if not current:
        log.warning(
            "job %s: run of fence %s superseded (or its job is gone); %d reports dropped",
            handle.job_id,
            handle.fence,
            len(batch),
        )
        handle.request_stop(Stop(StopReason.SUPERSEDED))


def _write(factory: sessionmaker[Session], handle: RunHandle, batch: list[Progress]) -> bool:
    """Write `batch` in one transaction; False (nothing written) when the job's fencing epoch
    is no longer the run's or the job is gone. The handle's counters move only once it
    committed."""
    now = utcnow()
    wan_seen = dict(handle.wan_seen)
    last_compute = handle.last_compute
    wire = handle.wire_seen
    shorts = dict(handle.short_reports)
    deltas: dict[tuple[str, str], int] = {}
    with factory() as session, session.begin():
        # First write, so it holds the row until commit: an adoption waits or has won.
        fence = () if handle.fence is None else (Job.fence == handle.fence,)
        fenced = session.execute(
            update(Job)
            .where(Job.id == handle.job_id, *fence)
            .values(checkpoint_step=batch[-1].step, version=Job.version + 1)
            .execution_options(synchronize_session=False)
        )
        if fenced.rowcount != 1:  # type: ignore[attr-defined]
            return False
        job = session.get(Job, handle.job_id)
        assert job is not None  # the row was just updated in this transaction
        for p in batch:
            steps_done = p.step
            step_time = p.wall_s / steps_done if steps_done else None
            session.add(
                JobMetric(
                    job_id=job.id,
                    step=p.step,
                    loss=p.loss,
                    accuracy=p.accuracy,
                    step_time_s=step_time,
                    compute_time_s=p.compute_s,
                    comm_time_s=p.comm_s,
                    wan_bytes=p.wan_bytes_total,
                )
            )
            session.add(
                JobEvent(
                    job_id=job.id,
                    kind="progress",
                    message=f"step {p.step}/{p.total_steps}",
                    data={
                        "step": p.step,
                        "steps": p.total_steps,
                        "loss": p.loss,
                        "accuracy": p.accuracy,
                        "wan_bytes": p.wan_bytes_total,
                        "compression": p.compression,
                        "compression_ratio": p.compression_ratio,
                        "compute_s": p.compute_s,
                        "comm_s": p.comm_s,
                        "wall_s": p.wall_s,
                    },
                )
            )
            for link, total in p.wan_bytes.items():
                delta = total - wan_seen.get(link, 0)
                if delta > 0:
                    deltas[link] = deltas.get(link, 0) + delta
                    wan_seen[link] = total
            last_compute = _observe(session, handle, p, last_compute)
            wire, rates = wire_rates(wire, p)
            for cluster, rate in rates.items():
                kbps = handle.reserved_kbps.get(cluster)
                if kbps is None:
                    continue
                shorts[cluster] = (
                    shorts.get(cluster, 0) + 1 if rate < SHORT_SHARE * kbps * 1e3 else 0
                )
                if shorts[cluster] == SHORT_REPORTS:
                    session.add(_short_event(job.id, cluster, rate, kbps, p.step))
        decided = batch[-1].auto_decisions[handle.decisions_seen :]
        for choice in decided:
            session.add(_adapted_event(job.id, choice))
        if deltas:
            meter_wan(session, job, deltas, handle.wan_since, now)
        logged = _log(session, job.id, batch, handle.log_lines)
    handle.log_lines = logged
    handle.wan_seen = wan_seen
    handle.last_compute = last_compute
    handle.wire_seen = wire
    handle.short_reports = shorts
    handle.decisions_seen += len(decided)
    if deltas:
        handle.wan_since = now
    return True


def _log(session: Session, job_id: str, batch: list[Progress], kept: int | None) -> int:
    """Store the batch's log lines; past `LOGS_KEPT`, delete the job's oldest beyond it (each
    `LOGS_TRIM` lines, not each report). `kept`: the job's lines as of the last batch (None:
    this run's first, counted here once, so earlier attempts' lines count too). Returns the
    job's lines now, before a trim."""
    rows = [
        {
            "job_id": job_id,
            "at": datetime.fromtimestamp(line.at, UTC),
            "source": line.source[:64],
            "stream": line.stream[:8],
            "text": line.text,
        }
        for p in batch
        for line in p.logs
    ]
    written = kept
    if written is None:
        written = session.scalar(select(func.count()).where(JobLog.job_id == job_id)) or 0
    if not rows:
        return written
    session.execute(insert(JobLog), rows)
    now = written + len(rows)
    if now > LOGS_KEPT and now // LOGS_TRIM > written // LOGS_TRIM:
        edge = session.scalar(
            select(JobLog.id)
            .where(JobLog.job_id == job_id)
            .order_by(JobLog.id.desc())
            .offset(LOGS_KEPT)
            .limit(1)
        )
        if edge is not None:
            session.execute(delete(JobLog).where(JobLog.job_id == job_id, JobLog.id <= edge))
    return now


def wire_rates(previous: Wire | None, p: Progress) -> tuple[Wire, dict[str, float]]:
    """Each cluster's send rate while exchanging since `previous` (bit/s): the bytes it put on
    its links over the exchange seconds between the two reports. Returns the report's
    counters too, the `previous` of the next report. No rates for the first report, nor
    across a restart (the counters start again)."""
    sent: dict[str, int] = {}
    for (src, _), n in p.wan_bytes.items():
        sent[src] = sent.get(src, 0) + n
    now: Wire = (p.exchange_s, sent)
    if previous is None or p.exchange_s <= previous[0]:
        return now, {}
    seconds = p.exchange_s - previous[0]
    rates = {
        c: 8.0 * (n - previous[1].get(c, 0)) / seconds
        for c, n in sent.items()
        if n > previous[1].get(c, 0)
    }
    return now, rates


def _short_event(job_id: str, cluster: str, rate: float, kbps: int, step: int) -> JobEvent:
    """The warning that a cluster's exchanges run below what its job reserved of the WAN."""
    return JobEvent(
        job_id=job_id,
        kind="warning",
        message=(
            f"WAN of {cluster}: exchanges sent at {rate / 1e6:,.1f} Mbit/s, below the "
            f"{kbps / 1e3:,.1f} Mbit/s the job reserved of its uplink: the link, or a peer "
            "the exchange waits for, delivers less than planned, so the run will take longer "
            "than its estimate"
        ),
        data={
            "cluster": cluster,
            "step": step,
            "measured_bps": round(rate),
            "reserved_bps": kbps * 1000,
        },
    )


def _adapted_event(job_id: str, choice: AutoChoice) -> JobEvent:
    """A change of the run's sync or compression by the auto policy, away from its plan (the
    user left them to `auto`, `TrainSpec.adapt`): the plan's estimate no longer holds."""
    return JobEvent(
        job_id=job_id,
        kind="warning",
        message=(
            f"step {choice.step}: the run now syncs {choice.sync} with {choice.compression} "
            f"compression, not as planned, because the link moved: {choice.why}"
        ),
        data={
            "step": choice.step,
            "sync": choice.sync,
            "compression": choice.compression,
            "why": choice.why,
        },
    )


def _observe(session: Session, handle: RunHandle, p: Progress, previous: Compute | None) -> Compute:
    """Write down what the report `p` measured of each cluster's GPUs (`observations`).
    Returns the report's counters, the `previous` of the next report."""
    session.add_all(observations(handle, p, previous))
    return (p.step, dict(p.compute_by_cluster))


def observations(handle: RunHandle, p: Progress, previous: Compute | None) -> list[StepObservation]:
    """Compute time per step of each cluster's GPUs since the `previous` report: the
    calibration data of the cost model. A cluster's workers share its part of the global
    batch equally (its `batch_shares`, or its workers' part of an equal split), so each
    cluster's slowest rank measures its GPU model on that part of flops_per_step. None where
    the run did not train on its planned split since: a cluster left or joined, one sat out
    (it joined late and its state was on its way: no compute), or the counters restarted."""
    if previous is None or p.step <= previous[0] or not handle.flops_per_step:
        return []
    per_step = {
        c: (total - previous[1].get(c, total)) / (p.step - previous[0])
        for c, total in p.compute_by_cluster.items()
    }
    if set(per_step) != set(previous[1]) or min(per_step.values(), default=0.0) <= 0:
        return []
    workers = sum(handle.clusters.values())
    shares = handle.batch_shares
    if not set(per_step) <= set(shares):
        shares = {}  # a cluster joined: the run weighs it by the others' mean (an estimate)
    norm = sum(shares.get(c, 0.0) for c in per_step) or 1.0
    out: list[StepObservation] = []
    for cluster, compute_s in per_step.items():
        model = handle.gpu_models.get(cluster)
        if model is None:
            continue
        out.append(
            StepObservation(
                job_id=handle.job_id,
                gpu_model=normalize_gpu_model(model) or model,
                gpus=1,
                flops=handle.flops_per_step
                * (
                    shares[cluster] / norm / max(1, handle.clusters.get(cluster, 1))
                    if cluster in shares
                    else 1.0 / workers
                ),
                compute_s=compute_s,
                predicted_s=handle.predicted_step_s,
            )
        )
    return out
