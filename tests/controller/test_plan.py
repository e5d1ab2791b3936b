"""The typed plan: rows stored before it existed still read (as revision 0016 left them), on
SQLite and PostgreSQL."""

from __future__ import annotations

from importlib import import_module
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import scheduler
from controller.store.db import make_engine
from controller.store.models import Job, JobEvent, Quote, Tenant, utcnow
from grammar.states import JobState
from wire.plan import HeldPlan, JobPlan, QuoteOptions, Share

# What the reconcile loop stored on a job before the plan was typed (no objective, no price).
OLD_JOB_PLAN: dict[str, Any] = {
    "clusters": [
        {"cluster": "us-east", "gpu_model": "A100", "gpus": 4},
        {"cluster": "eu-west", "gpu_model": "H100", "gpus": 4},
    ],
    "compression": "topk:0.01",
    "sync": "every-step",
    "estimate": {
        "step_time_s": 0.25,
        "total_time_s": 500.0,
        "wan_bytes": 123456789,
        "cost": 12.5,
        "compute_s": 0.2,
        "intra_s": 0.01,
        "wan_s": 0.03,
        "overhead_s": 0.01,
        "effective_steps": 2000.0,
        "ring": ["eu-west", "us-east"],
        "step_overhead_s": 0.0,
    },
    "explanation": ["fastest of 3 placements"],
}

REVISION_0016 = import_module("migrations.versions.0016_rewrite_untyped_rows")

# A quote option as quotes stored it: its shares under `placement`, a short estimate.
STORED_QUOTE_OPTION: dict[str, Any] = {
    "objective": "cost",
    "placement": [{"cluster": "ap-south", "gpus": 8}],
    "compression": "none",
    "sync": "every-step",
    "estimate": {
        "step_time_s": 0.5,
        "total_time_s": 1000.0,
        "wan_bytes": 0,
        "wan_gb": 0.0,
    },
    "price": {
        "total": 1.777778,
        "gpu": [
            {
                "cluster": "ap-south",
                "gpus": 8,
                "gpu_hours": 2.222222,
                "price_per_gpu_hour": 0.8,
                "amount": 1.777778,
            }
        ],
        "egress": [],
        "currency": "USD",
    },
    "explanation": ["cheapest"],
}
OLD_QUOTE_OPTION: dict[str, Any] = REVISION_0016._clusters(STORED_QUOTE_OPTION)
"""The same option as every database holds it since revision 0016 (shares under `clusters`)."""


def test_revision_0016_renames_a_quote_options_shares_and_nothing_else() -> None:
    assert {
        **{k: v for k, v in STORED_QUOTE_OPTION.items() if k != "placement"},
        "clusters": STORED_QUOTE_OPTION["placement"],
    } == OLD_QUOTE_OPTION
    assert REVISION_0016._clusters(OLD_QUOTE_OPTION) is OLD_QUOTE_OPTION  # written once
    assert REVISION_0016._clusters(OLD_JOB_PLAN) is OLD_JOB_PLAN


def test_an_old_job_plan_parses_with_defaults() -> None:
    plan = JobPlan.model_validate(OLD_JOB_PLAN)
    assert plan.objective is None and plan.price is None
    assert plan.clusters[1] == Share(cluster="eu-west", gpus=4, gpu_model="H100")
    assert plan.gpus == 8 and plan.estimate.compute_s == 0.2
    assert plan.estimate.ring == ("eu-west", "us-east")
    out = plan.model_dump(mode="json")
    # what the API shows keeps every key it showed, plus the quote's name for the shares and
    # what later plans record (a share's region, the links): unknown in an old plan
    assert {k: out[k] for k in OLD_JOB_PLAN} == {
        **OLD_JOB_PLAN,
        "clusters": [{**c, "region": None} for c in OLD_JOB_PLAN["clusters"]],
        "estimate": {
            **OLD_JOB_PLAN["estimate"],
            "wan_gb": 0.123456789,
            "setup_s": 0.0,
            "total_time_range_s": None,
            "quality_cost": 0.0,
            "batch_shares": {},  # an older plan: equal per worker
            "tree": {},  # and a ring
            "ps_push_s": None,  # no async-ps push cost counted
            "relay_ticks": {},  # nor regions' exchanges (a run sends when the last landed)
        },
    }
    assert out["links"] == []
    assert out["placement"] == out["clusters"]


