"""A small compute network on a real database, for fast tests of the control loop (no Ray).

Everything goes through the control plane's own code and its real session factory: clusters
are created and kept alive by agent heartbeats (`ingest_heartbeat`, with an explicit clock so
a lease can lapse without sleeping), links are declared, the reconcile loop places jobs, the
launcher's loop stops and settles runs. Only the Ray part of a launch is left out: `start`
moves a placed job to RUNNING and hands the launcher a `RunHandle`, as `controller.loop.ray_run`
does before its thread starts the actors; `finish` gives that handle what a run's thread gives
it (a `TrainReport` or an exception) and lets the launcher's next pass settle it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

import scheduler
from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat
from controller.jobs import lifecycle
from controller.jobs.request import job_request
from controller.jobs.service import create_quote
from controller.loop.launcher import Launcher, LauncherConfig
from controller.loop.placement import Placed, place_pending
from controller.loop.runs import RunHandle
from controller.money.metering import egress_charge, gpu_charge
from controller.network.leases import LeasePolicy, check_leases
from controller.network.resources import create_cluster, declare_link, ingest_heartbeat
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import (
    QOS_CLASSES,
    Allocation,
    Cluster,
    ClusterGpus,
    GpuPrice,
    Job,
    JobEvent,
    LedgerEntry,
    Tenant,
    Usage,
    utcnow,
)
from grammar.states import JobState
from training import Progress, TrainReport, WanBytes
from wire.plan import HeldPlan
from wire.spec import JobSpec, QoSSpec, Work

REPLICA = "replica-a"
MAX_ATTEMPTS = 3
LEASES = LeasePolicy(heartbeat_interval_s=1.0, grace_s=10.0)
TASK = "builtin:mnist1d-mlp"


@dataclass(frozen=True)
class Books:
    """What the control plane holds and has charged, read in one go."""

    in_use: dict[str, int]
    """GPUs in use per cluster, as the inventory counts them."""
    held: dict[str, int]
    """GPUs per cluster of open allocations."""
    usage_rows: int
    ledger_rows: int
    charged: Decimal


class Net:
    """Clusters, links, tenants and jobs on one database, and this replica's launcher."""

    def __init__(self, url: str, checkpoint_root: Path) -> None:
        self.engine: Engine = make_engine(url)
        self.sessions: sessionmaker[Session] = make_sessionmaker(self.engine)
        self.launcher = Launcher(
            self.sessions,
            LauncherConfig(
                replica_id=REPLICA, checkpoint_root=checkpoint_root, max_attempts=MAX_ATTEMPTS
            ),
        )
        self.clock: datetime = utcnow()
        """The agents' clock: the time of their last heartbeats."""
        self.inventory: dict[str, GpuReport] = {}
        self._submitted: datetime = utcnow() - timedelta(hours=1)

    def close(self) -> None:
        self.engine.dispose()

    # ---- the world -----------------------------------------------------------------------

    def cluster(
        self, name: str, gpus: int = 4, model: str = "A100", price: str = "2.5", region: str = ""
    ) -> None:
        """A cluster priced for every QoS class, READY after its agent's first heartbeat."""
        with self.sessions() as s, s.begin():
            cluster = create_cluster(s, name, region or name, {})
            for qos_class in QOS_CLASSES:
                s.add(
                    GpuPrice(
                        cluster_id=cluster.id,
                        gpu_model=model,
                        qos_class=qos_class,
                        price_per_gpu_hour=Decimal(price),
                        effective_from=utcnow() - timedelta(hours=1),
                    )
                )
        self.inventory[name] = GpuReport(model=model, memory_gib=80, count=gpus, allocatable=gpus)
        self.beat(name)

    def link(self, a: str, b: str, gbps: float = 100.0, rtt_ms: float = 2.0) -> None:
        """A fast declared link both ways."""
        with self.sessions() as s, s.begin():
            for src, dst in ((a, b), (b, a)):
                declare_link(
                    s, src, dst, bandwidth_gbps=gbps, rtt_ms=rtt_ms, loss=0.0,
                    egress_price_per_gb=0.01,
                )  # fmt: skip

    def tenant(self, name: str, gpu_quota: int | None = None, priority_ceiling: int = 0) -> str:
        """A tenant; `priority_ceiling`: the highest priority an admin granted it."""
        with self.sessions() as s, s.begin():
            tenant = Tenant(name=name, gpu_quota=gpu_quota, priority_ceiling=priority_ceiling)
            s.add(tenant)
            s.flush()
            return tenant.id

    def beat(self, *clusters: str, at: datetime | None = None) -> None:
        """Heartbeats of these clusters' agents at `at` (default: the agents' clock)."""
        with self.sessions() as s, s.begin():
            for name in clusters:
                hb = Heartbeat(cluster=name, gpus=[self.inventory[name]])
                ingest_heartbeat(s, hb, LEASES, now=at or self.clock)

    def lose(self, cluster: str) -> list[tuple[str, str, str]]:
        """`cluster`'s agent falls silent past its lease while the others keep beating; the
        lease monitor's check then moves it (and only it) to DOWN."""
        self.clock += timedelta(seconds=LEASES.grace_s + 1)
        self.beat(*(name for name in self.inventory if name != cluster))
        return check_leases(self.sessions, LEASES, now=self.clock)

    def submit(
        self,
        tenant_id: str,
        spec: JobSpec,
        *,
        held: HeldPlan | None = None,
        at: datetime | None = None,
    ) -> str:
        """A PENDING job as `controller.jobs.service.submit` stores it (admission is the API's to
        test); `held`: the quote option it holds. Submissions are one second apart, in the order
        made, unless `at` says when (the time orders the queue within a priority)."""
        if at is None:
            self._submitted += timedelta(seconds=1)
            at = self._submitted
        lo, hi = spec.gpu_range
        with self.sessions() as s, s.begin():
            job = Job(
                tenant_id=tenant_id,
                name=spec.name,
                spec=spec.model_dump(mode="json"),
                priority=spec.qos.priority,
                qos_class=spec.qos.qos_class,
                preemptible=spec.qos.is_preemptible,
                gpus_min=lo,
                gpus_max=hi,
                run_s=scheduler.reference_run_s(job_request(_timeless(spec), tenant_id)),
                quote_id=held.quote_id if held else None,
                held_price=held,
                reason="waiting for the scheduler",
                created_at=at,
            )
            s.add(job)
            s.flush()
            lifecycle.created(s, job, "submitted")
            return job.id

    def quote(self, tenant_id: str, spec: JobSpec) -> dict[str, HeldPlan]:
        """A real quote for `spec`: each option, by objective, as a submission would hold it."""
        with self.sessions() as s, s.begin():
            quote = create_quote(s, spec, tenant_id)
            return {
                str(o.objective): HeldPlan(**dict(o), quote_id=quote.id)
                for o in quote.options.options
            }

    # ---- the loop ------------------------------------------------------------------------

    def place(
        self, owner: str = REPLICA, waits: dict[str, scheduler.Wait] | None = None
    ) -> list[str]:
        """One reconcile pass; the ids of the jobs it placed, in the order it placed them;
        `waits`: the jobs waiting for faster GPUs, kept between passes as the loop keeps them."""
        placed: list[Placed] = place_pending(self.sessions, owner, waits=waits)
        return [p.job_id for p in placed]

    def start(self, job_id: str) -> RunHandle:
        """What `controller.loop.ray_run` does before Ray: SCHEDULED -> RUNNING, a handle for the
        launcher sized from the job's open allocations."""
        with self.sessions() as s, s.begin():
            job = s.get(Job, job_id)
            assert job is not None and job.owner == REPLICA and job.state is JobState.SCHEDULED
            clusters = self._held(s, job_id)
            models = dict(
                s.execute(
                    select(Cluster.name, Allocation.gpu_model)
                    .join(Cluster, Cluster.id == Allocation.cluster_id)
                    .where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
                ).all()
            )
            fence = lifecycle.begin_run(s, job, "launched", clusters)
        handle = RunHandle(
            job_id=job_id,
            clusters=clusters,
            gpu_models=models,
            flops_per_step=1e9,
            predicted_step_s=None,
            fence=fence,
        )
        self.launcher.handles[job_id] = handle
        return handle

    def finish(
        self,
        handle: RunHandle,
        *,
        report: TrainReport | None = None,
        error: BaseException | None = None,
    ) -> Job:
        """The run's thread ends with `report` or `error`; the launcher's next pass settles it."""
        handle.report = report
        handle.error = error
        handle.done.set()
        self.launcher.tick()
        assert handle.job_id not in self.launcher.handles
        return self.job(handle.job_id)

    # ---- reading back --------------------------------------------------------------------

    def job(self, job_id: str) -> Job:
        with self.sessions() as s:
            job = s.get(Job, job_id)
            assert job is not None
            s.expunge(job)
            return job

    def states(self, job_id: str) -> list[JobState]:
        """The states the job went through, from its events."""
        with self.sessions() as s:
            return [
                e
                for e in s.scalars(
                    select(JobEvent.to_state)
                    .where(JobEvent.job_id == job_id, JobEvent.kind == "state")
                    .order_by(JobEvent.id)
                )
                if e is not None
            ]

    def messages(self, job_id: str) -> list[str]:
        with self.sessions() as s:
            return list(
                s.scalars(
                    select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
                )
            )

    def held(self, job_id: str) -> dict[str, int]:
        """GPUs per cluster of the job's open allocations."""
        with self.sessions() as s:
            return self._held(s, job_id)

    @staticmethod
    def _held(s: Session, job_id: str) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, gpus in s.execute(
            select(Cluster.name, Allocation.gpus)
            .join(Cluster, Cluster.id == Allocation.cluster_id)
            .where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
        ):
            out[name] += gpus
        return dict(out)

    def books(self, job_id: str | None = None) -> Books:
        """GPUs in use and held, and what was metered and charged (for one job, or all).

        Checks on the way the invariants every state of the books must keep: in use = held
        by open allocations, never negative, never more than offered; every usage row priced
        by exactly one ledger entry whose amount is its quantity times its unit price."""
        with self.sessions() as s:
            in_use: dict[str, int] = {}
            # an agent may shrink `allocatable` below what is held; `count` never drops below it
            for name, used, count in s.execute(
                select(Cluster.name, ClusterGpus.in_use, ClusterGpus.count).join(
                    Cluster, Cluster.id == ClusterGpus.cluster_id
                )
            ):
                assert 0 <= used <= count, (name, used, count)
                in_use[name] = used
            held: dict[str, int] = defaultdict(int)
            for name, gpus in s.execute(
                select(Cluster.name, Allocation.gpus)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(Allocation.ended_at.is_(None))
            ):
                held[name] += gpus
            assert {k: v for k, v in in_use.items() if v} == dict(held)
            usage_q = select(Usage)
            ledger_q = select(LedgerEntry)
            if job_id is not None:
                usage_q = usage_q.where(Usage.job_id == job_id)
                ledger_q = ledger_q.where(LedgerEntry.job_id == job_id)
            usage = {u.id: u for u in s.scalars(usage_q)}
            ledger = list(s.scalars(ledger_q))
        assert all(u.priced for u in usage.values())
        assert sorted(e.usage_id for e in ledger) == sorted(usage)  # one entry per usage row
        for e in ledger:
            u = usage[e.usage_id]
            charge = gpu_charge if u.kind == "gpu_seconds" else egress_charge
            assert charge(Decimal(u.quantity), Decimal(e.unit_price)) == (e.quantity, e.amount)
        return Books(
            in_use=in_use,
            held=dict(held),
            usage_rows=len(usage),
            ledger_rows=len(ledger),
            charged=sum((Decimal(e.amount) for e in ledger), Decimal(0)),
        )


