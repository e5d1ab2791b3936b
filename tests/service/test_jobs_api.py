"""Quotes, submission, idempotency, isolation and bad input, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import event as sa_event
from sqlalchemy import insert
from sqlalchemy.engine import Engine
from sqlalchemy.orm import make_transient

from api.client import ApiError
from controller.jobs.lifecycle import transition
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Job, JobLog, utcnow
from tests.service.conftest import Network, spec


def test_quote_then_submit_holds_the_price(network: Network) -> None:
    quote = network.tenant.post("/v1/quotes", spec())
    objectives = [o["objective"] for o in quote["options"]]
    assert objectives == ["time", "cost"]
    cheapest = quote["options"][1]
    price = cheapest["price"]
    parts = sum(g["amount"] for g in price["gpu"]) + sum(e["amount"] for e in price["egress"])
    assert price["total"] == pytest.approx(parts, rel=1e-6, abs=1e-6)
    assert sum(p["gpus"] for p in cheapest["placement"]) == 8
    job = network.tenant.post("/v1/jobs", spec(quote_id=quote["id"], quote_option="cost"))
    assert job["state"] == "PENDING" and job["quote_id"] == quote["id"]
    assert job["held_price"]["price"]["total"] == price["total"]
    events = network.tenant.get(f"/v1/jobs/{job['id']}/events")["items"]
    assert events[0]["to_state"] == "PENDING"


def test_a_quote_prices_one_spec_once(network: Network) -> None:
    """Issue 48: a quote for a 200-step job is no price for a 999,999-step one, and it holds
    its price for one job: another spec or a second use is a 409 naming why; a retry of the
    accepted submission (its Idempotency-Key) still gets its job."""
    quote = network.tenant.post("/v1/quotes", spec(steps=200))
    with pytest.raises(ApiError) as other:
        network.tenant.post("/v1/jobs", spec(steps=999_999, quote_id=quote["id"]))
    assert other.value.status == 409 and other.value.errors[0]["field"] == "quote_id"
    assert "steps" in other.value.detail
    renamed = spec(steps=200, name="another-name", quote_id=quote["id"])
    job = network.tenant.submit(renamed, idempotency_key="quote-once")  # names are not priced
    assert job.held_price is not None
    again = network.tenant.submit(renamed, idempotency_key="quote-once")
    assert again.id == job.id  # the same submission retried: its job
    with pytest.raises(ApiError) as twice:
        network.tenant.post("/v1/jobs", renamed)
    assert twice.value.status == 409 and job.id in twice.value.detail


def test_a_submission_stores_the_size_the_queue_orders_by(network: Network) -> None:
    """Ten times the steps is ten times the size; twice the GPUs, half (`reference_run_s`)."""
    jobs = [
        network.tenant.post("/v1/jobs", spec(steps=n, gpus=g))
        for n, g in ((100, 4), (1000, 4), (1000, 8))
    ]
    with make_sessionmaker(make_engine(network.server.database_url))() as s:
        rows = [s.get(Job, j["id"]) for j in jobs]
    sizes = [r.run_s for r in rows if r is not None and r.run_s is not None]
    assert len(sizes) == 3 and all(x > 0 for x in sizes)
    assert sizes[1] == pytest.approx(10 * sizes[0]) and sizes[2] == pytest.approx(sizes[1] / 2)


def test_expired_quote_is_refused(expiring_network: Network) -> None:
    network = expiring_network
    # the held quote is used at once, before the other is even asked for
    held = network.tenant.post("/v1/quotes", spec(name="held"))
    job = network.tenant.submit(spec(name="held", quote_id=held["id"]), idempotency_key="held")
    quote = network.tenant.post("/v1/quotes", spec())
    expires = datetime.fromisoformat(quote["expires_at"])
    while datetime.now(UTC) <= expires:  # the server's TTL here is 3 s
        time.sleep(0.1)
    with pytest.raises(ApiError) as exc:
        network.tenant.post("/v1/jobs", spec(quote_id=quote["id"]))
    assert exc.value.status == 410 and "new quote" in exc.value.detail
    # a retry of the job submitted while its quote was live answers that job, not 410
    retry = network.tenant.submit(spec(name="held", quote_id=held["id"]), idempotency_key="held")
    assert retry == job
    with pytest.raises(ApiError) as exc:  # the same key for another spec is still refused
        network.tenant.submit(spec(name="other", quote_id=held["id"]), idempotency_key="held")
    assert exc.value.status == 422 and exc.value.detail.startswith("this Idempotency-Key")
    assert network.tenant.get("/v1/jobs")["total"] == 1


def test_quote_placement_gone_is_refused(network: Network) -> None:
    quote = network.tenant.post("/v1/quotes", spec(gpus=8))
    clusters = {p["cluster"] for p in quote["options"][0]["placement"]}
    for name in clusters:
        network.admin.post(f"/v1/clusters/{name}/cordon")
    with pytest.raises(ApiError) as exc:
        network.tenant.post("/v1/jobs", spec(gpus=8, quote_id=quote["id"], quote_option="time"))
    assert exc.value.status == 409 and "no longer possible" in exc.value.detail


def test_fifty_concurrent_submissions_with_one_key_make_one_job(network: Network) -> None:
    url, token = network.server.url, network.tenant._http.headers["Authorization"]
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(50)

    def submit() -> None:
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            r = http.post(
                f"{url}/v1/jobs",
                json=spec(),
                headers={"Authorization": token, "Idempotency-Key": "k-1"},
            )
            with lock:
                results.append((r.status_code, r.json().get("id", r.text)))

    threads = [threading.Thread(target=submit) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(c for c, _ in results)
    assert codes.count(201) == 1 and codes.count(200) == 49, codes
    assert len({job_id for _, job_id in results}) == 1
    assert network.tenant.get("/v1/jobs")["total"] == 1
    with pytest.raises(ApiError) as other_body:
        network.tenant.request(
            "POST", "/v1/jobs", json=spec(steps=5), headers={"Idempotency-Key": "k-1"}
        )
    assert (
        other_body.value.status == 422 and other_body.value.errors[0]["field"] == "Idempotency-Key"
    )


def test_tenants_are_isolated(network: Network) -> None:
    job = network.tenant.post("/v1/jobs", spec())
    for call in (
        lambda: network.other.get(f"/v1/jobs/{job['id']}"),
        lambda: network.other.post(f"/v1/jobs/{job['id']}/cancel"),
        lambda: network.other.get(f"/v1/jobs/{job['id']}/events"),
        lambda: network.other.get(f"/v1/jobs/{job['id']}/metrics"),
        lambda: network.other.get(f"/v1/tenants/{network.tenant_id}/ledger"),
    ):
        with pytest.raises(ApiError) as exc:
            call()
        assert exc.value.status == 404  # never 403: existence is not leaked
    assert network.other.get("/v1/jobs")["total"] == 0
    assert network.tenant.get(f"/v1/jobs/{job['id']}")["state"] == "PENDING"
    assert network.admin.get("/v1/jobs")["total"] == 1  # admins see all


def test_a_job_answers_to_the_start_of_its_id(network: Network) -> None:
    """Issue 51: the short id a table prints names the job (as git's and docker's do); one
    that starts several ids is a 422 listing them; another tenant's never matches."""
    job = network.tenant.post("/v1/jobs", spec())
    short = job["id"][:8]
    assert network.tenant.get(f"/v1/jobs/{short}")["id"] == job["id"]
    assert network.tenant.get(f"/v1/jobs/{short.upper()}")["id"] == job["id"]
    assert network.tenant.get(f"/v1/jobs/{short}/events")["items"][0]["to_state"] == "PENDING"
    assert network.admin.get(f"/v1/jobs/{short}")["id"] == job["id"]
    for call in (
        lambda: network.other.get(f"/v1/jobs/{short}"),
        lambda: network.other.post(f"/v1/jobs/{short}/cancel"),
        lambda: network.other.get(f"/v1/jobs/{short}/metrics"),
        lambda: network.tenant.get(f"/v1/jobs/{job['id'][:3]}"),  # too short to name one
        lambda: network.tenant.get("/v1/jobs/zzzzzzzz"),
    ):
        with pytest.raises(ApiError) as exc:
            call()
        assert exc.value.status == 404
    twin = short + "-ffff-4fff-8fff-ffffffffffff"
    with make_sessionmaker(make_engine(network.server.database_url))() as s:
        row = s.get(Job, job["id"])
        assert row is not None
        s.expunge(row)
        make_transient(row)
        row.id = twin
        s.add(row)
        s.commit()
    with pytest.raises(ApiError) as exc:
        network.tenant.get(f"/v1/jobs/{short}")
    assert exc.value.status == 422 and exc.value.errors[0]["field"] == "job_id"
    assert job["id"][:12] in exc.value.detail and twin[:12] in exc.value.detail
    assert network.tenant.get(f"/v1/jobs/{job['id'][:14]}")["id"] == job["id"]
    cancelled = network.tenant.post(f"/v1/jobs/{job['id'][:14]}/cancel")
    assert cancelled["id"] == job["id"] and cancelled["state"] == "CANCELLED"