def test_an_old_quote_option_parses_with_defaults() -> None:
    plan = JobPlan.model_validate(OLD_QUOTE_OPTION)
    assert plan.clusters == (Share(cluster="ap-south", gpus=8),)
    assert plan.estimate.cost is None and plan.estimate.compute_s is None
    assert plan.price is not None and plan.price.gpu[0].gpu_model is None
    held = HeldPlan.model_validate({"quote_id": "q1", **OLD_QUOTE_OPTION})
    assert held.quote_id == "q1" and held.clusters == plan.clusters
    # a share without a GPU model names the planner's cluster as it is; one with a GPU model
    # the planner no longer offers gets a name the planner refuses
    origins = {"ap-south": ("ap-south", "L4"), "us-east/A100": ("us-east", "A100")}
    assert held.assignments(origins) == (scheduler.Assignment("ap-south", 8),)
    typed = JobPlan.model_validate(OLD_JOB_PLAN)
    assert typed.assignments(origins) == (
        scheduler.Assignment("us-east/A100", 4),
        scheduler.Assignment("eu-west/H100", 4),
    )


def test_old_rows_read_back_typed(db_url: str) -> None:
    """Rows written as plain JSON (as before the plan was typed) load as typed values."""
    engine = make_engine(db_url)
    plain = sa.MetaData()
    jobs = sa.Table(
        "jobs",
        plain,
        sa.Column("id", sa.String),
        sa.Column("placement", sa.JSON),
        sa.Column("held_price", sa.JSON),
    )
    quotes = sa.Table("quotes", plain, sa.Column("id", sa.String), sa.Column("options", sa.JSON))
    try:
        with Session(engine) as session, session.begin():
            tenant = Tenant(name="t")
            session.add(tenant)
            session.flush()
            job = Job(tenant_id=tenant.id, name="old", spec={}, gpus_min=8, gpus_max=8)
            quote = Quote(
                tenant_id=tenant.id,
                spec={},
                options=QuoteOptions(options=()),
                expires_at=utcnow(),
            )
            session.add_all([job, quote])
            session.flush()
            job_id, quote_id = job.id, quote.id
        with engine.begin() as conn:
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id)
                .values(
                    placement=OLD_JOB_PLAN,
                    held_price={"quote_id": quote_id, **OLD_QUOTE_OPTION},
                )
            )
            conn.execute(
                quotes.update()
                .where(quotes.c.id == quote_id)
                .values(options={"options": [OLD_QUOTE_OPTION]})
            )
            state = conn.scalar(sa.text("SELECT state FROM jobs WHERE id = :id"), {"id": job_id})
        assert state == "PENDING"  # stored as the plain name
        with Session(engine) as session:
            row = session.get(Job, job_id)
            stored_quote = session.get(Quote, quote_id)
            assert row is not None and stored_quote is not None
            assert row.state is JobState.PENDING
            assert isinstance(row.placement, JobPlan) and row.placement.sync == "every-step"
            assert isinstance(row.held_price, HeldPlan) and row.held_price.quote_id == quote_id
            assert row.held_price.clusters == (Share(cluster="ap-south", gpus=8),)
            assert stored_quote.options.options[0].objective == "cost"
            # a column read alone is typed too
            plans = session.scalars(sa.select(Job.placement).where(Job.id == job_id)).all()
            assert plans == [JobPlan.model_validate(OLD_JOB_PLAN)]
        with engine.connect() as conn:
            stored = conn.execute(sa.select(jobs.c.placement).where(jobs.c.id == job_id)).scalar()
        assert stored == OLD_JOB_PLAN  # reading changed nothing
    finally:
        engine.dispose()


