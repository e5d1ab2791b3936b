"""The launcher: runs placed jobs as Ray actors (through `training.run`) and reports back.

One thread per running job calls `training.run`; the controller loop (`tick`) is the only
writer to the database: it flushes progress in batches (no per-step transactions), stops runs
that were cancelled, preempted or lost a cluster, and settles finished runs (state, GPUs,
metering, ledger). Ray is started once per controller, never per job.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller import lifecycle
from controller.allocations import release
from controller.jobspec import JobSpec
from controller.metering import meter_allocations, meter_wan, price_usage
from controller.models import (
    Allocation,
    Cluster,
    Job,
    JobEvent,
    JobMetric,
    Link,
    StepObservation,
    utcnow,
)
from controller.resources import effective_links
from controller.snapshot import normalize_gpu_model
from controller.tasks import builtin_work

log = logging.getLogger("cpn.launcher")

TRAIN_ARGS = ("batch_size", "lr", "seed", "eval_every", "outer_lr", "outer_momentum")
"""Job spec `args` the built-in runtime understands."""


@dataclass
class RunHandle:
    """A job's run in this controller: its thread, its unflushed progress, why it should stop."""

    job_id: str
    clusters: dict[str, int]
    gpu_models: dict[str, str]
    flops_per_step: float
    predicted_step_s: float | None
    stop_reason: str | None = None
    pending: list[Any] = field(default_factory=list)
    wan_seen: dict[str, int] = field(default_factory=dict)
    wan_since: datetime = field(default_factory=utcnow)
    last_compute: tuple[int, dict[str, float]] | None = None
    report: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def on_progress(self, progress: Any) -> None:
        with self.lock:
            self.pending.append(progress)

    def take(self) -> list[Any]:
        with self.lock:
            out, self.pending = self.pending, []
        return out


@dataclass
class LauncherConfig:
    replica_id: str
    checkpoint_root: Path
    ray_address: str | None = None
    max_attempts: int = 3
    emulate_wan: bool = True
    ray_num_cpus: int | None = None


