"""Rate limits (issue 14, item 5): the pure buckets with an injected clock, and live servers.

Live checks send requests one after another and look for the first 429: the bucket starts
full and only refills, so "at least the burst passed, then a 429" holds however slow the
machine is. Limits in these servers are small and refill slowly (seconds to tens of seconds a
token), so a 429 that was seen stays true for the next few requests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from sqlalchemy import event
from sqlalchemy.orm import Session

from agents.protocol import GpuInventory, Heartbeat
from api.config import Settings
from api.limits import BucketTable, Limit, RateLimits, TokenBucket, credential_tag
from controller.access import keys
from controller.store.db import make_engine
from controller.store.models import Cluster, Tenant
from tests.conftest import LiveServer, start_server
from tests.security.conftest import Answer, assert_problem, call
from tests.service.conftest import build_network, spec

# ---- the pure buckets -----------------------------------------------------------------------


def test_a_bucket_gives_its_burst_then_refills_at_its_rate() -> None:
    bucket = TokenBucket.full(rate=2.0, burst=4.0, now=100.0)
    assert [bucket.take(100.0) for _ in range(4)] == [0.0] * 4
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token at 2/s: half a second
    assert bucket.wait(100.25) == pytest.approx(0.25)
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == pytest.approx(0.5)


def test_a_bucket_never_holds_more_than_its_burst() -> None:
    bucket = TokenBucket.full(rate=2.0, burst=4.0, now=0.0)
    bucket.take(0.0)
    assert [bucket.take(10_000.0) for _ in range(4)] == [0.0] * 4
    assert bucket.take(10_000.0) > 0


def test_a_clock_that_steps_back_refills_nothing() -> None:
    bucket = TokenBucket.full(rate=1.0, burst=1.0, now=50.0)
    assert bucket.take(50.0) == 0.0
    assert bucket.take(10.0) == pytest.approx(1.0)  # still a second after 50, not before
    assert bucket.take(51.0) == 0.0


def test_a_table_is_bounded_and_an_evicted_bucket_comes_back_full() -> None:
    table = BucketTable(rate=0.001, burst=1.0, max_entries=3)
    assert table.take("hot", 0.0) == 0.0
    assert table.take("hot", 0.0) > 0  # empty
    for i in range(1000):
        table.take(f"junk-{i}", 0.0)
        assert len(table) <= 3
    # Junk pushed "hot" out: it starts over full (the limit loosens, nobody is shut out).
    assert table.take("hot", 0.0) == 0.0


def test_a_recently_used_bucket_outlives_older_ones() -> None:
    table = BucketTable(rate=0.001, burst=1.0, max_entries=2)
    table.take("a", 0.0)
    table.take("b", 0.0)
    table.take("a", 0.0)  # refused, but "a" is now the most recently used
    table.take("c", 0.0)  # evicts "b"
    assert table.wait("a", 0.0) > 0
    assert table.wait("b", 0.0) == 0.0


def test_an_address_over_its_failures_passes_only_known_keys() -> None:
    limits = RateLimits(key_rate=100, agent_rate=100, auth_fail_limit=2, quote_limit=0)
    for _ in range(2):
        ok = limits.admit(address="10.0.0.1", key_hash="j", known_key=False, agent=False, now=0)
        assert ok is None
        limits.auth_failed("10.0.0.1", 0.0)
    refusal = limits.admit(address="10.0.0.1", key_hash="j2", known_key=False, agent=False, now=1)
    assert refusal is not None and refusal.limit is Limit.AUTH_FAILURES
    assert refusal.retry_after_s == pytest.approx(29.0)  # 2 a minute: one every 30 s
    assert "CPN_AUTH_FAIL_LIMIT" in refusal.detail
    assert (
        limits.admit(address="10.0.0.1", key_hash="k", known_key=True, agent=False, now=1) is None
    )
    assert (
        limits.admit(address="10.0.0.1", key_hash=None, known_key=False, agent=False, now=1) is None
    )
    assert (
        limits.admit(address="10.0.0.2", key_hash="j", known_key=False, agent=False, now=1) is None
    )
    assert (
        limits.admit(address="10.0.0.1", key_hash="j", known_key=False, agent=False, now=30) is None
    )


def test_others_wrong_keys_from_one_address_never_refuse_a_good_key() -> None:
    """Behind one NAT: 20 wrong keys (the limit) a minute from a neighbour leave another
    user's key, never seen by this replica, looked up; the guessed key backs off; only a
    flood of ten times the limit refuses the address's unknown keys."""
    limits = RateLimits(key_rate=100, agent_rate=100, auth_fail_limit=20, quote_limit=0)
    nat = "10.0.0.1"
    guessed = credential_tag("cpn_tenant_AAAAAAAA" + "x" * 35)
    good = credential_tag("cpn_tenant_BBBBBBBB" + "y" * 35)
    assert guessed != good
    for i in range(20):
        ok = limits.admit(
            address=nat, key_hash=f"h{i}", known_key=False, agent=False, now=0, tag=guessed
        )
        assert ok is None
        limits.auth_failed(nat, 0.0, guessed)
    refused = limits.admit(
        address=nat, key_hash="h20", known_key=False, agent=False, now=0, tag=guessed
    )
    assert refused is not None and refused.limit is Limit.AUTH_FAILURES
    assert "of this key" in refused.detail
    assert (
        limits.admit(address=nat, key_hash="good", known_key=False, agent=False, now=0, tag=good)
        is None
    )
    for i in range(180):  # a flood of random keys: 200 failures in all
        limits.auth_failed(nat, 0.0, credential_tag(f"cpn_tenant_{i:08d}"))
    flooded = limits.admit(
        address=nat, key_hash="good", known_key=False, agent=False, now=0, tag=good
    )
    assert flooded is not None and "10 x CPN_AUTH_FAIL_LIMIT" in flooded.detail
    assert (
        limits.admit(address=nat, key_hash="good", known_key=True, agent=False, now=0, tag=good)
        is None
    )
    assert credential_tag(None) == ""


