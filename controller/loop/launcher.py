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

from controller.jobs import lifecycle
from controller.jobs.request import spec_of
from controller.loop import progress
from controller.loop.policy import Stop, StopReason, stop_requested
from controller.loop.ray_run import LauncherConfig, RayConnection, launch, run_layout
from controller.loop.replan import Replanned, held_slots, replan
from controller.loop.runs import RunHandle, RunLayout
from controller.loop.settle import settle
from controller.money import budget
from controller.network.allocations import Slot, reserve, resize_wan
from controller.network.snapshot import Calibration, World, build_world
from controller.store.models import Allocation, Cluster, ClusterGpus, Job, JobEvent, utcnow
from controller.values.errors import Conflict
from grammar.states import ClusterState
from training.faults import Recovery, recover

__all__ = ["Launcher", "LauncherConfig", "RunHandle"]

log = logging.getLogger("cpn.launcher")


class Launcher:
    """Starts, watches, stops and settles the runs of the jobs this replica owns."""

    def __init__(self, factory: sessionmaker[Session], config: LauncherConfig) -> None:
        self.factory = factory
        self.config = config
        self.handles: dict[str, RunHandle] = {}
        self.ray = RayConnection(factory, config)
        self.calibration: Calibration | None = None
        """The calibrated GPU efficiency the controller plans with (a running job's plan is
        re-estimated with it when a cluster leaves or joins)."""

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
            if handle.live:
                self._follow(handle)
        self._check_stops()
        self._grow()
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
            handle = self.handles[job_id]
            lost = down.get(job_id)
            if lost is not None and handle.live and self._shrinks(handle, lost):
                self._leave(handle, lost, f"cluster {lost} went DOWN (its agent's lease expired)")
                lost = None
            stop = stop_requested(
                job_state=state,
                owned=owner == self.config.replica_id,
                preempted_by=preempted_by,
                down_cluster=lost,
                over_budget=over.get(tenant_id),
            )
            if stop is not None:
                self.handles[job_id].request_stop(stop)

    # ---- datacenter fault domains: a lost cluster leaves a running job, another joins ----

    @staticmethod
    def _shrinks(handle: RunHandle, cluster: str) -> bool:
        """The run goes on without `cluster` (the one policy: `training.faults.recover`)."""
        running = list(handle.wanted.clusters if handle.wanted else handle.running)
        what = recover(live=True, clusters=running, lost={cluster}, restarts=0, max_restarts=0)
        return what is Recovery.SHRINK

    def _leave(self, handle: RunHandle, cluster: str, why: str) -> None:
        """`cluster` leaves the run: its GPUs and WAN share go back (once), the job stays
        RUNNING, its plan is re-estimated on what is left, and the run is asked to go on
        without it."""
        wanted = dict(handle.wanted.clusters if handle.wanted else handle.running)
        wanted.pop(cluster, None)
        layout: RunLayout | None = None
        with self.factory() as session, session.begin():
            job = session.get(Job, handle.job_id)
            row = session.scalar(select(Cluster).where(Cluster.name == cluster))
            if job is None or row is None:
                return
            lifecycle.leave(
                session,
                job,
                row.id,
                f"{why}: the job goes on without it on {', '.join(wanted) or 'no cluster'}"
                " (no restart, no checkpoint read); its GPUs are released",
            )
            new = self._replan(session, job, handle, held_slots(session, job.id))
            if new is not None and new.plan is not None:
                layout = self._adopt(session, job, new, wanted)
        handle.want(wanted, layout)
        log.info("job %s: %s left the run (%s)", handle.job_id, cluster, why)

    def _replan(
        self,
        session: Session,
        job: Job,
        handle: RunHandle,
        slots: list[Slot],
        world: World | None = None,
    ) -> Replanned | None:
        """The job's plan on `slots`, its decisions kept (`controller.loop.replan`)."""
        spec = spec_of(job)
        left = max(0, spec.steps - handle.step)
        efficiency = self.calibration.for_task(spec.task) if self.calibration else None
        return replan(session, job, slots, efficiency, utcnow(), left, world)

    def _adopt(
        self, session: Session, job: Job, new: Replanned, clusters: dict[str, int]
    ) -> RunLayout:
        """Store `new` as the job's plan, its WAN rates moved on the ports (`resize_wan`:
        where a port has too little left, the cluster keeps what it held and the plan says
        so), say so in an event, and lay the run out by it."""
        assert new.plan is not None
        held = resize_wan(session, job, new.plan.wan_kbps)
        plan = new.plan
        note = new.note
        kept = {c: r for c, r in held.items() if r < plan.wan_kbps.get(c, 0)}
        if kept:
            plan = plan.model_copy(update={"wan_kbps": {**plan.wan_kbps, **kept}})
            note += "; the WAN rate stays at what the ports had left on " + ", ".join(
                f"{c} ({r / 1000:,.1f} Mbit/s)" for c, r in sorted(kept.items())
            )
        job.placement = plan
        session.add(JobEvent(job_id=job.id, kind="info", message=note))
        return run_layout(self.config, plan, clusters)

    def _follow(self, handle: RunHandle) -> None:
        """Write down the clusters the run itself lost (a worker died, a link went silent)
        or took on."""
        for change in handle.new_changes():
            cluster = str(change["cluster"])
            if change["change"] in ("left", "refused") and (
                handle.wanted is None or cluster in handle.wanted.clusters
            ):
                why = (
                    f"the run lost cluster {cluster} at step {change['step']} ({change['why']})"
                    if change["change"] == "left"
                    else f"cluster {cluster} could not join: {change['why']}"
                )
                self._leave(handle, cluster, why)
            elif change["change"] == "joined":
                with self.factory() as session, session.begin():
                    job = session.get(Job, handle.job_id)
                    row = session.scalar(select(Cluster).where(Cluster.name == cluster))
                    if job is not None and row is not None:
                        lifecycle.joined(
                            session,
                            job,
                            row.id,
                            utcnow(),
                            f"cluster {cluster} joined the run at step {change['step']} with "
                            f"{change['workers']} worker(s)"
                            + (
                                f", started and loaded in {change['ready_s']:.1f} s while the "
                                "others trained on"
                                if "ready_s" in change
                                else ""
                            )
                            + f"; the run re-formed in {change['recovery_s']:.1f} s and the "
                            "cluster took the model from a peer",
                        )
            elif change["change"] == "seated":
                with self.factory() as session, session.begin():
                    session.add(
                        JobEvent(
                            job_id=handle.job_id,
                            kind="info",
                            message=f"cluster {cluster} trains from step {change['step']}: "
                            f"{change['why']}",
                        )
                    )

    def _grow(self) -> None:
        """A run that lost clusters takes their GPUs again where a READY cluster it does not
        use has them free (the lost one back, or another), billed from when it joins."""
        for handle in list(self.handles.values()):
            if not handle.live or handle.wanted is None or handle.stop is not None:
                continue
            missing = sum(handle.clusters.values()) - sum(handle.wanted.clusters.values())
            if missing <= 0 or set(handle.wanted.clusters) != set(handle.running):
                continue  # whole, or a change the run has not made yet
            joined: tuple[str, dict[str, int], RunLayout | None] | None = None
            with self.factory() as session, session.begin():
                job = session.get(Job, handle.job_id)
                if job is None:
                    continue
                query = (
                    select(Cluster.name, ClusterGpus.model)
                    .join(ClusterGpus, ClusterGpus.cluster_id == Cluster.id)
                    .where(
                        Cluster.state == ClusterState.READY,
                        Cluster.name.not_in(list(handle.wanted.clusters)),
                        ClusterGpus.allocatable - ClusterGpus.in_use >= missing,
                    )
                    .order_by(Cluster.name.not_in(list(handle.clusters)), Cluster.name)
                )
                data = spec_of(job).data
                if data.residency == "local" and data.clusters:  # only where its data is
                    query = query.where(Cluster.name.in_(list(data.clusters)))
                candidates = session.execute(query).all()
                world = build_world(session, job.qos_class, utcnow()) if candidates else None
                held = held_slots(session, job.id)
                for name, model in candidates:
                    slot = Slot(name, model, missing)
                    new = self._replan(session, job, handle, [*held, slot], world)
                    if new is not None and new.refused:
                        log.info("job %s: %s cannot join: %s", handle.job_id, name, new.note)
                        continue
                    try:  # its WAN rate with the others' (`_adopt`), where the ports have it
                        with session.begin_nested():
                            reserve(session, job, [slot])
                    except Conflict:
                        continue
                    clusters = {**handle.wanted.clusters, name: missing}
                    layout = None
                    if new is not None and new.plan is not None:
                        layout = self._adopt(session, job, new, clusters)
                    joined = (name, clusters, layout)
                    break
            if joined is None:
                continue
            name, clusters, layout = joined
            handle.want(clusters, layout)
            log.info("job %s: %s joins with %d GPU(s)", handle.job_id, name, missing)