class Launcher:
    """Starts, watches, stops and settles the runs of the jobs this replica owns."""

    def __init__(self, factory: sessionmaker[Session], config: LauncherConfig) -> None:
        self.factory = factory
        self.config = config
        self.handles: dict[str, RunHandle] = {}
        self._ray_resources: dict[str, float] = {}

    # ---- Ray ---------------------------------------------------------------------------

    def _ensure_ray(self, needed: dict[str, int]) -> bool:
        """Connect to Ray (once); False when a local Ray lacks a cluster and jobs still run."""
        import ray

        from training import cluster_resource

        want = {cluster_resource(c): float(n) for c, n in needed.items()}
        if ray.is_initialized():
            have = ray.cluster_resources()
            if all(have.get(k, 0.0) >= v for k, v in want.items()):
                return True
            if self.config.ray_address or self.handles:
                return False  # an operator's Ray, or busy: wait for capacity
            ray.shutdown()  # local Ray sized before this cluster existed: size it again
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=False)
            return True
        with self.factory() as session:
            inventory = {
                c.name: sum(g.allocatable for g in c.gpus) for c in session.scalars(select(Cluster))
            }
        resources = {cluster_resource(n): float(max(g, 1)) for n, g in inventory.items()}
        for k, v in want.items():
            resources[k] = max(resources.get(k, 0.0), v)
        ray.init(
            num_cpus=self.config.ray_num_cpus or os.cpu_count() or 1,
            resources=resources,
            include_dashboard=False,
            log_to_driver=False,
        )
        self._ray_resources = resources
        log.info("started a local Ray with %s", resources)
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        for handle in self.handles.values():
            handle.stop_reason = handle.stop_reason or "controller shutting down"
        for handle in self.handles.values():
            handle.done.wait(timeout)
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # shutting down: nothing more to do
            log.exception("ray shutdown failed")

    # ---- launching ---------------------------------------------------------------------

    def launch(self, job_id: str) -> bool:
        """Start the run of a SCHEDULED (or adopted RUNNING) job owned by this replica."""
        with self.factory() as session, session.begin():
            job = session.get(Job, job_id)
            if job is None or job.owner != self.config.replica_id or job_id in self.handles:
                return False
            if job.state not in ("SCHEDULED", "RUNNING"):
                return False
            allocs = session.execute(
                select(Cluster.name, Allocation.gpu_model, Allocation.gpus)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
            ).all()
            clusters: dict[str, int] = {}
            models: dict[str, str] = {}
            for name, model, gpus in allocs:
                clusters[name] = clusters.get(name, 0) + gpus
                models[name] = model
            if not clusters:
                return False
            if not self._ensure_ray(clusters):
                job.reason = "waiting for Ray capacity"
                return False
            spec = JobSpec.model_validate(job.spec)
            train_spec = self._train_spec(session, job, spec, clusters)
            work = self._work(spec)
            handle = RunHandle(
                job_id=job.id,
                clusters=clusters,
                gpu_models=models,
                flops_per_step=work,
                predicted_step_s=(job.placement or {}).get("estimate", {}).get("compute_s"),
            )
            resumed = train_spec.resume
            message = (
                f"launched {sum(clusters.values())} workers on "
                + ", ".join(f"{c}:{n}" for c, n in clusters.items())
                + f" ({train_spec.compression}, {train_spec.sync}"
                + (", WAN emulated" if train_spec.emulated else "")
                + (", resuming from checkpoint" if resumed else "")
                + ")"
            )
            if job.state == "SCHEDULED":
                lifecycle.transition(session, job, "RUNNING", message, clusters=clusters)
            else:
                session.add(JobEvent(job_id=job.id, kind="info", message=message))
        self.handles[job_id] = handle
        thread = threading.Thread(
            target=self._run, args=(handle, train_spec), name=f"cpn-job-{job_id[:8]}", daemon=True
        )
        thread.start()
        log.info("job %s: %s", job_id, message)
        return True

    def _work(self, spec: JobSpec) -> float:
        if spec.work is not None and spec.work.flops_per_step is not None:
            return spec.work.flops_per_step
        if spec.task.startswith("builtin:"):
            return builtin_work(spec.task).flops_per_step
        return 0.0

    def _train_spec(
        self, session: Session, job: Job, spec: JobSpec, clusters: dict[str, int]
    ) -> Any:
        from training import LinkSpec, TrainSpec
        from training.checkpoint import open_store

        placement = job.placement or {}
        compression = (
            spec.compression if spec.compression != "auto" else placement.get("compression", "none")
        )
        sync = spec.sync if spec.sync != "auto" else placement.get("sync", "every-step")
        checkpoint = self.config.checkpoint_root / job.id
        checkpoint.mkdir(parents=True, exist_ok=True)
        resume = bool(open_store(str(checkpoint)).steps())
        links: list[Any] = []
        if self.config.emulate_wan and not self.config.ray_address and len(clusters) > 1:
            ids = dict(session.execute(select(Cluster.name, Cluster.id)).all())
            wanted = {ids[c] for c in clusters}
            rows = (
                session.scalars(
                    select(Link).where(
                        Link.src_cluster_id.in_(wanted), Link.dst_cluster_id.in_(wanted)
                    )
                )
                .unique()
                .all()
            )
            seen: set[frozenset[str]] = set()
            for link in effective_links(rows):
                pair = frozenset((link.src.name, link.dst.name))
                if pair in seen:
                    continue
                seen.add(pair)
                links.append(
                    LinkSpec(link.src.name, link.dst.name, link.bandwidth_gbps * 1000, link.rtt_ms)
                )
        extra = {k: spec.args[k] for k in TRAIN_ARGS if k in spec.args}
        return TrainSpec(
            task=spec.task,
            clusters=dict(clusters),
            compression=compression,
            sync=sync,
            steps=spec.steps,
            links=links,
            checkpoint=str(checkpoint),
            checkpoint_every=max(1, spec.steps // 10),
            resume=resume,
            max_restarts=2,
            **extra,
        )

    def _run(self, handle: RunHandle, train_spec: Any) -> None:
        try:
            from training import run

            handle.report = run(
                train_spec, on_progress=handle.on_progress, should_stop=handle.should_stop
            )
        except BaseException as exc:  # reported to the loop, which decides retry or FAILED
            handle.error = exc
        finally:
            handle.done.set()

    # ---- the loop's work ---------------------------------------------------------------

    def tick(self) -> None:
        """Flush progress, stop what must stop, settle what finished."""
        if not self.handles:
            return
        self._flush()
        self._check_stops()
        for job_id, handle in list(self.handles.items()):
            if handle.done.is_set():
                self._flush_one(handle)
                self._settle(handle)
                del self.handles[job_id]

    def _flush(self) -> None:
        for handle in self.handles.values():
            self._flush_one(handle)

    def _flush_one(self, handle: RunHandle) -> None:
        batch = handle.take()
        if not batch:
            return
        now = utcnow()
        with self.factory() as session, session.begin():
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
                for key, total in p.wan_bytes.items():
                    delta = total - handle.wan_seen.get(key, 0)
                    if delta > 0:
                        src, _, dst = key.partition("->")
                        deltas[(src, dst)] = deltas.get((src, dst), 0) + delta
                        handle.wan_seen[key] = total
                self._observe(session, handle, p)
            if deltas:
                meter_wan(session, job, deltas, handle.wan_since, now)
                handle.wan_since = now
            job.checkpoint_step = batch[-1].step

    def _observe(self, session: Session, handle: RunHandle, p: Any) -> None:
        """Compute time per step of each cluster's GPUs: the calibration data of the cost
        model. Every worker gets an equal share of the global batch, so each cluster's
        slowest rank measures its GPU model on flops_per_step / workers."""
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

    def _check_stops(self) -> None:
        ids = [j for j, h in self.handles.items() if h.stop_reason is None]
        if not ids:
            return
        with self.factory() as session:
            jobs = session.execute(
                select(Job.id, Job.state, Job.preempted_by, Job.owner).where(Job.id.in_(ids))
            ).all()
            down = session.execute(
                select(Allocation.job_id, Cluster.name)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(
                    Allocation.job_id.in_(ids),
                    Allocation.ended_at.is_(None),
                    Cluster.state == "DOWN",
                )
            ).all()
        for job_id, state, preempted_by, owner in jobs:
            handle = self.handles[job_id]
            if state == "CANCELLED":
                handle.stop_reason = "cancelled"
            elif owner != self.config.replica_id:
                handle.stop_reason = "adopted by another replica"
            elif preempted_by:
                handle.stop_reason = f"preempted by job {preempted_by}"
        for job_id, cluster in down:
            handle = self.handles[job_id]
            handle.stop_reason = handle.stop_reason or f"cluster {cluster} is DOWN"

    def _settle(self, handle: RunHandle) -> None:
        """Record how a run ended and give its GPUs back, in one transaction."""
        with self.factory() as session, session.begin():
            job = session.get(Job, handle.job_id)
            if job is None:
                return
            reason = handle.stop_reason
            if job.owner != self.config.replica_id:
                return  # another replica adopted it; it settles there
            if job.state == "CANCELLED":
                session.add(JobEvent(job_id=job.id, kind="info", message="workers stopped"))
            elif handle.error is not None:
                self._failed(session, job, handle.error)
            elif reason and reason.startswith("preempted"):
                job.preempted_by = None
                release(session, job)
                lifecycle.transition(
                    session,
                    job,
                    "PENDING",
                    f"{reason}; checkpointed, resumes later",
                    step=job.checkpoint_step,
                )
            elif reason and "DOWN" in reason:
                release(session, job)
                lifecycle.transition(
                    session,
                    job,
                    "RESCHEDULING",
                    f"{reason}; placing again on what is left",
                    step=job.checkpoint_step,
                )
            elif reason:
                return  # controller shutting down: the job stays RUNNING for adoption
            else:
                report = handle.report
                release(session, job)
                lifecycle.transition(
                    session,
                    job,
                    "SUCCEEDED",
                    f"finished {report.steps} steps: accuracy {report.final_accuracy:.4f}",
                    report=_report_data(report),
                )
            meter_allocations(session, job)
            price_usage(session, job.id)

    def _failed(self, session: Session, job: Job, error: BaseException) -> None:
        message = f"{error.__class__.__name__}: {error}"[:2000]
        session.add(JobEvent(job_id=job.id, kind="error", message=message))
        release(session, job)
        job.attempts += 1
        # A task that cannot load or a bad spec will not get better by retrying.
        permanent = isinstance(error, ValueError) or isinstance(error.__cause__, ValueError)
        if permanent or job.attempts >= self.config.max_attempts:
            why = "the job cannot run" if permanent else f"failed {job.attempts} times"
            lifecycle.transition(session, job, "FAILED", f"{why}: {message}"[:512])
        else:
            lifecycle.transition(
                session,
                job,
                "RESCHEDULING",
                f"attempt {job.attempts} failed; retrying from the last checkpoint",
            )


def _report_data(report: Any) -> dict[str, Any]:
    keys = (
        "steps",
        "final_loss",
        "final_accuracy",
        "wall_s",
        "compute_s",
        "comm_s",
        "wan_s",
        "wan_bytes",
        "wan_bytes_total",
        "compression_ratio",
        "wan_emulated",
        "compression",
        "sync",
        "restarts",
        "resumed_from_step",
    )
    return {k: getattr(report, k) for k in keys if hasattr(report, k)}
