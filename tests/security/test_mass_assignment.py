"""Mass assignment: a body sets only what its caller may set (issue 14, item 9).

Every request body of the live app refuses a field it does not declare with a 422 problem
naming that field (checked from the OpenAPI document, so a new body is covered); the fields a
caller must never choose (its tenant, a job's state, a key's secret...) are refused by name and
nothing is stored. Priority ceilings are issue 14's item 2, not checked here yet.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.security.conftest import World, assert_problem, call, problem_issues
from tests.security.routes import documented
from tests.service.conftest import spec

MEASURED_NOW = datetime.now(UTC).isoformat()
"""A link measurement's time the server takes: now (issue 48 bounds its skew)."""

EXTRA = "cpn_not_a_field"


def test_every_body_refuses_a_field_it_does_not_declare(world: World, http: httpx.Client) -> None:
    failures = []
    checked = 0
    for op in documented(world):
        if "requestBody" not in op.spec:
            continue
        checked += 1
        role = sorted(op.roles)[0]
        answer = call(
            http, op.method, op.path(world.path_values()), world.token(role), json={EXTRA: 1}
        )
        issues = problem_issues(answer, (422,), field=EXTRA)
        if issues:
            failures.append(f"{op}: {'; '.join(issues)} ({answer.text[:160]})")
    assert checked >= 10
    assert not failures, "\n".join(failures)


JOB_FIELDS_A_TENANT_MUST_NOT_SET = [
    ("tenant_id", "{b}"),
    ("tenant", "{b}"),
    ("owner", "replica-1"),
    ("id", "00000000-0000-0000-0000-000000000000"),
    ("state", "RUNNING"),
    ("reason", "approved by admin"),
    ("version", 99),
    ("attempts", 0),
    ("placement", {"clusters": ["us-east"]}),
    ("held_price", {"price": {"total": 0}}),
    ("preempted_by", "{b}"),
    ("idempotency_key", "k"),
    ("created_at", "2020-01-01T00:00:00Z"),
    ("qos_class", "guaranteed"),
]


def _jobs_total(http: httpx.Client, token: str) -> int:
    answer = call(http, "GET", "/v1/jobs", token)
    assert answer.status == 200, str(answer)
    return int(answer.body["total"])


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/quotes"])
@pytest.mark.parametrize(
    ("field", "value"),
    JOB_FIELDS_A_TENANT_MUST_NOT_SET,
    ids=[f for f, _ in JOB_FIELDS_A_TENANT_MUST_NOT_SET],
)
def test_a_tenant_cannot_set_a_jobs_server_fields(
    world: World, http: httpx.Client, path: str, field: str, value: Any
) -> None:
    if isinstance(value, str):
        value = value.format(b=world.tenant_b_id)
    before = (_jobs_total(http, world.tenant_a), _jobs_total(http, world.tenant_b))
    answer = call(http, "POST", path, world.tenant_a, json={**spec(), field: value})
    assert_problem(answer, 422, field=field)
    assert (_jobs_total(http, world.tenant_a), _jobs_total(http, world.tenant_b)) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"qos": {"tenant_id": "{b}"}}, "qos.tenant_id"),
        ({"qos": {"granted_priority": 1000}}, "qos.granted_priority"),
        ({"task": "pkg.mod:main", "work": {"params": 1, "flops_per_step": 1, "x": 1}}, "work.x"),
    ],
    ids=["qos.tenant_id", "qos.granted_priority", "work.x"],
)
def test_nested_job_fields_are_closed_too(
    world: World, http: httpx.Client, body: dict[str, Any], field: str
) -> None:
    qos = body.get("qos")
    if isinstance(qos, dict):
        body = {**body, "qos": {k: str(v).format(b=world.tenant_b_id) for k, v in qos.items()}}
    answer = call(http, "POST", "/v1/jobs", world.tenant_a, json={**spec(), **body})
    assert_problem(answer, 422, field=field)


