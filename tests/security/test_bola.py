"""Object-level authorisation: tenant B never reads or touches tenant A's objects, an agent
never reports for another cluster (issue 14, item 9).

Every refusal has its control: the owner gets the same request answered, so a 404 here is
the scoping's and not a wrong path. B's answer for A's object must match its answer for an id
that does not exist (same status, type and title), so the refusal reveals nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.security.conftest import (
    A_MARK,
    B_MARK,
    Answer,
    World,
    assert_problem,
    call,
    unknown_id,
)
from tests.security.routes import Operation, documented
from tests.service.conftest import spec

MEASURED_NOW = datetime.now(UTC).isoformat()
"""A link measurement's time the server takes: now (issue 48 bounds its skew)."""


@dataclass(frozen=True)
class Probe:
    """A request on one of A's objects; `{job}`, `{quote}` and `{tenant}` name it
    (`{job_short}`: the start of the job's id, as tables print it)."""

    method: str
    template: str
    query: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    owner_control: bool = True

    def path(self, job: str, quote: str, tenant: str) -> str:
        return self.template.format(job=job, job_short=job[:8], quote=quote, tenant=tenant)

    def send(self, http: httpx.Client, token: str, job: str, quote: str, tenant: str) -> Answer:
        return call(
            http,
            self.method,
            self.path(job, quote, tenant),
            token,
            headers=dict(self.headers),
            params=dict(self.query),
        )


SSE = (("Accept", "text/event-stream"),)
TENANT_OBJECTS = {
    "job": Probe("GET", "/v1/jobs/{job}"),
    "job events": Probe("GET", "/v1/jobs/{job}/events"),
    "job event stream": Probe("GET", "/v1/jobs/{job}/events", query=(("stream", "true"),)),
    "job event stream by Accept": Probe("GET", "/v1/jobs/{job}/events", headers=SSE),
    "job event stream resumed": Probe(
        "GET", "/v1/jobs/{job}/events", (("stream", "true"),), (("Last-Event-ID", "1"),)
    ),
    "job metrics": Probe("GET", "/v1/jobs/{job}/metrics"),
    "job logs": Probe("GET", "/v1/jobs/{job}/logs"),
    "job log stream": Probe("GET", "/v1/jobs/{job}/logs", query=(("follow", "true"),)),
    "job log stream by Accept": Probe("GET", "/v1/jobs/{job}/logs", headers=SSE),
    "job by a short id": Probe("GET", "/v1/jobs/{job_short}"),
    "job cancel": Probe("POST", "/v1/jobs/{job}/cancel", owner_control=False),
    "job cancel with If-Match": Probe(
        "POST", "/v1/jobs/{job}/cancel", headers=(("If-Match", '"1"'),), owner_control=False
    ),
    "quote": Probe("GET", "/v1/quotes/{quote}"),
    "usage": Probe("GET", "/v1/tenants/{tenant}/usage"),
    "ledger": Probe("GET", "/v1/tenants/{tenant}/ledger"),
}


@pytest.mark.parametrize("name", sorted(TENANT_OBJECTS))
def test_tenant_b_gets_a_404_problem_for_tenant_as_object(
    world: World, http: httpx.Client, name: str
) -> None:
    probe = TENANT_OBJECTS[name]
    mine = (world.job_a, world.quote_a, world.tenant_a_id)
    if probe.owner_control:
        owner = probe.send(http, world.tenant_a, *mine)
        assert 200 <= owner.status < 300, f"control: the owner is refused: {owner}"
    theirs = probe.send(http, world.tenant_b, *mine)
    assert_problem(theirs, 404)
    nothing = probe.send(http, world.tenant_b, unknown_id(), unknown_id(), unknown_id())
    assert_problem(nothing, 404)
    assert (theirs.body["type"], theirs.body["title"]) == (
        nothing.body["type"],
        nothing.body["title"],
    ), "B can tell A's object from one that does not exist"
    assert A_MARK not in theirs.text
    job = call(http, "GET", f"/v1/jobs/{world.job_a}", world.tenant_a).body
    assert job["state"] == "PENDING", "B's request changed A's job"