def _log_lines(network: Network, job_id: str, texts: list[str]) -> None:
    """Lines as a run's reports write them (`controller.loop.progress`)."""
    rows = [
        {"job_id": job_id, "at": utcnow(), "source": "a/0" if i % 2 else "driver"}
        | {"stream": "stdout", "text": text}
        for i, text in enumerate(texts)
    ]
    with make_sessionmaker(make_engine(network.server.database_url))() as s, s.begin():
        s.execute(insert(JobLog), rows)


def test_a_jobs_log_pages_follows_and_stays_its_tenants(network: Network) -> None:
    """Issue 51: `GET /v1/jobs/{id}/logs` pages a job's lines (by worker, after a cursor) and
    with `follow` streams them until the job has ended and every line is sent."""
    job = network.tenant.post("/v1/jobs", spec())
    _log_lines(network, job["id"], [f"line {i}" for i in range(5)])
    page = network.tenant.get(f"/v1/jobs/{job['id'][:8]}/logs")
    assert page["total"] == 5 and [x["text"] for x in page["items"]] == [
        f"line {i}" for i in range(5)
    ]
    worker = network.tenant.get(f"/v1/jobs/{job['id']}/logs", source="a/0")["items"]
    assert [x["text"] for x in worker] == ["line 1", "line 3"]
    cursor = page["items"][2]["id"]
    later = network.tenant.get(f"/v1/jobs/{job['id']}/logs", after=cursor)["items"]
    assert [x["text"] for x in later] == ["line 3", "line 4"]
    for call in (
        lambda: network.other.get(f"/v1/jobs/{job['id']}/logs"),
        lambda: list(network.other.logs(job["id"])),
    ):
        with pytest.raises(ApiError) as exc:
            call()
        assert exc.value.status == 404
    got: list[str] = []
    follower = threading.Thread(
        target=lambda: got.extend(x.text for x in network.tenant.logs(job["id"], after=cursor))
    )
    follower.start()
    _log_lines(network, job["id"], ["line 5"])
    network.tenant.cancel(job["id"])
    follower.join(30)
    assert not follower.is_alive() and got == ["line 3", "line 4", "line 5"]


