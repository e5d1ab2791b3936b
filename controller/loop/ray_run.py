"""Launching: a placed job becomes a run of Ray actors (through `training.run`, or
`training.pipeline.run_pipeline` for a pipeline or hybrid plan) on a thread.

Ray is started (or joined) once per controller, never per job; a local Ray gets one custom
resource per cluster, sized from the inventory, so each worker is pinned to its cluster.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller.access import scrub
from controller.jobs import lifecycle
from controller.jobs.request import spec_of
from controller.loop.runs import RunHandle, RunLayout
from controller.store.models import Allocation, Cluster, Job, utcnow
from controller.values.plan import micro_batches_of
from controller.values.tasks import builtin_work
from grammar.auto import adaptable
from grammar.states import ACTIVE
from training import LinkSpec, TrainSpec
from training.faults import ring_ordered
from training.location import child, is_object_store
from wire.spec import JobSpec

if TYPE_CHECKING:
    from training.pipeline.spec import PipelineSpec
    from wire.plan import JobPlan

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


def _driver_ray() -> Any:
    """`ray`, imported so that this driver keeps its own SIGTERM handling.

    Ray's C++ failure-signal handler, installed in a driver whose `ray.init` runs off the main
    thread (here: the control loop's), takes SIGTERM before uvicorn's graceful shutdown and
    aborts the process, leaving the local Ray's processes behind for the next driver on the
    machine to find. Ray reads the switch once, when it is first imported; the variable is
    gone again before `ray.init` starts the local Ray, so its workers keep the handler."""
    import sys

    if "ray" in sys.modules:
        return sys.modules["ray"]
    key = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
    given = key in os.environ
    os.environ.setdefault(key, "1")
    try:
        import ray
    finally:
        if not given:
            os.environ.pop(key, None)
    return ray


class RayConnection:
    """This controller's Ray: an operator's (`ray_address`) or a local one it starts."""

    def __init__(self, factory: sessionmaker[Session], config: LauncherConfig) -> None:
        self.factory = factory
        self.config = config
        self.resources: dict[str, float] = {}

    def ensure(self, needed: dict[str, int], busy: bool) -> bool:
        """Connect to Ray (once); False when a local Ray lacks a cluster and jobs still run."""
        ray = _driver_ray()

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
        train_spec = train_spec_of(config, job, spec, clusters)
        pipeline = pipeline_spec_of(job, spec, train_spec)
        if pipeline is not None:
            train_spec = pipeline.train
        if not ray.ensure(clusters, busy):
            job.reason = "waiting for Ray capacity"
            return None
        train_spec.epoch = job.fence + 1  # what lifecycle.begin_run makes it below
        handle = RunHandle(
            job_id=job.id,
            clusters=clusters,
            gpu_models=models,
            # a stage does a share of the step's work: no per-GPU calibration from it (yet)
            flops_per_step=_work(spec) if pipeline is None else 0.0,
            predicted_step_s=job.placement.estimate.compute_s if job.placement else None,
            fence=train_spec.epoch,
            reserved_kbps=dict(train_spec.wan_kbps),
            batch_shares=dict(train_spec.batch_shares),
            live=pipeline is None and _live(train_spec),
            running=dict(clusters),
        )
        handle.want(dict(train_spec.clusters))  # in the ring order the run starts in
        message = (
            f"launched {sum(clusters.values())} "
            + ("workers" if pipeline is None else f"stage workers ({_stages_text(pipeline)})")
            + " on "
            + ", ".join(f"{c}:{n}" for c, n in clusters.items())
            + f" ({train_spec.compression}, {train_spec.sync}"
            + (", WAN emulated" if train_spec.emulated else "")
            + (", resuming from checkpoint" if train_spec.resume and pipeline is None else "")
            + ")"
        )
        lifecycle.begin_run(session, job, message, clusters)
    thread = threading.Thread(
        target=_run,
        args=(handle, train_spec if pipeline is None else pipeline),
        name=f"cpn-job-{job_id[:8]}",
        daemon=True,
    )
    thread.start()
    log.info("job %s: %s", job_id, message)
    return handle


def _live(spec: TrainSpec) -> bool:
    """Whether the run shrinks and grows in place (its sync mode can: `training.faults`)."""
    from training.sync import regroups  # torch loads with it: only once a run launches

    return spec.fault_domains and len(spec.clusters) > 1 and regroups(spec.sync)


def _work(spec: JobSpec) -> float:
    if spec.work is not None and spec.work.flops_per_step is not None:
        return spec.work.flops_per_step
    if spec.task.startswith("builtin:"):
        return builtin_work(spec.task).flops_per_step
    return 0.0


def train_spec_of(
    config: LauncherConfig, job: Job, spec: JobSpec, clusters: dict[str, int]
) -> TrainSpec:
    """What the workers are asked to do: the spec's task and arguments, and from the plan its
    compression and sync (unless the spec fixed them; what it left to auto the runtime may
    re-decide on a moved link, `TrainSpec.adapt`), the links it was planned over (to
    emulate or pace) and the WAN rate it reserved (to pace), each cluster's region (so
    `async-ps` runs a server per region when the placement spans regions); where to
    checkpoint."""
    from training.checkpoint import open_store

    plan = job.placement
    compression = spec.compression
    if compression == "auto":
        compression = plan.compression if plan else "none"
    sync = spec.sync
    if sync == "auto":
        sync = plan.sync if plan else "every-step"
    # what the spec left to auto, the runtime may re-decide when the link moves (from the
    # plan's pair, by the same policy; each change becomes a job event)
    local = spec.data.residency == "local"
    adapt = (
        adaptable(spec.compression, spec.sync, compression, sync, local_data=local)
        if len(clusters) > 1
        else ()
    )
    checkpoint = child(config.checkpoint_root, job.id)
    store = open_store(checkpoint)
    store.prepare()
    resume = bool(store.steps())
    layout = run_layout(config, plan, clusters)
    regions = {s.cluster: s.region for s in (plan.clusters if plan else ()) if s.region is not None}
    every = spec.args.checkpoint_every
    return TrainSpec(
        task=spec.task,
        clusters=layout.clusters,
        batch_shares=layout.batch_shares,
        compression=compression,
        sync=sync,
        steps=spec.steps,
        links=list(layout.links),
        wan_kbps=layout.wan_kbps,
        checkpoint=checkpoint,
        checkpoint_every=max(1, spec.steps // 10) if every is None else every,
        resume=resume,
        run_id=job.id,  # a resume reads only this job's checkpoints
        epoch=job.fence,  # the run's fencing epoch; `launch` sets the one it takes
        max_restarts=2,
        data=spec.data.residency,
        regions=regions,
        relay_ticks=dict(plan.estimate.relay_ticks) if plan else {},
        tree=_tree(plan, layout.clusters),
        adapt=adapt,
        **spec.args.runtime(),  # typed and bounded by the spec (wire.spec.TrainArgs)
    )


def _tree(plan: JobPlan | None, clusters: dict[str, int]) -> dict[str, str]:
    """The plan's all-reduce tree when it spans exactly the clusters the run starts on (else
    the ring: a tree for other clusters is not the one that was priced)."""
    tree = dict(plan.estimate.tree) if plan is not None else {}
    return tree if tree and set(tree) | set(tree.values()) == set(clusters) else {}


def run_layout(config: LauncherConfig, plan: JobPlan | None, clusters: dict[str, int]) -> RunLayout:
    """The plan's layout of a run on `clusters`, at launch and when a cluster leaves or joins
    (`training.faults.Membership`)."""
    links: list[LinkSpec] = []
    reserved: dict[str, int] = {}
    if plan is not None and len(clusters) > 1:
        # A cluster whose sends cross a paced link keeps, on average, to the WAN rate the plan
        # reserved there (its bursts to the link's planned share, below).
        ends = {end for k in plan.links if k.paced for end in (k.src, k.dst)}
        reserved = {c: r for c, r in plan.wan_kbps.items() if c in clusters and c in ends}
        # Emulated links all run at what was planned; real ones only where the plan took a
        # share of a declared uplink or downlink (`paced`), so the run takes no more of it:
        # the exchange waits out the difference between its transfer and the planned one.
        emulated = config.emulate_wan and not config.ray_address
        links = [
            LinkSpec(k.src, k.dst, k.bandwidth_gbps * 1000, k.rtt_ms)
            for k in plan.links
            if k.src in clusters and k.dst in clusters and (emulated or k.paced)
        ]
    return RunLayout(
        clusters=ring_ordered(clusters, plan.estimate.ring if plan else ()),
        links=tuple(links),
        wan_kbps=reserved,
        batch_shares=batch_shares(plan, clusters),
    )


def batch_shares(plan: JobPlan | None, clusters: dict[str, int]) -> dict[str, float]:
    """The plan's split of the global batch over the clusters that run (its estimate's
    `batch_shares`, in the clusters' own names); {} (equal per worker) without one."""
    if plan is None:
        return {}
    shares = {c: v for c, v in plan.estimate.batch_shares.items() if c in clusters and v > 0}
    return shares if len(shares) == len(clusters) else {}


