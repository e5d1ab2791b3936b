"""The GPU invariant, under random sequences of everything that touches GPUs.

For every (cluster, GPU model): `in_use` = the GPUs of its open allocations, never negative,
never above `count`, and a reservation never takes more than was free (allocatable - in_use)
when it was made. Hypothesis drives random sequences of agent heartbeats (models appearing,
vanishing, shrinking, coming back), submissions, placement passes, cancels, preemptions,
finished and failed runs, clusters going DOWN and READY again, and controller replica restarts
(a new engine and session factory over the same database, adopting the old one's jobs)
through the control plane's own code on SQLite and PostgreSQL, and checks the books after
every step. Only Ray is left out: a placed job is started as `controller.loop.ray_run` does before
its actors run, and a run ends when the test says so.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat
from controller.jobs import lifecycle
from controller.jobs import service as jobs
from controller.loop.controller import Controller
from controller.loop.runs import RunHandle
from controller.network.leases import LeasePolicy, check_leases
from controller.network.resources import create_cluster, declare_link, ingest_heartbeat
from controller.store.db import is_sqlite, make_engine, make_sessionmaker
from controller.store.models import (
    QOS_CLASSES,
    Allocation,
    Cluster,
    ClusterGpus,
    GpuPrice,
    Job,
    Replica,
    Tenant,
    utcnow,
)
from controller.values.errors import CpnError
from grammar.states import ACTIVE, QUEUED, JobState
from tests.conftest import clear_tables
from tests.controller.world import report
from wire.spec import JobSpec

CLUSTERS = ("east", "west")
MODELS = ("A100", "H100")
LEASES = LeasePolicy(heartbeat_interval_s=1.0, grace_s=10.0)
TASK = "builtin:mnist1d-mlp"
OPEN_JOBS = 6
"""Jobs waiting or running at once: enough to contend for GPUs, few enough to keep passes fast."""

Key = tuple[str, str]  # (cluster name, GPU model)

KEEP, VANISH = "keep", "vanish"
changes = st.fixed_dictionaries(
    {
        model: st.one_of(
            st.just(KEEP),
            st.just(VANISH),
            st.tuples(st.integers(0, 8), st.integers(0, 8)),  # (count, allocatable)
        )
        for model in MODELS
    }
)
"""What the next heartbeat says of each model: as before, gone, or these numbers (a model
appearing, shrinking, growing or coming back)."""


def _report(inventory: dict[str, tuple[int, int]]) -> list[GpuReport]:
    return [
        GpuReport(model=m, memory_gib=80, count=count, allocatable=allocatable)
        for m, (count, allocatable) in sorted(inventory.items())
    ]


class GpuBooks(RuleBasedStateMachine):
    """One compute network on a real database; its books are checked after every step."""

    url: str
    """The database (a subclass per test sets it)."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoints = Path(tempfile.mkdtemp(prefix="cpn-gpu-invariant-"))
        self.clock: datetime = utcnow()
        """The agents' clock: their heartbeats are stamped with it, the lease check reads it."""
        self.reported: dict[str, dict[str, tuple[int, int]]] = {}
        self.jobs: list[str] = []
        self.free_before: dict[Key, int] = {}
        self.last_allocation = 0
        self.replicas = 0
        self.sessions: sessionmaker[Session]
        self.controller: Controller
        clear_tables(self.url)
        self._boot()

    # ---- set-up and replicas ----------------------------------------------------------------

    def _boot(self) -> None:
        """A controller replica: its own engine and session factory, its own launcher."""
        self.replicas += 1
        self.engine = make_engine(self.url)
        self.sessions = make_sessionmaker(self.engine)
        self.controller = Controller(
            self.sessions,
            sqlite=is_sqlite(self.url),
            replica_ttl_s=15.0,
            checkpoint_root=self.checkpoints,
            max_attempts=2,
            launch=False,
        )

    @initialize()
    def network(self) -> None:
        """Two clusters with both GPU models priced for every class, linked; one tenant."""
        with self.sessions() as s, s.begin():
            for name in CLUSTERS:
                cluster = create_cluster(s, name, name, {})
                for model in MODELS:
                    for qos_class in QOS_CLASSES:
                        s.add(
                            GpuPrice(
                                cluster_id=cluster.id,
                                gpu_model=model,
                                qos_class=qos_class,
                                price_per_gpu_hour=Decimal("2.5"),
                                effective_from=utcnow() - timedelta(hours=1),
                            )
                        )
            s.flush()
            for src, dst in (CLUSTERS, CLUSTERS[::-1]):
                declare_link(
                    s, src, dst, bandwidth_gbps=100, rtt_ms=2, loss=0, egress_price_per_gb=0.01
                )
            # priority is granted by an admin: grant what the submissions ask for
            tenant = Tenant(name="acme", priority_ceiling=10, qos_classes=["standard", "spot"])
            s.add(tenant)
            s.flush()
            self.tenant_id = tenant.id
        for name in CLUSTERS:
            self.reported[name] = {"A100": (8, 8)}
            self._beat(name)

    def teardown(self) -> None:
        self.engine.dispose()

    def _beat(self, name: str) -> None:
        hb = Heartbeat(cluster=name, gpus=_report(self.reported[name]))
        with self.sessions() as s, s.begin():
            ingest_heartbeat(s, hb, LEASES, now=self.clock)

    # ---- what agents do -------------------------------------------------------------------------

    @rule(name=st.sampled_from(CLUSTERS), change=changes)
    def heartbeat(self, name: str, change: dict[str, str | tuple[int, int]]) -> None:
        """The agent reports a new inventory: models appear, vanish, shrink, grow, come back."""
        inventory = dict(self.reported[name])
        for model, what in change.items():
            if what == VANISH:
                inventory.pop(model, None)
            elif isinstance(what, tuple):
                inventory[model] = what
        self.reported[name] = inventory
        self._beat(name)
        with self.sessions() as s:
            rows = {
                g.model: g
                for g in s.scalars(select(ClusterGpus).join(Cluster).where(Cluster.name == name))
            }
        for model in MODELS:
            row = rows.get(model)
            if model in inventory:
                count, allocatable = inventory[model]
                assert row is not None and not row.missing
                assert row.allocatable == min(count, allocatable)
                assert row.count == max(count, row.in_use)
            else:  # kept only while GPUs of it are held
                assert row is None or (row.missing and row.allocatable == 0 and row.in_use > 0)

    @rule(name=st.sampled_from(CLUSTERS))
    def agent_falls_silent(self, name: str) -> None:
        """Its lease lapses while the other agents keep beating: the cluster goes DOWN."""
        self.clock += timedelta(seconds=LEASES.grace_s + 1)
        for other in CLUSTERS:
            if other != name:
                self._beat(other)
        check_leases(self.sessions, LEASES, now=self.clock)

    # ---- what tenants do -----------------------------------------------------------------------

    @rule(
        gpus=st.integers(1, 10),
        qos_class=st.sampled_from(("standard", "spot")),
        priority=st.integers(0, 2),
        then_place=st.booleans(),
    )
    def submit(self, gpus: int, qos_class: str, priority: int, then_place: bool) -> None:
        """A tenant submits a job (the API's `submit`), and a placement pass may follow."""
        with self.sessions() as s:
            waiting_or_running = s.scalar(
                select(func.count()).select_from(Job).where(Job.state.in_((*QUEUED, *ACTIVE)))
            )
        if waiting_or_running and waiting_or_running >= OPEN_JOBS:
            return
        spec = JobSpec.model_validate(
            {
                "name": f"job-{len(self.jobs)}",
                "task": TASK,
                "gpus": gpus,
                "steps": 100,
                "qos": {"qos_class": qos_class, "priority": priority},
            }
        )
        try:
            with self.sessions() as s, s.begin():
                item = jobs.Submission(spec, self.tenant_id)
                self.jobs.append(jobs.submit(s, item).job.id)
        except CpnError:
            pass  # refused at the door (e.g. more GPUs than are offered): nothing to account
        if then_place:
            self.place()

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if not self.jobs:
            return
        job_id = data.draw(st.sampled_from(self.jobs))
        try:
            with self.sessions() as s, s.begin():
                job = s.get(Job, job_id)
                assert job is not None
                jobs.cancel(s, job, "cancelled by tenant")
        except CpnError:
            pass  # it had ended already

    # ---- what the controller does -------------------------------------------------------------

    @rule()
    def place(self) -> None:
        """A pass of the loop (replica heartbeat, adoption, placement), then the launcher starts
        what this replica owns and does not run yet, as `controller.loop.ray_run` does before
        Ray."""
        self.controller.tick()
        launcher = self.controller.launcher
        with self.sessions() as s, s.begin():
            mine = s.scalars(
                select(Job).where(Job.owner == self.controller.id, Job.state.in_(ACTIVE))
            ).all()
            for job in mine:
                if job.id in launcher.handles:
                    continue
                held: dict[str, int] = defaultdict(int)
                models: dict[str, str] = {}
                for name, model, n in s.execute(
                    select(Cluster.name, Allocation.gpu_model, Allocation.gpus)
                    .join(Cluster, Cluster.id == Allocation.cluster_id)
                    .where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
                ):
                    held[name] += n
                    models[name] = model
                if job.state is JobState.SCHEDULED:
                    lifecycle.transition(s, job, JobState.RUNNING, "launched")
                launcher.handles[job.id] = RunHandle(
                    job_id=job.id,
                    clusters=dict(held),
                    gpu_models=models,
                    flops_per_step=1e9,
                    predicted_step_s=None,
                )

    @rule()
    def runs_stop_when_asked(self) -> None:
        """The launcher asks runs to stop (cancelled, preempted, a cluster DOWN, adopted), the
        runs checkpoint and stop, and its next pass settles them."""
        launcher = self.controller.launcher
        launcher.tick()
        for handle in launcher.handles.values():
            if handle.stop is not None:
                handle.done.set()
        launcher.tick()

    @rule(data=st.data(), ok=st.booleans())
    def run_ends(self, data: st.DataObject, ok: bool) -> None:
        """A run finishes all its steps, or fails (retried, then FAILED)."""
        launcher = self.controller.launcher
        if not launcher.handles:
            return
        handle = launcher.handles[data.draw(st.sampled_from(sorted(launcher.handles)))]
        if ok:
            handle.report = report(100, handle.clusters)
        else:
            handle.error = RuntimeError("worker lost")
        handle.done.set()
        launcher.tick()

    @rule()
    def replica_restarts(self) -> None:
        """The controller dies without a word (its runs with it) and a new one starts over the
        same database; the old one's jobs are adopted once its replica row is stale."""
        old = self.controller.id
        self.engine.dispose()
        self._boot()
        with self.sessions() as s, s.begin():
            s.execute(
                update(Replica)
                .where(Replica.id == old)
                .values(seen_at=utcnow() - timedelta(hours=1))
            )

    # ---- the books --------------------------------------------------------------------------

    @invariant()
    def gpus_in_use_are_the_open_allocations(self) -> None:
        with self.sessions() as s:
            rows = {
                (name, g.model): g
                for g, name in s.execute(
                    select(ClusterGpus, Cluster.name).join(
                        Cluster, Cluster.id == ClusterGpus.cluster_id
                    )
                )
            }
            held: dict[Key, int] = {
                (name, model): int(n)
                for name, model, n in s.execute(
                    select(Cluster.name, Allocation.gpu_model, func.sum(Allocation.gpus))
                    .join(Cluster, Cluster.id == Allocation.cluster_id)
                    .where(Allocation.ended_at.is_(None))
                    .group_by(Cluster.name, Allocation.gpu_model)
                )
            }
            new: dict[Key, int] = defaultdict(int)
            newest = self.last_allocation
            for alloc_id, name, model, n in s.execute(
                select(Allocation.id, Cluster.name, Allocation.gpu_model, Allocation.gpus)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(Allocation.id > self.last_allocation)
            ):
                new[(name, model)] += n
                newest = max(newest, alloc_id)
            holders = set(
                s.scalars(
                    select(Job.state)
                    .join(Allocation, Allocation.job_id == Job.id)
                    .where(Allocation.ended_at.is_(None))
                )
            )
        for key, row in rows.items():
            assert row.in_use == held.get(key, 0), (key, row.in_use, held.get(key, 0))
            assert 0 <= row.in_use <= row.count, (key, row.in_use, row.count)
            assert 0 <= row.allocatable <= row.count, (key, row.allocatable, row.count)
            if row.missing:
                assert row.allocatable == 0 and row.in_use > 0, (key, row.in_use)
        assert set(held) <= set(rows), f"GPUs held without an inventory row: {held}"
        for key, n in new.items():  # this step's reservations, against what was free before it
            assert n <= self.free_before.get(key, 0), (key, n, self.free_before.get(key, 0))
        assert holders <= set(ACTIVE), f"jobs in {holders} still hold GPUs"
        self.free_before = {k: r.allocatable - r.in_use for k, r in rows.items()}
        self.last_allocation = newest


def test_gpu_books_balance_after_every_step(migrated_url: str) -> None:
    class OnThisDatabase(GpuBooks):
        url = migrated_url

    run_state_machine_as_test(
        OnThisDatabase,
        settings=settings(
            max_examples=20,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