def test_cancel_records_events_and_streams(network: Network) -> None:
    job = network.tenant.post("/v1/jobs", spec())
    cancelled = network.tenant.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled["state"] == "CANCELLED" and cancelled["finished_at"]
    with pytest.raises(ApiError) as again:
        network.tenant.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.value.status == 409
    with httpx.stream(
        "GET",
        f"{network.server.url}/v1/jobs/{job['id']}/events?stream=true",
        headers={"Authorization": network.tenant._http.headers["Authorization"]},
        timeout=30,
    ) as r:
        body = "".join(r.iter_text())
    assert '"to_state": "PENDING"' in body and '"to_state": "CANCELLED"' in body
    assert body.rstrip().endswith("data: {}")


def test_stream_never_ends_before_the_final_event(network: Network) -> None:
    """The job ends between the stream's reads of its events and of its state.

    The final transition is committed right after the stream's events query runs (an
    SQLAlchemy hook on the real database, nothing faked): a stream that read the events before
    the state would see the job ended and close without its last event."""
    job = network.tenant.post("/v1/jobs", spec())
    writer = make_engine(network.server.database_url)
    ended: list[bool] = []

    def end_job_after_events_read(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if ended or "FROM job_events" not in statement or "job_events.id >" not in statement:
            return
        ended.append(True)
        with make_sessionmaker(writer)() as s, s.begin():
            row = s.get(Job, job["id"])
            assert row is not None
            transition(s, row, "CANCELLED", "ended mid-poll")

    # Every engine: the server's is the one that runs the stream's query.
    sa_event.listen(Engine, "after_cursor_execute", end_job_after_events_read)
    try:
        states = [e["to_state"] for e in network.tenant.events(job["id"]) if e["kind"] == "state"]
    finally:
        sa_event.remove(Engine, "after_cursor_execute", end_job_after_events_read)
        writer.dispose()
    assert ended, "the hook never ran: the stream no longer reads events this way"
    assert states == ["PENDING", "CANCELLED"]


def test_bad_specs_name_every_field(network: Network) -> None:
    with pytest.raises(ApiError) as exc:
        network.tenant.post(
            "/v1/jobs", {"name": "", "task": "nope", "gpus": 0, "steps": -1, "compression": "zip"}
        )
    assert exc.value.status == 422
    assert {e["field"] for e in exc.value.errors} >= {
        "name",
        "task",
        "gpus",
        "steps",
        "compression",
    }
    cases = [
        (spec(task="builtin:nosuch"), "task", "unknown builtin"),
        (
            spec(task="no_such_pkg_zz:main", work={"params": 10, "flops_per_step": 1e9}),
            "task",
            "CPN_TASK_MODULES",  # module tasks only under allowed prefixes, never imported here
        ),
        (spec(gpus=10_000), "gpus", "ask for fewer"),
        (
            spec(qos={"deadline": (datetime.now(UTC) - timedelta(hours=1)).isoformat()}),
            "qos.deadline",
            "past",
        ),
        (spec(qos={"budget": 0.000001}), "qos.budget", ""),
        (spec(task="mymod:fn"), "body", "work"),
    ]
    for body, field, words in cases:
        with pytest.raises(ApiError) as bad:
            network.tenant.post("/v1/jobs", body)
        assert bad.value.status == 422, body
        assert bad.value.errors and bad.value.errors[0]["field"] == field, bad.value.errors
        assert words in bad.value.detail or words in str(bad.value.errors)
    assert network.tenant.get("/v1/jobs")["total"] == 0  # nothing half-written


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"gpus": "1"}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"steps": "100"}, "steps"),
        ({"qos": {"preemptible": 1}}, "qos.preemptible"),
        ({"qos": {"preemptible": "yes"}}, "qos.preemptible"),
    ],
)
def test_numbers_and_booleans_are_what_the_schema_says(
    network: Network, overrides: dict[str, object], field: str
) -> None:
    """Issue 48: "1" and true were taken as 1 GPU although the schema says integer."""
    with pytest.raises(ApiError) as bad:
        network.tenant.post("/v1/jobs", spec(**overrides))
    assert bad.value.status == 422 and bad.value.errors[0]["field"] == field
    assert network.tenant.get("/v1/jobs")["total"] == 0