def _timeless(spec: JobSpec) -> JobSpec:
    """The spec without its deadline: its size as submission stored it (these tests also
    queue jobs whose deadline has passed, which a submission refuses)."""
    return spec.model_copy(update={"qos": spec.qos.model_copy(update={"deadline": None})})


def spec(
    name: str,
    *,
    gpus: int | None = None,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    steps: int = 100,
    qos: dict[str, Any] | None = None,
    heavy: bool = False,
) -> JobSpec:
    """A job spec of the built-in task; `heavy`: steps so costly that the planner takes every
    GPU an elastic job allows."""
    return JobSpec(
        name=name,
        task=TASK,
        gpus=gpus,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        steps=steps,
        compression="none",
        sync="every-step",
        qos=QoSSpec.model_validate(qos or {}),
        work=Work(params=10**8, flops_per_step=1e16) if heavy else None,
    )


# ---- what a run's thread hands the loop ------------------------------------------------------


def progress(
    step: int, clusters: dict[str, int], total_steps: int = 100, exchange_s: float = 0.0
) -> Progress:
    """A report after `step` steps; WAN bytes grow with the steps on every link between the
    run's clusters (1000 bytes a step), exchanged in `exchange_s` so far."""
    names = sorted(clusters)
    wan = WanBytes({(a, b): 1000 * step for a in names for b in names if a != b})
    return Progress(
        step=step,
        total_steps=total_steps,
        loss=1.0 / step,
        accuracy=None,
        wall_s=0.01 * step,
        compute_s=0.005 * step,
        comm_s=0.002 * step,
        wan_bytes=wan,
        wan_bytes_total=sum(wan.values()),
        compression_ratio=1.0,
        compression="none",
        compute_by_cluster=dict.fromkeys(names, 0.005 * step),
        exchange_s=exchange_s,
    )


def report(steps: int, clusters: dict[str, int], *, stopped: bool = False) -> TrainReport:
    """The end of a run after `steps` steps; `stopped`: it was asked to stop early."""
    last = progress(steps, clusters)
    return TrainReport(
        task=TASK,
        clusters=dict(clusters),
        compression="none",
        sync="every-step",
        steps=steps,
        final_loss=last.loss,
        final_accuracy=0.875,
        wall_s=last.wall_s,
        compute_s=last.compute_s,
        comm_s=last.comm_s,
        wan_s=0.0,
        wan_bytes=last.wan_bytes,
        wan_bytes_total=last.wan_bytes_total,
        compression_ratio=1.0,
        wan_emulated=True,
        links=[],
        restarts=0,
        resumed_from_step=None,
        stopped=stopped,
        history=[],
    )


def east_west(url: str, checkpoint_root: Path) -> Net:
    """Clusters east and west (4 A100 each) joined by a fast link both ways; no jobs."""
    n = Net(url, checkpoint_root)
    n.cluster("east", gpus=4)
    n.cluster("west", gpus=4)
    n.link("east", "west")
    return n