def test_agents_draw_from_buckets_of_their_own() -> None:
    limits = RateLimits(key_rate=1, agent_rate=1, auth_fail_limit=0, quote_limit=0)
    for _ in range(2):
        assert limits.admit(address="a", key_hash="k", known_key=True, agent=False, now=0) is None
    refusal = limits.admit(address="a", key_hash="k", known_key=True, agent=False, now=0)
    assert refusal is not None and refusal.limit is Limit.KEY
    assert limits.admit(address="a", key_hash="k", known_key=True, agent=True, now=0) is None


def test_quotes_are_counted_per_tenant_and_zero_turns_a_limit_off() -> None:
    limits = RateLimits(key_rate=0, agent_rate=0, auth_fail_limit=0, quote_limit=2)
    assert limits.admit_quote("t1", 0.0) is None
    assert limits.admit_quote("t1", 0.0) is None
    refusal = limits.admit_quote("t1", 0.0)
    assert refusal is not None and refusal.limit is Limit.QUOTES
    assert refusal.retry_after() == "30"
    assert limits.admit_quote("t2", 0.0) is None
    assert limits.admit_quote("t1", 30.0) is None
    for _ in range(1000):
        assert limits.admit(address="a", key_hash="k", known_key=False, agent=False, now=0) is None
        limits.auth_failed("a", 0.0)


@pytest.mark.parametrize(
    "field", ["key_rate_limit", "agent_rate_limit", "auth_fail_limit", "quote_rate_limit"]
)
def test_negative_limits_are_refused(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**{field: -1})  # type: ignore[arg-type]


# ---- live servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Seeded:
    tenant_id: str
    tenant: str
    agent: str
    cluster: str = "us-east"


def _seed(database_url: str) -> Seeded:
    """A tenant and its key, a cluster and its agent key, written straight to the database: a
    server with a tiny per-key limit cannot afford the admin calls that would make them."""
    engine = make_engine(database_url)
    try:
        with Session(engine) as session, session.begin():
            tenant = Tenant(name="acme")
            session.add_all([tenant, Cluster(name="us-east", region="us-east")])
            session.flush()
            _key, tenant_token = keys.create_key(session, "tenant", tenant.id, "rl tenant")
            _key, agent_token = keys.create_key(session, "agent", "us-east", "rl agent")
            return Seeded(tenant.id, tenant_token, agent_token)
    finally:
        engine.dispose()