def test_over_quota_waits_or_refuses(network: Network) -> None:
    with pytest.raises(ApiError) as exc:
        network.tenant.post("/v1/jobs", spec(gpus=24))  # quota is 20 of 32 GPUs: never fits
    assert exc.value.status == 422 and "quota" in exc.value.detail


def test_local_data_must_name_clusters_that_can_all_train_it(network: Network) -> None:
    """Every cluster holding a share of local data trains it: an unknown cluster, or fewer
    GPUs than clusters, is refused with the field and the fix; a fitting job is placed on
    every data cluster."""
    local = {"residency": "local", "clusters": ["us-east", "mars-1"]}
    with pytest.raises(ApiError) as unknown:
        network.tenant.post("/v1/jobs", spec(data=local, sync="local-sgd:8"))
    assert unknown.value.status == 422 and unknown.value.errors[0]["field"] == "data.clusters"
    assert "mars-1" in unknown.value.detail
    both = {"residency": "local", "clusters": ["us-east", "eu-west"]}
    with pytest.raises(ApiError) as few:
        network.tenant.post("/v1/jobs", spec(gpus=1, data=both, sync="local-sgd:8"))
    assert few.value.status == 422 and few.value.errors[0]["field"] == "data.clusters"
    quote = network.tenant.post("/v1/quotes", spec(gpus=4, data=both, sync="local-sgd:8"))
    for option in quote["options"]:
        assert {c["cluster"] for c in option["clusters"]} == {"us-east", "eu-west"}