def pipeline_spec_of(job: Job, spec: JobSpec, train_spec: TrainSpec) -> PipelineSpec | None:
    """The pipeline run of a job whose plan (`JobPlan.parallel`) says pipeline, hybrid or
    tensor (one stage whose layers split); None for data parallelism. The stages are the
    plan's; the spec's fixed cut points apply when they make that many stages.
    `compression` compresses the activations (auto: none); the stages' replicas synchronise
    every step. Every stage checkpoints under the job's
    root (`training.pipeline.checkpoint`), and a relaunch (retry, lost cluster, preemption)
    resumes from the newest step all stages saved, wherever the stages are placed now."""
    from grammar.parallel import parse_stages
    from training.pipeline.schedule import Schedule
    from training.pipeline.spec import PipelineSpec
    from training.pipeline.split import Placement

    parallel = job.placement.parallel if job.placement is not None else None
    if parallel is None or parallel.mode == "data" or not parallel.stages:
        return None
    first = parallel.stages[0]
    placement = Placement(
        tuple(s.cluster for s in parallel.stages),
        first.replicas,
        parallel.tensor,
        tuple(tuple(s.replica_clusters[r] for s in parallel.stages) for r in range(first.replicas))
        if first.replica_clusters
        else (),
    )
    split = parse_stages(spec.pipeline.stages) if spec.pipeline.stages is not None else None
    cuts = split.cuts if split is not None and split.count == placement.stages else None
    activations = "none" if spec.compression == "auto" else spec.compression
    train = replace(
        train_spec,
        compression=activations,
        sync="every-step",
        resume=True,  # from the stages' consistent cut when there is one, else from step 0
    )
    return PipelineSpec(
        train,
        placement,
        micro_batches=micro_batches_of(parallel, spec),
        schedule=Schedule(spec.pipeline.schedule),
        cuts=cuts,
        activations=activations,
    )


def _stages_text(spec: PipelineSpec) -> str:
    from training.pipeline.driver import parallel_name

    p = spec.placement
    split = f", layers split over {p.tensor} GPUs" if p.tensor > 1 else ""
    return (
        f"{parallel_name(p)}: {p.stages} stages{split}, {spec.micro_batches} micro-batches, "
        f"{spec.schedule}"
    )


def _run(handle: RunHandle, spec: TrainSpec | PipelineSpec) -> None:
    try:
        from training import run

        handle.report = run(
            spec,
            on_progress=handle.on_progress,
            should_stop=handle.should_stop,
            membership=handle.membership if handle.live else None,
        )
    except BaseException as exc:  # reported to the loop, which settles it
        handle.error = exc
    finally:
        handle.ended_at = utcnow()
        handle.done.set()
