"""The launcher: the runs of the jobs this replica owns, from launch to settlement.

Each unit does one thing: `controller.loop.ray_run` starts a run on its own thread,
`controller.loop.progress` flushes its reports, `controller.loop.policy` decides (purely) what a
stop means, and `controller.loop.settle` applies that decision. This class holds the runs and calls
them in order on every pass of the controller loop (`tick`), which is the only writer to the
database.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller.loop import progress
from controller.loop.policy import Stop, StopReason, stop_requested
from controller.loop.ray_run import LauncherConfig, RayConnection, launch
from controller.loop.runs import RunHandle
from controller.loop.settle import settle
from controller.money import budget
from controller.store.models import Allocation, Cluster, Job, utcnow
from grammar.states import ClusterState

__all__ = ["Launcher", "LauncherConfig", "RunHandle"]

log = logging.getLogger("cpn.launcher")


class Launcher:
    """Starts, watches, stops and settles the runs of the jobs this replica owns."""

    def __init__(self, factory: sessionmaker[Session], config: LauncherConfig) -> None:
        self.factory = factory
        self.config = config
        self.handles: dict[str, RunHandle] = {}
        self.ray = RayConnection(factory, config)

    def launch(self, job_id: str) -> bool:
        """Start the run of a SCHEDULED (or adopted RUNNING) job owned by this replica."""
        if job_id in self.handles:
            return False
        try:
            handle = launch(self.factory, self.config, self.ray, job_id, busy=bool(self.handles))
        except Exception as exc:  # this job's failure; the next job in the pass still launches
            log.exception("job %s: launch failed", job_id)
            self._settle_failed_launch(job_id, exc)
            return False
        if handle is None:
            return False
        self.handles[job_id] = handle
        return True

    def _settle_failed_launch(self, job_id: str, error: Exception) -> None:
        """A launch that raised is a failed attempt of its job: the policy retries it
        (RESCHEDULING, resuming from its checkpoint) or fails it, and its GPUs go back."""
        failed = RunHandle(
            job_id=job_id, clusters={}, gpu_models={}, flops_per_step=0.0, predicted_step_s=None
        )
        failed.error = error
        failed.done.set()
        try:
            settle(self.factory, failed, self.config.replica_id, self.config.max_attempts)
        except Exception:  # e.g. the database is down: the next pass tries the launch again
            log.exception("job %s: settling the failed launch failed", job_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        for handle in self.handles.values():
            handle.request_stop(Stop(StopReason.SHUTDOWN))
        for handle in self.handles.values():
            handle.done.wait(timeout)
        self.ray.shutdown()

    def tick(self) -> None:
        """Flush progress, stop what must stop, settle what finished."""
        if not self.handles:
            return
        for handle in self.handles.values():
            progress.flush(self.factory, handle)
        self._check_stops()
        for job_id, handle in list(self.handles.items()):
            if handle.done.is_set():
                progress.flush(self.factory, handle)
                settle(self.factory, handle, self.config.replica_id, self.config.max_attempts)
                del self.handles[job_id]

    def _check_stops(self) -> None:
        """Ask runs to stop whose job was cancelled, adopted, preempted or lost a cluster, or
        whose tenant's spend reached its budget."""
        ids = [j for j, h in self.handles.items() if h.stop is None]
        if not ids:
            return
        with self.factory() as session:
            jobs = session.execute(
                select(Job.id, Job.state, Job.preempted_by, Job.owner, Job.tenant_id).where(
                    Job.id.in_(ids)
                )
            ).all()
            over = budget.exhausted(session, {row.tenant_id for row in jobs}, utcnow())
            down: dict[str, str] = {}
            for job_id, cluster in session.execute(
                select(Allocation.job_id, Cluster.name)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(
                    Allocation.job_id.in_(ids),
                    Allocation.ended_at.is_(None),
                    Cluster.state == ClusterState.DOWN,
                )
            ).all():
                down.setdefault(job_id, cluster)
        for job_id, state, preempted_by, owner, tenant_id in jobs:
            stop = stop_requested(
                job_state=state,
                owned=owner == self.config.replica_id,
                preempted_by=preempted_by,
                down_cluster=down.get(job_id),
                over_budget=over.get(tenant_id),
            )
            if stop is not None:
                self.handles[job_id].request_stop(stop)