def test_pricing_is_effective_dated(network: Network) -> None:
    now = network.admin.get("/v1/pricing")
    assert {(p["cluster"], p["qos_class"]) for p in now["gpu"]} >= {("us-east", "spot")}
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    network.admin.post(
        "/v1/pricing/gpu",
        {
            "cluster": "us-east",
            "gpu_model": "A100",
            "qos_class": "standard",
            "price_per_gpu_hour": 9.0,
            "effective_from": later,
        },
    )
    current = {(p["cluster"], p["qos_class"]): p for p in network.tenant.get("/v1/pricing")["gpu"]}
    assert current[("us-east", "standard")]["price_per_gpu_hour"] == 2.5
    future = network.tenant.get(
        "/v1/pricing", at=(datetime.now(UTC) + timedelta(hours=2)).isoformat()
    )
    assert {(p["cluster"], p["qos_class"]): p for p in future["gpu"]}[("us-east", "standard")][
        "price_per_gpu_hour"
    ] == 9.0
    with pytest.raises(ApiError) as past:
        network.admin.post(
            "/v1/pricing/gpu",
            {
                "cluster": "us-east",
                "gpu_model": "A100",
                "qos_class": "spot",
                "price_per_gpu_hour": 1,
                "effective_from": "2020-01-01T00:00:00Z",
            },
        )
    assert past.value.status == 422 and past.value.errors[0]["field"] == "effective_from"
    with pytest.raises(ApiError) as tenant_write:
        network.tenant.post(
            "/v1/pricing/gpu",
            {
                "cluster": "us-east",
                "gpu_model": "A100",
                "qos_class": "spot",
                "price_per_gpu_hour": 1,
            },
        )
    assert tenant_write.value.status == 403


