"""Progress flushing: a run's reports become metrics, events, WAN metering and calibration data.

The run's thread queues reports on its handle; the loop writes a batch per job per pass in one
transaction (no per-step transactions).
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from controller.metering import meter_wan
from controller.models import Job, JobEvent, JobMetric, StepObservation, utcnow
from controller.runs import RunHandle
from controller.snapshot import normalize_gpu_model
from training import Progress


def flush(factory: sessionmaker[Session], handle: RunHandle) -> None:
    """Write the run's queued progress: metrics, progress events, new WAN bytes (metered),
    per-cluster compute times, and the step to resume from."""
    batch = handle.take()
    if not batch:
        return
    now = utcnow()
    with factory() as session, session.begin():
        job = session.get(Job, handle.job_id)
        if job is None:
            return
        deltas: dict[tuple[str, str], int] = {}
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
                delta = total - handle.wan_seen.get(link, 0)
                if delta > 0:
                    deltas[link] = deltas.get(link, 0) + delta
                    handle.wan_seen[link] = total
            _observe(session, handle, p)
        if deltas:
            meter_wan(session, job, deltas, handle.wan_since, now)
            handle.wan_since = now
        job.checkpoint_step = batch[-1].step


def _observe(session: Session, handle: RunHandle, p: Progress) -> None:
    """Compute time per step of each cluster's GPUs: the calibration data of the cost model.
    Every worker gets an equal share of the global batch, so each cluster's slowest rank
    measures its GPU model on flops_per_step / workers."""
    previous = handle.last_compute
    handle.last_compute = (p.step, dict(p.compute_by_cluster))
    if previous is None or p.step <= previous[0] or not handle.flops_per_step:
        return
    workers = sum(handle.clusters.values())
    for cluster, total in p.compute_by_cluster.items():
        per_step = (total - previous[1].get(cluster, total)) / (p.step - previous[0])
        model = handle.gpu_models.get(cluster)
        if per_step <= 0 or model is None:  # a restart resets the counters
            continue
        session.add(
            StepObservation(
                job_id=handle.job_id,
                gpu_model=normalize_gpu_model(model) or model,
                gpus=1,
                flops=handle.flops_per_step / workers,
                compute_s=per_step,
                predicted_s=handle.predicted_step_s,
            )
        )
