"""Budgets, tenant deletion and typed job arguments through a real server, on each backend.

The server runs without its controller; the reconcile pass (`place_pending`) and the start of
a run (`lifecycle.transition` to RUNNING, what the launcher does before Ray) are driven here
against the server's own database, so each step is observed, not waited for.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select, text

from api.client import ApiError
from controller.jobs import lifecycle
from controller.loop.placement import place_pending
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Allocation, Job
from grammar.states import JobState
from tests.service.conftest import Network, spec

REPLICA = "replica-test"


def place(network: Network) -> list[str]:
    engine = make_engine(network.server.database_url)
    try:
        return [p.job_id for p in place_pending(make_sessionmaker(engine), REPLICA)]
    finally:
        engine.dispose()


def run(network: Network, job_id: str) -> None:
    """SCHEDULED -> RUNNING, as the launcher does before its workers start."""
    engine = make_engine(network.server.database_url)
    try:
        with make_sessionmaker(engine)() as s, s.begin():
            job = s.get(Job, job_id)
            assert job is not None and job.state is JobState.SCHEDULED
            lifecycle.transition(s, job, JobState.RUNNING, "launched")
    finally:
        engine.dispose()


def refused(call: Any, status: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == status, caught.value
    return caught.value


def test_a_tenant_with_a_tiny_budget_waits_and_is_never_placed(network: Network) -> None:
    admin = network.admin
    poor = admin.post("/v1/tenants", {"name": "poor", "budget": 0.01})
    token = admin.create_api_key("tenant", poor["id"])["token"]
    with network.server.client(token) as tenant:
        job = tenant.submit(spec(name="big", gpus=8, steps=10**9))
        assert job.state == "PENDING"  # the budget is held at placement, not at submission
        for _ in range(3):
            assert place(network) == []
            now = tenant.job(job.id)
            assert now.state == "PENDING" and now.placement is None
            assert "has 0.01 of its budget of 0.01 left" in now.reason
    assert all(g["in_use"] == 0 for c in admin.clusters() for g in c["gpus"])
    # The job's own QoS budget is a separate, per-job limit and stays as it was.
    with network.server.client(token) as tenant:
        err = refused(lambda: tenant.submit(spec(name="q", qos={"budget": 0.0001})), 422)
    assert any(e["field"] == "qos.budget" for e in err.errors)


def test_deleting_a_tenant_with_live_jobs_is_a_409_and_without_a_soft_delete(
    network: Network,
) -> None:
    admin, tenant, tid = network.admin, network.tenant, network.tenant_id
    job = tenant.submit(spec(name="billed", gpus=2, steps=100))
    assert place(network) == [job.id]
    run(network, job.id)

    err = refused(lambda: admin.request("DELETE", f"/v1/tenants/{tid}"), 409)
    assert job.id in err.detail and "cancel them" in err.detail
    assert err.errors == [{"field": "tenant_id", "message": err.detail}]
    assert admin.get(f"/v1/tenants/{tid}")["id"] == tid  # nothing changed

    tenant.cancel(job.id)  # ends the run: GPUs back, usage metered and charged
    ledger = admin.get(f"/v1/tenants/{tid}/ledger")
    usage = admin.get(f"/v1/tenants/{tid}/usage")
    assert ledger["total_items"] >= 1 and Decimal(ledger["total"]) > 0

    assert admin.request("DELETE", f"/v1/tenants/{tid}") is None  # 204
    # Gone from the lists and the admin API...
    assert tid not in {t["id"] for t in admin.get("/v1/tenants")["items"]}
    refused(lambda: admin.get(f"/v1/tenants/{tid}"), 404)
    refused(lambda: admin.request("DELETE", f"/v1/tenants/{tid}"), 404)
    refused(lambda: admin.create_api_key("tenant", tid), 422)
    # ...it cannot submit: its keys are revoked (401), or, while a replica's key cache has not
    # seen the revocation yet (up to a second), its tenant is gone (404)...
    with pytest.raises(ApiError) as caught:
        tenant.submit(spec(name="after"))
    assert caught.value.status in (401, 404), caught.value
    # ...and its money trail stays, readable by admins.
    assert admin.get(f"/v1/tenants/{tid}/ledger") == ledger
    assert admin.get(f"/v1/tenants/{tid}/usage") == usage
    assert admin.job(job.id).state == "CANCELLED"
    # The other tenant is untouched and cannot read it.
    refused(lambda: network.other.get(f"/v1/tenants/{tid}/ledger"), 404)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"eval_every": -1}, "args.eval_every"),
        ({"eval_every": 0}, "args.eval_every"),
        ({"batch_size": 0}, "args.batch_size"),
        ({"lr": 0}, "args.lr"),
        ({"lr": "fast"}, "args.lr"),
        ({"seed": -1}, "args.seed"),
        ({"checkpoint_every": -5}, "args.checkpoint_every"),
        ({"outer_lr": 0}, "args.outer_lr"),
        ({"outer_momentum": 1.0}, "args.outer_momentum"),
        ({"momentum": 0.9}, "args.momentum"),  # unknown keys are refused, by name
    ],
)
def test_job_args_are_typed_and_bounded(network: Network, args: dict[str, Any], field: str) -> None:
    err = refused(lambda: network.tenant.submit(spec(args=args)), 422)
    assert [e["field"] for e in err.errors] == [field]
    assert field in err.detail


def test_job_args_the_spec_as_a_whole_refuses(network: Network) -> None:
    err = refused(lambda: network.tenant.submit(spec(gpus=8, args={"batch_size": 4})), 422)
    assert "args.batch_size: 4 is smaller than the up to 8 workers" in err.errors[0]["message"]
    err = refused(lambda: network.tenant.submit(spec(args={"task": {"depth": 3}})), 422)
    assert "args.task" in err.errors[0]["message"]
    job = network.tenant.submit(
        spec(args={"lr": 0.05, "eval_every": 10, "outer_lr": 1.0, "outer_momentum": 0.0})
    )
    assert job.spec.args.given() == {
        "lr": 0.05,
        "eval_every": 10,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
    }
    assert network.tenant.submit(spec(name="plain")).spec.args.given() == {}


def test_a_job_stored_with_old_free_form_args_reads_and_places_as_0016_left_it(
    network: Network,
) -> None:
    """A spec stored before args were typed, as revision 0016 rewrote it: the keys the
    runtime ignored are gone, and the job reads (one job and the list) and places."""
    from tests.controller.test_plan import REVISION_0016

    job = network.tenant.submit(spec(name="old", gpus=2, steps=100))
    old_spec = {
        "name": "old",
        "task": "builtin:mnist1d-mlp",
        "args": {"eval_every": -1, "anything": [1, 2], "lr": 0.05},
        "gpus": 2,
        "steps": 100,
    }
    rewritten: dict[str, Any] = REVISION_0016._typed_args(old_spec)
    assert rewritten["args"] == {"lr": 0.05}
    engine = make_engine(network.server.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE jobs SET spec = :spec WHERE id = :id"),
                {"spec": json.dumps(rewritten), "id": job.id},
            )
    finally:
        engine.dispose()
    assert network.tenant.job(job.id).spec.args.given() == {"lr": 0.05}
    assert job.id in {j.id for j in network.tenant.jobs()}
    assert place(network) == [job.id]
    engine = make_engine(network.server.database_url)
    try:
        with make_sessionmaker(engine)() as s:
            held = s.scalars(select(Allocation.gpus).where(Allocation.job_id == job.id)).all()
    finally:
        engine.dispose()
    assert sum(held) == 2