def test_plans_are_stored_without_their_computed_fields(db_url: str) -> None:
    engine = make_engine(db_url)
    plain = sa.Table(
        "jobs", sa.MetaData(), sa.Column("id", sa.String), sa.Column("placement", sa.JSON)
    )
    try:
        with Session(engine) as session, session.begin():
            tenant = Tenant(name="t")
            session.add(tenant)
            session.flush()
            job = Job(
                tenant_id=tenant.id,
                name="new",
                spec={},
                gpus_min=8,
                gpus_max=8,
                placement=JobPlan.model_validate(OLD_JOB_PLAN),
            )
            session.add(job)
            session.flush()
            session.add(
                JobEvent(job_id=job.id, kind="state", from_state=None, to_state=JobState.PENDING)
            )
            job_id = job.id
        with engine.connect() as conn:
            stored: Any = conn.execute(
                sa.select(plain.c.placement).where(plain.c.id == job_id)
            ).scalar()
            to_state = conn.scalar(sa.text("SELECT to_state FROM job_events"))
        assert stored["clusters"] == [{**c, "region": None} for c in OLD_JOB_PLAN["clusters"]]
        assert "placement" not in stored
        assert "wan_gb" not in stored["estimate"] and stored["price"] is None
        assert to_state == "PENDING"
    finally:
        engine.dispose()


def test_a_plan_is_priced_as_its_run_is_billed() -> None:
    """`values.plan.as_billed`, which every plan passes (new or re-staged): a GPU line under
    its offer's minimum term is raised to it, the WAN rate the plan reserves on a priced
    cluster's ports gets a line, and the totals follow; the model's own bandwidth term is
    replaced, not added twice."""
    from controller.values.plan import as_billed
    from tests.scheduler.builders import cluster
    from wire.plan import GpuCharge, PlanEstimate, PriceBreakdown

    def c(name: str, **kw: object) -> scheduler.Cluster:
        return cluster(name, 8, gpu_model="A100", price_per_gpu_hour=2.0, **kw)

    snap = scheduler.Snapshot(
        (c("a", min_hours=1.0), c("b", bandwidth_price_per_gbps_hour=4.0, provider="p")),
        (scheduler.Link("a", "b", 1.0, 10.0, 0.0),),
    )
    origins = {"a": ("a", "A100"), "b": ("b", "A100")}
    hours = 0.1
    est = PlanEstimate(step_time_s=1.0, total_time_s=hours * 3600, wan_bytes=9 * 10**9,
                       cost=1.6 + 0.5, setup_s=0.0)  # fmt: skip
    price = PriceBreakdown(
        total=2.1,
        gpu=tuple(
            GpuCharge(cluster=n, gpu_model="A100", gpus=4, gpu_hours=0.4, price_per_gpu_hour=2.0,
                      amount=0.8) for n in ("a", "b")
        ),
    )  # fmt: skip
    shares = (Share(cluster="a", gpus=4, gpu_model="A100"), Share(cluster="b", gpus=4,
              gpu_model="A100"))  # fmt: skip
    new, billed, reserved = as_billed(est, price, shares, snap, origins, included=0.5)
    a_line, b_line = billed.gpu
    assert (a_line.gpu_hours, a_line.amount) == (4.0, 8.0)  # 4 GPUs x the 1-hour term
    assert (b_line.gpu_hours, b_line.amount) == (0.4, 0.8)
    (bw,) = billed.bandwidth
    assert bw.cluster == "b" and bw.provider == "p" and reserved["b"] == reserved["a"] > 0
    assert bw.amount == round(reserved["b"] / 1e6 * hours * 4.0, 6)
    assert billed.total == round(2.1 + (8.0 - 0.8) + bw.amount - 0.5, 6) == new.cost