@contextmanager
def _server(db_url: str, **settings: Any) -> Iterator[LiveServer]:
    live = start_server(database_url=db_url, run_controller=False, **settings)
    try:
        yield live
    finally:
        live.stop()


def _app(live: LiveServer) -> FastAPI:
    app = live.server.config.app
    assert isinstance(app, FastAPI)
    return app


def _sample(live: LiveServer, name: str, **labels: str) -> float:
    registry = _app(live).state.cpn.metrics.registry
    return float(registry.get_sample_value(name, labels) or 0.0)


def _beat(http: httpx.Client, token: str, cluster: str) -> Answer:
    body = Heartbeat(
        cluster=cluster,
        gpus=[GpuInventory(model="A100", memory_gib=80, count=8, allocatable=8)],
    ).model_dump(mode="json", exclude_unset=True)
    return call(http, "POST", "/v1/agent/heartbeat", token, json=body)


def _until_429(http: httpx.Client, method: str, path: str, token: str, **kw: Any) -> list[Answer]:
    """Answers up to and including the first 429 (at most 200 requests)."""
    answers = []
    for _ in range(200):
        answers.append(call(http, method, path, token, **kw))
        if answers[-1].status == 429:
            return answers
    raise AssertionError(f"no 429 in 200 requests: {answers[-1]}")


def _assert_429(answer: Answer, within_s: int) -> None:
    assert_problem(answer, 429)
    retry = answer.headers.get("retry-after", "")
    assert retry.isdigit() and 1 <= int(retry) <= within_s, f"Retry-After {retry!r}: {answer}"


def test_a_key_over_its_burst_gets_a_429_problem_and_others_do_not(db_url: str) -> None:
    seeded = _seed(db_url)
    with _server(db_url, key_rate_limit=0.2) as live, httpx.Client(base_url=live.url) as http:
        # 0.2/s: a burst of one (2 x 0.2 is below one request), then one every 5 s.
        answers = _until_429(http, "GET", "/v1/jobs", seeded.tenant)
        assert len(answers) >= 2 and all(a.status == 200 for a in answers[:-1]), answers[0]
        _assert_429(answers[-1], within_s=5)
        assert "CPN_KEY_RATE_LIMIT" in answers[-1].body["detail"]
        assert _sample(live, "cpn_rate_limited_total", limit="key") >= 1
        # The admin's key has a bucket of its own.
        assert call(http, "GET", "/v1/clusters", live.admin_token).status == 200


def test_the_burst_is_twice_the_rate(db_url: str) -> None:
    seeded = _seed(db_url)
    with _server(db_url, key_rate_limit=2) as live, httpx.Client(base_url=live.url) as http:
        answers = _until_429(http, "GET", "/v1/jobs", seeded.tenant)
        assert len(answers) - 1 >= 4, [str(a) for a in answers]
        _assert_429(answers[-1], within_s=1)


def test_a_junk_token_flood_is_refused_before_any_database_query(db_url: str) -> None:
    seeded = _seed(db_url)
    with _server(db_url, auth_fail_limit=2) as live, httpx.Client(base_url=live.url) as http:
        # Both keys are used once first, so this process knows them as live.
        assert call(http, "GET", "/v1/jobs", seeded.tenant).status == 200
        assert _beat(http, seeded.agent, seeded.cluster).status == 200
        # One junk key backs off after the limit (2); junk keys of every start together
        # after ten times it: the address's flood bound.
        answers = _until_429(http, "GET", "/v1/jobs", f"cpn_tenant_junk-{uuid.uuid4().hex}")
        assert len(answers) == 3 and "of this key" in answers[-1].text
        answers = answers[:-1]
        for _ in range(40):
            answers.append(call(http, "GET", "/v1/jobs", f"cpn_{uuid.uuid4().hex}"))
            if answers[-1].status == 429:
                break
        failed = len(answers) - 1
        assert failed == 20 and all(a.status == 401 for a in answers[:-1])
        _assert_429(answers[-1], within_s=30)
        assert "127.0.0.1" not in answers[-1].text  # behind a proxy: an internal address
        assert _sample(live, "cpn_auth_failures_total", reason="rejected") == failed

        statements: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        state = _app(live).state.cpn
        engines = [state.engine, state.agent_engine]
        for engine in engines:  # every pool the app has: tenants' and agents'
            event.listen(engine, "before_cursor_execute", count)
        try:
            flood = [
                call(http, "GET", "/v1/jobs", f"cpn_tenant_junk-{uuid.uuid4().hex}")
                for _ in range(30)
            ]
        finally:
            for engine in engines:
                event.remove(engine, "before_cursor_execute", count)
        assert [a.status for a in flood] == [429] * 30
        assert statements == [], "a refused junk token still reached the database"
        assert _sample(live, "cpn_auth_failures_total", reason="rejected") == failed
        assert _sample(live, "cpn_rate_limited_total", limit="auth_failures") == 32

        # From the same address: known live keys go on, and so does an agent's heartbeat.
        assert call(http, "GET", "/v1/jobs", seeded.tenant).status == 200
        assert _beat(http, seeded.agent, seeded.cluster).status == 200
        # A request without a key costs no lookup: still its 401, and not counted against
        # the address.
        assert call(http, "GET", "/v1/jobs").status == 401
        assert _sample(live, "cpn_auth_failures_total", reason="missing") == 1