def test_quotes_and_plans_stored_before_the_typed_plan_still_work(network: Network) -> None:
    """A quote whose options were stored in the older shape is held by a submission, placed by
    the reconcile loop (the real one, in-process), and read back over the API."""
    import sqlalchemy as sa

    from controller.loop.placement import place_pending
    from tests.controller.test_plan import OLD_JOB_PLAN, OLD_QUOTE_OPTION

    plain = sa.MetaData()
    quotes = sa.Table("quotes", plain, sa.Column("id", sa.String), sa.Column("options", sa.JSON))
    jobs = sa.Table("jobs", plain, sa.Column("id", sa.String), sa.Column("placement", sa.JSON))
    quote = network.tenant.post("/v1/quotes", spec())
    engine = make_engine(network.server.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                quotes.update()
                .where(quotes.c.id == quote["id"])
                .values(options={"options": [OLD_QUOTE_OPTION]})
            )
        shown = network.tenant.get(f"/v1/quotes/{quote['id']}")["options"]
        assert [o["placement"] for o in shown] == [
            [{"cluster": "ap-south", "gpus": 8, "gpu_model": None, "region": None}]
        ]
        job = network.tenant.post("/v1/jobs", spec(quote_id=quote["id"], quote_option="cost"))
        held = job["held_price"]
        assert held["quote_id"] == quote["id"] and held["price"]["total"] == 1.777778
        assert held["clusters"] == held["placement"] and held["estimate"]["cost"] is None
        assert job["ends_at"] is None  # not placed yet
        placed = place_pending(make_sessionmaker(engine), "test-replica")
        assert [p.job_id for p in placed] == [job["id"]]
        job = network.tenant.get(f"/v1/jobs/{job['id']}")
        assert job["state"] == "SCHEDULED"
        # when it is expected to end: placed at, plus its plan's run time
        run = datetime.fromisoformat(job["ends_at"]) - datetime.fromisoformat(job["updated_at"])
        assert run.total_seconds() == pytest.approx(
            job["placement"]["estimate"]["total_time_s"], abs=1.0
        )
        assert network.tenant.get("/v1/jobs")["items"][0]["ends_at"] == job["ends_at"]
        assert job["placement"]["clusters"] == [
            {"cluster": "ap-south", "gpus": 8, "gpu_model": "L4", "region": "ap-south"}
        ]
        assert job["placement"]["price"]["gpu"][0]["price_per_gpu_hour"] == 0.8
        with engine.begin() as conn:
            conn.execute(jobs.update().where(jobs.c.id == job["id"]).values(placement=OLD_JOB_PLAN))
        old = network.tenant.get(f"/v1/jobs/{job['id']}")["placement"]
        assert old["objective"] is None and old["price"] is None
        assert old["clusters"] == [{**c, "region": None} for c in OLD_JOB_PLAN["clusters"]]
        assert old["sync"] == "every-step"
    finally:
        engine.dispose()


def test_queued_jobs_are_capped_per_tenant(db_url: str) -> None:
    """Past CPN_MAX_QUEUED_JOBS pending jobs a tenant gets 429 with Retry-After; a retry of a
    job it already submitted still answers that job, and cancelling one frees a place."""
    from tests.conftest import start_server
    from tests.service.conftest import build_network

    live = start_server(database_url=db_url, run_controller=False, max_queued_jobs=2)
    net = build_network(live)
    try:
        first = net.tenant.submit(spec(gpus=1), idempotency_key="first")
        net.tenant.submit(spec(gpus=1))
        with pytest.raises(ApiError) as refused:
            net.tenant.submit(spec(gpus=1), retries=0)
        assert refused.value.status == 429 and "CPN_MAX_QUEUED_JOBS" in refused.value.detail
        raw = net.tenant._http.post("/v1/jobs", json=spec(gpus=1))
        assert raw.status_code == 429 and int(raw.headers["Retry-After"]) >= 1
        assert raw.headers["content-type"].startswith("application/problem+json")
        assert net.tenant.submit(spec(gpus=1), idempotency_key="first").id == first.id
        net.other.submit(spec(gpus=1))  # another tenant's queue is its own
        net.tenant.cancel(first.id)
        net.tenant.submit(spec(gpus=1))
    finally:
        for c in (net.admin, net.tenant, net.other):
            c.close()
        live.stop()


