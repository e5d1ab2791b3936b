"""A held quote is a promise: the tenant never pays more than its total. A run that costs
more (here: a price raised after the quote, and a run far longer than estimated) gets one
platform credit line, so its ledger total is the held total and the ledger still equals
usage times prices, row for row (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select, update

from controller.money.amounts import q6
from controller.money.metering import charge_of
from controller.store.models import Allocation, Cluster, GpuPrice, Job, LedgerEntry, Usage, utcnow
from grammar.states import JobState
from tests.controller.world import Net, report
from wire.spec import JobSpec

SPEC = {"name": "held", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 50}


def _books(net: Net, job_id: str) -> tuple[list[LedgerEntry], list[Usage]]:
    with net.sessions() as s:
        entries = list(s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)))
        usage = list(s.scalars(select(Usage).where(Usage.job_id == job_id)))
        ids = dict(s.execute(select(Cluster.name, Cluster.id)).all())
        by_usage = {e.usage_id: e for e in entries}
        for row in usage:  # every usage row priced once, at what charge_of says
            assert by_usage[row.id].amount == charge_of(s, row, ids).amount
        return entries, usage


def test_an_overrun_of_a_held_quote_is_credited_by_the_platform(
    db_url: str, tmp_path: Path
) -> None:
    net = Net(db_url, tmp_path)
    try:
        net.cluster("a", gpus=2, price="2.5")
        tenant = net.tenant("acme")
        spec = JobSpec.model_validate(SPEC)
        held = net.quote(tenant, spec)["time"]
        assert held.price is not None
        promised = q6(Decimal(str(held.price.total)))
        job_id = net.submit(tenant, spec, held=held)
        assert net.place() == [job_id]
        run = net.start(job_id)
        with net.sessions() as s, s.begin():
            # the run took an hour (not the estimate's minute) at ten times the quoted price
            cluster = s.scalars(select(Cluster).where(Cluster.name == "a")).one()
            s.add(
                GpuPrice(
                    cluster_id=cluster.id,
                    gpu_model="A100",
                    qos_class="standard",
                    price_per_gpu_hour=Decimal("25"),
                    effective_from=utcnow() - timedelta(hours=2),
                )
            )
            s.execute(
                update(Allocation)
                .where(Allocation.job_id == job_id)
                .values(billed_from=utcnow() - timedelta(hours=1))
            )
        done = net.finish(run, report=report(50, {"a": 2}))
        assert done.state is JobState.SUCCEEDED
        entries, usage = _books(net, job_id)
        total = sum((e.amount for e in entries), Decimal(0))
        credits = [e for e in entries if e.kind == "credit"]
        assert total == promised  # never more than the held total, to the last decimal
        assert len(credits) == 1 and credits[0].amount < 0
        assert "held quote" in credits[0].description
        assert sum(e.amount for e in entries if e.kind != "credit") > promised
        assert any(u.kind == "held_credit" for u in usage)
    finally:
        net.close()


def test_a_run_within_its_held_quote_gets_no_credit(db_url: str, tmp_path: Path) -> None:
    net = Net(db_url, tmp_path)
    try:
        net.cluster("a", gpus=2, price="2.5")
        tenant = net.tenant("acme")
        spec = JobSpec.model_validate(SPEC)
        held = net.quote(tenant, spec)["time"]
        job_id = net.submit(tenant, spec, held=held)
        assert net.place() == [job_id]
        done = net.finish(net.start(job_id), report=report(50, {"a": 2}))
        assert done.state is JobState.SUCCEEDED
        entries, _ = _books(net, job_id)
        assert entries and not [e for e in entries if e.kind == "credit"]
        with net.sessions() as s:
            job = s.get(Job, job_id)
            assert job is not None and job.held_price is not None
    finally:
        net.close()


def test_a_held_quote_runs_the_decisions_it_quoted(db_url: str, tmp_path: Path) -> None:
    """The WAN got far slower between quote and placement: the planner would now choose
    another compression or sync for that placement, but the held plan is what runs."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("a", gpus=1)
        net.cluster("b", gpus=1)
        net.link("a", "b", gbps=100.0, rtt_ms=1.0)
        tenant = net.tenant("acme")
        spec = JobSpec.model_validate({**SPEC, "steps": 100_000})
        held = net.quote(tenant, spec)["time"]
        net.link("a", "b", gbps=0.001, rtt_ms=300.0)
        fresh = net.quote(tenant, spec)["time"]
        assert (fresh.compression, fresh.sync) != (held.compression, held.sync)
        job_id = net.submit(tenant, spec, held=held)
        assert net.place() == [job_id]
        plan = net.job(job_id).placement
        assert plan is not None
        assert (plan.compression, plan.sync) == (held.compression, held.sync)
        assert [s.cluster for s in plan.clusters] == [s.cluster for s in held.clusters]
    finally:
        net.close()


def test_a_budget_of_zero_places_nothing_and_tiny_estimates_count(
    db_url: str, tmp_path: Path
) -> None:
    """Issue 48: an estimate never rounds a positive cost to 0 at the budget check, and a
    budget of 0 places nothing (9 of 12 near-free jobs of a budget-0 tenant were placed)."""
    from controller.store.models import Tenant

    net = Net(db_url, tmp_path)
    try:
        net.cluster("a", gpus=4, price="0.000001")  # a run's estimate: far below a micro-dollar
        broke = net.tenant("broke")
        rich = net.tenant("rich")
        with net.sessions() as s, s.begin():
            s.execute(update(Tenant).where(Tenant.id == broke).values(budget=Decimal(0)))
        spec = JobSpec.model_validate({**SPEC, "gpus": 1, "steps": 10})
        zero = [net.submit(broke, spec) for _ in range(3)]
        other = net.submit(rich, spec)
        placed = net.place()
        assert not set(placed) & set(zero) and other in placed
        assert "budget is 0.00" in net.job(zero[0]).reason
    finally:
        net.close()


def test_a_positive_estimate_never_counts_as_nothing() -> None:
    from controller.money.budget import Commitment, priced_up, refusal

    assert priced_up(8e-9) == Decimal("0.000001") and priced_up(0.0) == 0
    none = Commitment(charged=Decimal(0), held=Decimal(0))
    one = Commitment(charged=Decimal(0), held=Decimal("0.000001"))
    assert refusal(Decimal("0.000001"), none, priced_up(8e-9)) is None
    assert refusal(Decimal("0.000001"), one, priced_up(8e-9)) is not None  # no second one
    assert refusal(Decimal(0), none, Decimal(0)) is not None  # budget 0: nothing