def test_a_junk_session_cookie_flood_is_refused_before_any_database_query(db_url: str) -> None:
    """A console session cookie is looked up in the database: a junk one counts against the
    address like a junk key, and past the limit no lookup is made."""
    from api.sessions import SESSION_COOKIE

    _seed(db_url)
    with _server(db_url, auth_fail_limit=2) as live, httpx.Client(base_url=live.url) as http:

        def junk() -> int:
            cookie = {"Cookie": f"{SESSION_COOKIE}={uuid.uuid4().hex}"}
            return http.get("/v1/jobs", headers=cookie).status_code

        codes = [junk() for _ in range(3)]
        assert codes[:2] == [401, 401] and codes[2] == 429, codes
        statements: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        engine = _app(live).state.cpn.engine
        event.listen(engine, "before_cursor_execute", count)
        try:
            assert [junk() for _ in range(10)] == [429] * 10
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert statements == [], "a refused junk cookie still reached the database"


def test_heartbeats_pass_while_a_tenant_key_is_throttled(db_url: str) -> None:
    seeded = _seed(db_url)
    with _server(db_url, key_rate_limit=0.2) as live, httpx.Client(base_url=live.url) as http:
        throttled = _until_429(http, "GET", "/v1/jobs", seeded.tenant)
        _assert_429(throttled[-1], within_s=5)
        beats = [_beat(http, seeded.agent, seeded.cluster) for _ in range(10)]
        assert [b.status for b in beats] == [200] * 10, beats[-1]
        assert _sample(live, "cpn_agent_heartbeats_total") == 10


def test_quotes_are_limited_per_tenant_across_its_keys(db_url: str) -> None:
    with _server(db_url, quote_rate_limit=3) as live, httpx.Client(base_url=live.url) as http:
        net = build_network(live)
        try:
            admin = live.admin_token
            body = {"role": "tenant", "scope": net.tenant_id, "name": "second acme key"}
            second = call(http, "POST", "/v1/api-keys", admin, json=body)
            assert second.status == 201, second
            first = str(net.tenant._http.headers["Authorization"]).removeprefix("Bearer ")
            other = str(net.other._http.headers["Authorization"]).removeprefix("Bearer ")
            keys_in_turn = [first, second.body["token"], first]
            made = [call(http, "POST", "/v1/quotes", k, json=spec()) for k in keys_in_turn]
            assert [a.status for a in made] == [201] * 3, made[-1]
            for token in (second.body["token"], first):  # the tenant's, whichever key asks
                refused = call(http, "POST", "/v1/quotes", token, json=spec())
                _assert_429(refused, within_s=20)
                assert "CPN_QUOTE_RATE_LIMIT" in refused.body["detail"]
            assert call(http, "POST", "/v1/quotes", other, json=spec()).status == 201
            # Reading a quote is not asking for one.
            quote_id = made[0].body["id"]
            assert call(http, "GET", f"/v1/quotes/{quote_id}", first).status == 200
            assert _sample(live, "cpn_rate_limited_total", limit="quotes") == 2
        finally:
            for client in (net.admin, net.tenant, net.other):
                client.close()