def test_the_job_list_answers_each_job_as_its_own_get_does(
    network: Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list reads its rows as the database's text (`JobRow`); every item must be what the
    job's own GET (the ORM and `JobOut`) answers: held prices, placements, times, states, a
    JSON column left SQL NULL; filtered by state, by an admin's tenant, and paged."""
    import sqlalchemy as sa

    from api import job_list
    from controller.loop.placement import place_pending

    quote = network.tenant.post("/v1/quotes", spec())
    held = network.tenant.post("/v1/jobs", spec(quote_id=quote["id"], quote_option="cost"))
    plain = [network.tenant.post("/v1/jobs", spec(name=f"plain-{i}", gpus=2)) for i in range(3)]
    theirs = network.other.post("/v1/jobs", spec(name="theirs"))
    engine = make_engine(network.server.database_url)
    try:
        placed = place_pending(make_sessionmaker(engine), "test-replica")
        assert held["id"] in {p.job_id for p in placed}
        jobs = sa.Table("jobs", sa.MetaData(), sa.Column("id", sa.String), sa.Column("held_price"))
        with engine.begin() as conn:  # SQL NULL, as rows written before the column's JSON null
            conn.execute(jobs.update().where(jobs.c.id == plain[0]["id"]).values(held_price=None))
        network.tenant.post(f"/v1/jobs/{plain[1]['id']}/cancel")
    finally:
        engine.dispose()
    late = network.tenant.post("/v1/jobs", spec(name="late", gpus=2))  # PENDING: none placed

    def one(client: Any, job_id: str) -> dict[str, Any]:
        return dict(client.get(f"/v1/jobs/{job_id}"))

    page = network.tenant.get("/v1/jobs?limit=500")
    mine = [held["id"], *(j["id"] for j in plain), late["id"]]
    assert page["total"] == 5 and {j["id"] for j in page["items"]} == set(mine)
    assert page["items"] == [one(network.tenant, j["id"]) for j in page["items"]]
    states = {j["state"] for j in page["items"]}
    assert {"SCHEDULED", "CANCELLED", "PENDING"} <= states
    by_id = {j["id"]: j for j in page["items"]}
    assert by_id[held["id"]]["placement"]["clusters"] and by_id[held["id"]]["held_price"]
    assert by_id[plain[0]["id"]]["held_price"] is None
    assert by_id[plain[1]["id"]]["finished_at"] is not None
    assert all(j["created_at"].endswith("Z") for j in page["items"])
    # newest first, paged
    firsts = [network.tenant.get(f"/v1/jobs?limit=1&offset={k}")["items"][0] for k in range(5)]
    assert firsts == page["items"]
    assert [j["created_at"] for j in firsts] == sorted(
        (j["created_at"] for j in firsts), reverse=True
    )
    cancelled = network.tenant.get("/v1/jobs?state=CANCELLED")
    assert cancelled["total"] == 1 and cancelled["items"][0]["id"] == plain[1]["id"]
    assert network.other.get("/v1/jobs")["items"] == [one(network.other, theirs["id"])]
    everyone = network.admin.get("/v1/jobs?limit=500")
    assert everyone["total"] == 6
    assert network.admin.get(f"/v1/jobs?tenant={network.other_tenant_id}")["total"] == 1
    pending = network.admin.get(f"/v1/jobs?tenant={network.tenant_id}&state=PENDING")
    assert [j["id"] for j in pending["items"]] == [late["id"]]
    # rendered jobs are kept by (id, version) (`api.job_list`): a job changed since it was
    # listed -- by the API, or by SQL that leaves its version (revision 0014's trigger moves
    # it) -- is listed as it is now, and a row past the cache's size (here: every row) is
    # rendered all the same
    network.tenant.post(f"/v1/jobs/{late['id']}/cancel")
    engine = make_engine(network.server.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE jobs SET reason = 'fixed by hand' WHERE id = :id"),
                {"id": plain[2]["id"]},
            )
    finally:
        engine.dispose()
    for most in (job_list.CACHE_MAX_CHARS, 0):
        monkeypatch.setattr(job_list, "CACHE_MAX_CHARS", most)
        again = network.tenant.get("/v1/jobs?limit=500")
        assert again["items"] == [one(network.tenant, j["id"]) for j in again["items"]]
        assert {j["id"]: j["state"] for j in again["items"]}[late["id"]] == "CANCELLED"
        assert {j["id"]: j["reason"] for j in again["items"]}[plain[2]["id"]] == "fixed by hand"
