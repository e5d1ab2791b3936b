"""Launching: a placed job becomes a run of Ray actors (through `training.run`) on a thread.

Ray is started (or joined) once per controller, never per job; a local Ray gets one custom
resource per cluster, sized from the inventory, so each worker is pinned to its cluster.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller import lifecycle, scrub
from controller.jobs import spec_of
from controller.jobspec import JobSpec
from controller.models import Allocation, Cluster, Job, Link, utcnow
from controller.resources import effective_links
from controller.runs import RunHandle
from controller.states import ACTIVE
from controller.tasks import builtin_work
from training import LinkSpec, TrainSpec
from training.location import child, is_object_store

log = logging.getLogger("cpn.launcher")


@dataclass
class LauncherConfig:
    replica_id: str
    checkpoint_root: str | Path
    """A directory every worker reaches (a shared mount) or an object-store URI (s3://...)."""
    ray_address: str | None = None
    max_attempts: int = 3
    emulate_wan: bool = True
    ray_num_cpus: int | None = None


class RayConnection:
    """This controller's Ray: an operator's (`ray_address`) or a local one it starts."""

    def __init__(self, factory: sessionmaker[Session], config: LauncherConfig) -> None:
        self.factory = factory
        self.config = config
        self.resources: dict[str, float] = {}

    def ensure(self, needed: dict[str, int], busy: bool) -> bool:
        """Connect to Ray (once); False when a local Ray lacks a cluster and jobs still run."""
        import ray

        from training import cluster_resource

        want = {cluster_resource(c): float(n) for c, n in needed.items()}
        if ray.is_initialized():
            have = ray.cluster_resources()
            if all(have.get(k, 0.0) >= v for k, v in want.items()):
                return True
            if self.config.ray_address or busy:
                return False  # an operator's Ray, or busy: wait for capacity
            ray.shutdown()  # local Ray sized before this cluster existed: size it again
        # Tenant code runs in the workers: they get none of the control plane's secrets.
        object_store = is_object_store(self.config.checkpoint_root)  # workers write there
        runtime_env = {"env_vars": scrub.worker_env_vars(object_store=object_store)}
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=False, runtime_env=runtime_env)
            return True
        with self.factory() as session:
            inventory = {
                c.name: sum(g.allocatable for g in c.gpus) for c in session.scalars(select(Cluster))
            }
        resources = {cluster_resource(n): float(max(g, 1)) for n, g in inventory.items()}
        for k, v in want.items():
            resources[k] = max(resources.get(k, 0.0), v)
        with scrub.scrubbed_environ(object_store):  # the local Ray's processes inherit it
            ray.init(
                num_cpus=self.config.ray_num_cpus or os.cpu_count() or 1,
                resources=resources,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=runtime_env,
            )
        self.resources = resources
        log.info("started a local Ray with %s", resources)
        return True

    def shutdown(self) -> None:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # shutting down: nothing more to do
            log.exception("ray shutdown failed")


def launch(
    factory: sessionmaker[Session],
    config: LauncherConfig,
    ray: RayConnection,
    job_id: str,
    busy: bool,
) -> RunHandle | None:
    """Start the run of a SCHEDULED (or adopted RUNNING) job owned by this replica; None when
    it is not this replica's to start now (the job's `reason` says so when it waits)."""
    with factory() as session, session.begin():
        job = session.get(Job, job_id)
        if job is None or job.owner != config.replica_id or job.state not in ACTIVE:
            return None
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
            return None
        # the job's own part first: what fails here is the job's, before Ray is touched
        spec = spec_of(job)
        train_spec = train_spec_of(session, config, job, spec, clusters)
        if not ray.ensure(clusters, busy):
            job.reason = "waiting for Ray capacity"
            return None
        train_spec.epoch = job.fence + 1  # what lifecycle.begin_run makes it below
        handle = RunHandle(
            job_id=job.id,
            clusters=clusters,
            gpu_models=models,
            flops_per_step=_work(spec),
            predicted_step_s=job.placement.estimate.compute_s if job.placement else None,
            fence=train_spec.epoch,
        )
        message = (
            f"launched {sum(clusters.values())} workers on "
            + ", ".join(f"{c}:{n}" for c, n in clusters.items())
            + f" ({train_spec.compression}, {train_spec.sync}"
            + (", WAN emulated" if train_spec.emulated else "")
            + (", resuming from checkpoint" if train_spec.resume else "")
            + ")"
        )
        lifecycle.begin_run(session, job, message, clusters)
    thread = threading.Thread(
        target=_run, args=(handle, train_spec), name=f"cpn-job-{job_id[:8]}", daemon=True
    )
    thread.start()
    log.info("job %s: %s", job_id, message)
    return handle


def _work(spec: JobSpec) -> float:
    if spec.work is not None and spec.work.flops_per_step is not None:
        return spec.work.flops_per_step
    if spec.task.startswith("builtin:"):
        return builtin_work(spec.task).flops_per_step
    return 0.0


def train_spec_of(
    session: Session, config: LauncherConfig, job: Job, spec: JobSpec, clusters: dict[str, int]
) -> TrainSpec:
    """What the workers are asked to do: the spec's task and arguments, the plan's compression
    and sync (unless the spec fixed them), the links to emulate, where to checkpoint."""
    from training.checkpoint import open_store

    plan = job.placement
    compression = spec.compression
    if compression == "auto":
        compression = plan.compression if plan else "none"
    sync = spec.sync
    if sync == "auto":
        sync = plan.sync if plan else "every-step"
    checkpoint = child(config.checkpoint_root, job.id)
    store = open_store(checkpoint)
    store.prepare()
    resume = bool(store.steps())
    links: list[LinkSpec] = []
    if config.emulate_wan and not config.ray_address and len(clusters) > 1:
        ids = dict(session.execute(select(Cluster.name, Cluster.id)).all())
        wanted = {ids[c] for c in clusters}
        rows = (
            session.scalars(
                select(Link).where(Link.src_cluster_id.in_(wanted), Link.dst_cluster_id.in_(wanted))
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
    every = spec.args.checkpoint_every
    return TrainSpec(
        task=spec.task,
        clusters=dict(clusters),
        compression=compression,
        sync=sync,
        steps=spec.steps,
        links=links,
        checkpoint=checkpoint,
        checkpoint_every=max(1, spec.steps // 10) if every is None else every,
        resume=resume,
        run_id=job.id,  # a resume reads only this job's checkpoints
        epoch=job.fence,  # the run's fencing epoch; `launch` sets the one it takes
        max_restarts=2,
        data=spec.data.residency,
        **spec.args.runtime(),  # typed and bounded by the spec (controller.jobspec.TrainArgs)
    )


def _run(handle: RunHandle, train_spec: TrainSpec) -> None:
    try:
        from training import run

        handle.report = run(
            train_spec, on_progress=handle.on_progress, should_stop=handle.should_stop
        )
    except BaseException as exc:  # reported to the loop, which settles it
        handle.error = exc
    finally:
        handle.ended_at = utcnow()
        handle.done.set()