def test_tenant_as_event_stream_is_readable_by_a_only(world: World, http: httpx.Client) -> None:
    """The control for the stream probes, end to end: A reads its ended job's whole stream."""
    with http.stream(
        "GET",
        f"/v1/jobs/{world.job_a_ended}/events",
        params={"stream": "true"},
        headers={"Authorization": f"Bearer {world.tenant_a}"},
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert "CANCELLED" in text and "event: end" in text
    theirs = call(
        http, "GET", f"/v1/jobs/{world.job_a_ended}/events", world.tenant_b, params={"stream": 1}
    )
    assert_problem(theirs, 404)


ADMIN_ONLY_OBJECTS = {
    "tenant record": ("GET", "/v1/tenants/{tenant}", None),
    "tenant patch": ("PATCH", "/v1/tenants/{tenant}", {"budget": 1e9, "gpu_quota": 100_000}),
    "tenant delete": ("DELETE", "/v1/tenants/{tenant}", None),
    "api key revoke": ("DELETE", "/v1/api-keys/{key}", None),
}


@pytest.mark.parametrize("name", sorted(ADMIN_ONLY_OBJECTS))
def test_tenant_b_cannot_reach_tenant_as_record_or_keys(
    world: World, http: httpx.Client, name: str
) -> None:
    method, template, body = ADMIN_ONLY_OBJECTS[name]
    real = template.format(tenant=world.tenant_a_id, key=world.tenant_a_key_id)
    fake = template.format(tenant=unknown_id(), key=unknown_id())
    theirs = call(http, method, real, world.tenant_b, json=body)
    nothing = call(http, method, fake, world.tenant_b, json=body)
    assert_problem(theirs, 403, 404)
    assert (theirs.status, theirs.body["type"]) == (nothing.status, nothing.body["type"])
    record = call(http, "GET", f"/v1/tenants/{world.tenant_a_id}", world.admin)
    assert record.status == 200 and record.body["gpu_quota"] == 20, "A's record changed"
    assert call(http, "GET", "/v1/jobs", world.tenant_a).status == 200, "A's key was revoked"


LIST_QUERIES = [
    {},
    {"tenant": "{a}"},
    {"state": "PENDING"},
    {"state": "CANCELLED"},
    {"limit": 500},
    {"limit": 500, "offset": 1},
]


@pytest.mark.parametrize(
    "query", LIST_QUERIES, ids=lambda q: "&".join(f"{k}={v}" for k, v in q.items()) or "plain"
)
def test_tenant_bs_job_list_shows_none_of_as_jobs(
    world: World, http: httpx.Client, query: dict[str, object]
) -> None:
    params = {k: str(v).format(a=world.tenant_a_id) for k, v in query.items()}
    page = call(http, "GET", "/v1/jobs", world.tenant_b, params=params)
    assert page.status == 200, str(page)
    ids = {j["id"] for j in page.body["items"]}
    assert not ids & {world.job_a, world.job_a_ended}
    assert {j["tenant_id"] for j in page.body["items"]} <= {world.tenant_b_id}
    plain = call(http, "GET", "/v1/jobs", world.tenant_b, params={"limit": 500}).body
    assert ids <= {j["id"] for j in plain["items"]} and page.body["total"] <= plain["total"]
    everyone = call(http, "GET", "/v1/jobs", world.admin, params={"tenant": world.tenant_a_id})
    assert {world.job_a, world.job_a_ended} <= {j["id"] for j in everyone.body["items"]}


def test_nothing_tenant_b_can_read_mentions_tenant_a(world: World, http: httpx.Client) -> None:
    """Every GET of the document that admits tenants, on B's own objects, read with B's key:
    none of A's ids or seeded text may appear (a route added later is swept too)."""
    mine = {
        "job_id": world.job_b,
        "quote_id": world.quote_b,
        "tenant_id": world.tenant_b_id,
    }
    secrets = {
        world.job_a,
        world.job_a_ended,
        world.quote_a,
        world.tenant_a_id,
        world.tenant_a_key_id,
        A_MARK,
        "acme",
    }
    read = 0
    for op in documented(world):
        if op.method != "GET" or "tenant" not in op.roles:
            continue
        answer = call(http, "GET", op.path(mine), world.tenant_b, params={"limit": 500})
        assert answer.status == 200, f"control: B cannot read its own {op}: {answer}"
        leaked = sorted(s for s in secrets if s in answer.text)
        assert not leaked, f"{op} shows B {leaked}: {answer}"
        read += 1
    assert read >= 7


def test_tenant_bs_own_events_metrics_usage_and_ledger_hold_nothing_of_as(
    world: World, http: httpx.Client
) -> None:
    b = world.tenant_b
    events = call(http, "GET", f"/v1/jobs/{world.job_b}/events", b)
    metrics = call(http, "GET", f"/v1/jobs/{world.job_b}/metrics", b)
    usage = call(http, "GET", f"/v1/tenants/{world.tenant_b_id}/usage", b)
    ledger = call(http, "GET", f"/v1/tenants/{world.tenant_b_id}/ledger", b, params={"limit": 500})
    for answer in (events, metrics, usage, ledger):
        assert answer.status == 200, str(answer)
        assert A_MARK not in answer.text and world.job_a not in answer.text, str(answer)
    assert B_MARK in events.text and B_MARK in ledger.text  # the control: B's own rows are there
    assert [m["wan_bytes"] for m in metrics.body["items"]] == [222]
    assert usage.body["gpu_seconds"] == 222
    assert {e["job_id"] for e in ledger.body["items"]} == {world.job_b}
    mine = call(http, "GET", f"/v1/tenants/{world.tenant_a_id}/usage", world.tenant_a)
    assert mine.body["gpu_seconds"] == 111


def test_an_idempotency_key_is_per_tenant(world: World, http: httpx.Client) -> None:
    """B reusing A's Idempotency-Key gets a job of its own, never A's."""
    key = {"Idempotency-Key": f"shared-{unknown_id()}"}
    body = spec(name="same-key")
    a = call(http, "POST", "/v1/jobs", world.tenant_a, json=body, headers=key)
    b = call(http, "POST", "/v1/jobs", world.tenant_b, json=body, headers=key)
    assert a.status == 201 and b.status == 201, f"{a}\n{b}"
    assert a.body["id"] != b.body["id"]
    assert (a.body["tenant_id"], b.body["tenant_id"]) == (world.tenant_a_id, world.tenant_b_id)
    for job, token in ((a.body["id"], world.tenant_a), (b.body["id"], world.tenant_b)):
        assert call(http, "POST", f"/v1/jobs/{job}/cancel", token).status == 200


def test_tenant_b_cannot_hold_tenant_as_quote(world: World, http: httpx.Client) -> None:
    before = call(http, "GET", "/v1/jobs", world.tenant_b).body["total"]
    for path in ("/v1/jobs", "/v1/quotes"):
        answer = call(http, "POST", path, world.tenant_b, json=spec(quote_id=world.quote_a))
        if path == "/v1/jobs":
            assert_problem(answer, 404, field="quote_id")
        else:
            assert answer.status in (201, 404, 422), str(answer)
            assert world.quote_a not in answer.text
    assert call(http, "GET", "/v1/jobs", world.tenant_b).body["total"] == before


# ---- agents ---------------------------------------------------------------------------------


def _cluster(http: httpx.Client, world: World, name: str) -> dict[str, object]:
    answer = call(http, "GET", f"/v1/clusters/{name}", world.admin)
    assert answer.status == 200, str(answer)
    return dict(answer.body)


def _measured(http: httpx.Client, world: World, name: str) -> list[object]:
    params = {"view": "measured", "cluster": name}
    answer = call(http, "GET", "/v1/links", world.admin, params=params)
    assert answer.status == 200, str(answer)
    return [(k["src"], k["dst"], k["bandwidth_gbps"]) for k in answer.body["items"]]


def test_an_agent_cannot_heartbeat_for_another_cluster(world: World, http: httpx.Client) -> None:
    x, y = world.cluster_x, world.cluster_y
    before = _cluster(http, world, y)
    beat = {
        "cluster": y,
        "probe_url": "http://10.0.0.7:8500/",
        "gpus": [{"model": "H100", "memory_gib": 80, "count": 999, "allocatable": 999}],
    }
    answer = call(http, "POST", "/v1/agent/heartbeat", world.agent_x, json=beat)
    assert_problem(answer, 403, field="cluster")
    assert _cluster(http, world, y) == before, "X's key changed Y"
    own = call(http, "POST", "/v1/agent/heartbeat", world.agent_x, json={**beat, "cluster": x})
    assert own.status == 200, f"control: X cannot beat for itself: {own}"
    restore = {"model": "A100", "memory_gib": 80, "count": 8, "allocatable": 8}
    call(http, "POST", "/v1/agent/heartbeat", world.agent_x, json={"cluster": x, "gpus": [restore]})


def test_an_agent_cannot_report_links_for_another_cluster(world: World, http: httpx.Client) -> None:
    x, y = world.cluster_x, world.cluster_y
    before = _measured(http, world, y)
    link = {
        "dst": x,
        "bandwidth_gbps": 99_999,
        "rtt_ms": 0,
        "bytes_transferred": 1,
        "measured_at": MEASURED_NOW,
    }
    answer = call(
        http, "POST", "/v1/agent/links", world.agent_x, json={"cluster": y, "links": [link]}
    )
    assert_problem(answer, 403, field="cluster")
    assert _measured(http, world, y) == before, "X's key stored links for Y"
    same = {**link, "bandwidth_gbps": 10, "rtt_ms": 70}  # as declared: the network stays as it was
    own = call(http, "POST", "/v1/agent/links", world.agent_y, json={"cluster": y, "links": [same]})
    assert own.status == 200, f"control: Y cannot report its own links: {own}"
    assert (y, x, 10.0) in _measured(http, world, y)


def test_provider_q_gets_a_404_problem_for_everything_of_provider_p(
    world: World, http: httpx.Client
) -> None:
    """Every route that admits providers and names one, with P's id and Q's key (and a body
    P's own call would be answered with): a 404 shaped like the answer for an id that does not
    exist; P's own key is answered (the control)."""
    bodies = {"/v1/providers/{provider_id}/slas": {"cluster": "prov-p", "credit_rate": 0.1,
                                                   "uptime": 0.99}}  # fmt: skip
    checked = 0
    for op in documented(world):
        if "provider" not in op.roles or "provider_id" not in op.params:
            continue
        body = bodies.get(op.template) if op.method == "POST" else None

        def send(provider: str, token: str, op: Operation = op, body: Any = body) -> Answer:
            return call(http, op.method, op.path({"provider_id": provider}), token, json=body)

        mine = send(world.provider_p_id, world.provider_p)
        assert mine.status in (200, 201), f"control: P cannot use its own {op}: {mine}"
        theirs = send(world.provider_p_id, world.provider_q)
        nothing = send(unknown_id(), world.provider_q)
        assert_problem(theirs, 404)
        assert (theirs.status, theirs.body.get("type"), theirs.body.get("title")) == (
            nothing.status,
            nothing.body.get("type"),
            nothing.body.get("title"),
        ), op
        assert "prov-p" not in theirs.text, op
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/pricing/gpu",
            {
                "cluster": "prov-p",
                "gpu_model": "A100",
                "qos_class": "spot",
                "price_per_gpu_hour": 0,
            },
        ),
        (
            "/v1/pricing/egress",
            {"src": "prov-p", "dst": "prov-q", "price_per_gb": 0, "symmetric": False},
        ),
        (
            "/v1/pricing/gpu",
            {
                "cluster": "us-east",
                "gpu_model": "A100",
                "qos_class": "spot",
                "price_per_gpu_hour": 0,
            },
        ),
    ],
)
def test_a_provider_cannot_price_a_cluster_it_does_not_own(
    world: World, http: httpx.Client, path: str, body: dict[str, object]
) -> None:
    """Q on P's cluster, or on the operator's: a 404 naming the field, as for no cluster."""
    field = "cluster" if "cluster" in body else "src"
    assert_problem(call(http, "POST", path, world.provider_q, json=body), 404, field=field)


def test_what_a_provider_reads_mentions_no_tenant(world: World, http: httpx.Client) -> None:
    """Every GET a provider may call, with P's key: no tenant's ids, names or seeded text."""
    secrets = {
        world.job_a,
        world.job_b,
        world.quote_a,
        world.tenant_a_id,
        world.tenant_b_id,
        A_MARK,
        B_MARK,
        "acme",
        "globex",
        "prov-q",
        world.provider_q_id,
    }
    read = 0
    for op in documented(world):
        if op.method != "GET" or "provider" not in op.roles or op.template == "/v1/pricing":
            continue
        answer = call(
            http,
            "GET",
            op.path({"provider_id": world.provider_p_id}),
            world.provider_p,
            params={"limit": 500} if "limit" in str(op.spec) else None,
        )
        assert answer.status == 200, f"control: P cannot read its own {op}: {answer}"
        leaked = sorted(s for s in secrets if s in answer.text)
        assert not leaked, f"{op} shows provider P {leaked}: {answer}"
        read += 1
    assert read >= 5