ADMIN_BODIES = [
    ("POST", "/v1/clusters", {"name": "ma-1", "region": "r"}, "state", "READY"),
    ("POST", "/v1/clusters", {"name": "ma-2", "region": "r"}, "cordoned", True),
    ("POST", "/v1/clusters", {"name": "ma-3", "region": "r"}, "version", 7),
    ("POST", "/v1/clusters", {"name": "ma-4", "region": "r"}, "probe_url", "http://x/"),
    ("PATCH", "/v1/clusters/{cluster}", {}, "name", "renamed"),
    ("PATCH", "/v1/clusters/{cluster}", {}, "state", "READY"),
    ("PATCH", "/v1/clusters/{cluster}", {}, "lease_expires_at", "2999-01-01T00:00:00Z"),
    ("POST", "/v1/tenants", {"name": "ma-t"}, "id", "00000000-0000-0000-0000-000000000000"),
    ("PATCH", "/v1/tenants/{tenant}", {}, "name", "renamed"),
    ("PATCH", "/v1/tenants/{tenant}", {}, "id", "00000000-0000-0000-0000-000000000000"),
    ("POST", "/v1/api-keys", {"role": "admin"}, "token", "cpn_admin_chosen-by-the-caller-123456"),
    ("POST", "/v1/api-keys", {"role": "admin"}, "key_hash", "0" * 64),
    ("POST", "/v1/api-keys", {"role": "admin"}, "prefix", "cpn_admin_"),
    ("POST", "/v1/api-keys", {"role": "admin"}, "revoked_at", None),
    ("PATCH", "/v1/links/{link}", {}, "source", "measured"),
    ("PATCH", "/v1/links/{link}", {}, "src", "eu-west"),
]


@pytest.mark.parametrize(
    ("method", "template", "body", "field", "value"),
    ADMIN_BODIES,
    ids=[f"{m} {t} {f}" for m, t, _, f, _ in ADMIN_BODIES],
)
def test_admin_bodies_refuse_server_fields(
    world: World,
    http: httpx.Client,
    method: str,
    template: str,
    body: dict[str, Any],
    field: str,
    value: Any,
) -> None:
    path = template.format(
        cluster=world.victim_cluster, tenant=world.victim_tenant, link=world.victim_link
    )
    before = call(http, "GET", path, world.admin) if method == "PATCH" else None
    answer = call(http, method, path, world.admin, json={**body, field: value})
    assert_problem(answer, 422, field=field)
    if before is not None:
        assert call(http, "GET", path, world.admin).body == before.body
    if field == "token":
        chosen = call(http, "GET", "/v1/clusters", "cpn_admin_chosen-by-the-caller-123456")
        assert_problem(chosen, 401)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/agent/heartbeat", {"cluster": "us-east", "state": "READY"}, "state"),
        (
            "/v1/agent/heartbeat",
            {"cluster": "us-east", "lease_expires_at": "2999-01-01T00:00:00Z"},
            "lease_expires_at",
        ),
        (
            "/v1/agent/heartbeat",
            {
                "cluster": "us-east",
                "gpus": [
                    {"model": "A100", "memory_gib": 80, "count": 8, "allocatable": 8, "in_use": 0}
                ],
            },
            "gpus.0.in_use",
        ),
        ("/v1/agent/links", {"cluster": "us-east", "links": [], "source": "declared"}, "source"),
        (
            "/v1/agent/links",
            {
                "cluster": "us-east",
                "links": [
                    {
                        "dst": "eu-west",
                        "bandwidth_gbps": 1,
                        "rtt_ms": 1,
                        "bytes_transferred": 1,
                        "measured_at": MEASURED_NOW,
                        "egress_price_per_gb": 0,
                    }
                ],
            },
            "links.0.egress_price_per_gb",
        ),
    ],
    ids=["heartbeat state", "heartbeat lease", "gpu in_use", "links source", "link egress price"],
)
def test_agent_reports_refuse_fields_the_controller_owns(
    world: World, http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    answer = call(http, "POST", path, world.agent_x, json=body)
    assert_problem(answer, 422, field=field)
