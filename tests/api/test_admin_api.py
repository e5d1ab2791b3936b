"""Admin API over a real server, on SQLite and PostgreSQL."""

from __future__ import annotations

import httpx
import pytest

from api.client import ApiError
from tests.conftest import LiveServer


def problem_of(exc: pytest.ExceptionInfo[ApiError]) -> ApiError:
    return exc.value


def test_cluster_crud_and_validation(live_server: LiveServer) -> None:
    with live_server.client() as c:
        created = c.create_cluster("us-east", "us-east-1", tier="gold")
        assert created["state"] == "PENDING" and created["labels"] == {"tier": "gold"}
        with pytest.raises(ApiError) as dup:
            c.create_cluster("us-east", "elsewhere")
        assert dup.value.status == 409 and "us-east" in dup.value.detail
        with pytest.raises(ApiError) as bad:
            c.post("/v1/clusters", {"name": "Not A Name!", "region": ""})
        assert bad.value.status == 422
        fields = {e["field"] for e in bad.value.errors}
        assert fields == {"name", "region"}
        got = c.get("/v1/clusters/us-east")
        assert got["region"] == "us-east-1"
        patched = c.request("PATCH", "/v1/clusters/us-east", json={"region": "us-east-2"})
        assert patched["region"] == "us-east-2"
        with pytest.raises(ApiError) as missing:
            c.get("/v1/clusters/nope")
        assert missing.value.status == 404
        assert c.request("DELETE", "/v1/clusters/us-east") is None
        assert c.clusters() == []
    # The duplicate and the invalid request stored nothing half-way.
    with live_server.client() as c:
        audit = c.get("/v1/audit")["items"]
        assert [a["action"] for a in audit] == [
            "cluster.delete",
            "cluster.update",
            "cluster.create",
        ]


def test_if_match_refuses_stale_writes(live_server: LiveServer) -> None:
    with live_server.client() as c:
        c.create_cluster("eu-west", "eu-west-1")
        r = httpx.get(
            f"{live_server.url}/v1/clusters/eu-west",
            headers={"Authorization": f"Bearer {live_server.admin_token}"},
        )
        etag = r.headers["ETag"]
        c.request(
            "PATCH", "/v1/clusters/eu-west", json={"labels": {"a": "1"}}, headers={"If-Match": etag}
        )
        with pytest.raises(ApiError) as stale:
            c.request(
                "PATCH",
                "/v1/clusters/eu-west",
                json={"labels": {"a": "2"}},
                headers={"If-Match": etag},
            )
        assert stale.value.status == 412
        assert c.get("/v1/clusters/eu-west")["labels"] == {"a": "1"}


def test_problems_are_rfc9457(live_server: LiveServer) -> None:
    r = httpx.post(
        f"{live_server.url}/v1/clusters",
        headers={"Authorization": f"Bearer {live_server.admin_token}"},
        content=b"{not json",
    )
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert {"type", "title", "status", "detail"} <= body.keys() and body["status"] == 422


def test_oversized_body_is_refused(live_server: LiveServer) -> None:
    big = b'{"name": "x", "region": "' + b"a" * (2 * 1024 * 1024) + b'"}'
    r = httpx.post(
        f"{live_server.url}/v1/clusters",
        headers={
            "Authorization": f"Bearer {live_server.admin_token}",
            "Content-Type": "application/json",
        },
        content=big,
    )
    assert r.status_code == 413 and r.json()["status"] == 413
    with live_server.client() as c:
        assert c.clusters() == []


def test_links_declared_validation_and_cordon(live_server: LiveServer) -> None:
    with live_server.client() as c:
        for name in ("a", "b"):
            c.create_cluster(name, "r")
        made = c.declare_link("a", "b", bandwidth_gbps=1.0, rtt_ms=40, egress_price_per_gb=0.02)
        assert {(k["src"], k["dst"]) for k in made} == {("a", "b"), ("b", "a")}
        with pytest.raises(ApiError) as neg:
            c.declare_link("a", "b", bandwidth_gbps=-1, rtt_ms=1)
        assert neg.value.status == 422 and neg.value.errors[0]["field"] == "bandwidth_gbps"
        with pytest.raises(ApiError) as unknown:
            c.declare_link("a", "zz", bandwidth_gbps=1, rtt_ms=1)
        assert unknown.value.status == 404 and "zz" in unknown.value.detail
        with pytest.raises(ApiError) as self_link:
            c.declare_link("a", "a", bandwidth_gbps=1, rtt_ms=1)
        assert self_link.value.status == 422
        assert len(c.links()) == 2  # the failed requests left nothing behind
        assert c.post("/v1/clusters/a/cordon")["cordoned"] is True
        drained = c.post("/v1/clusters/b/drain")
        assert drained["cordoned"] and drained["draining"]
        assert c.post("/v1/clusters/a/uncordon")["cordoned"] is False


def test_pagination(live_server: LiveServer) -> None:
    with live_server.client() as c:
        for i in range(7):
            c.create_cluster(f"c{i}", "r")
        page = c.get("/v1/clusters", limit=3, offset=3)
        assert page["total"] == 7 and [x["name"] for x in page["items"]] == ["c3", "c4", "c5"]
        assert [x["name"] for x in c.paginate("/v1/clusters", page_size=2)] == [
            f"c{i}" for i in range(7)
        ]
        with pytest.raises(ApiError) as bad:
            c.get("/v1/clusters", limit=0)
        assert bad.value.status == 422 and bad.value.errors[0]["field"] == "query.limit"


def test_roles_and_revocation(live_server: LiveServer) -> None:
    with live_server.client() as admin:
        tenant = admin.post("/v1/tenants", {"name": "acme", "gpu_quota": 16})
        tkey = admin.create_api_key("tenant", tenant["id"], "acme key")
        admin.create_cluster("a", "r")
        admin.create_cluster("b", "r")
        akey = admin.create_api_key("agent", "a")
        assert tkey["token"].startswith("cpn_tenant_")
        listed = admin.get("/v1/api-keys")["items"]
        assert all("token" not in k for k in listed)

    with live_server.client(tkey["token"]) as tenant_client:
        with pytest.raises(ApiError) as forbidden:
            tenant_client.clusters()
        assert forbidden.value.status == 403
        with pytest.raises(ApiError) as forbidden_write:
            tenant_client.create_cluster("evil", "r")
        assert forbidden_write.value.status == 403

    hb = {"cluster": "b", "gpus": []}
    with live_server.client(akey["token"]) as agent_client:
        with pytest.raises(ApiError) as other:
            agent_client.post("/v1/agent/heartbeat", hb)
        assert other.value.status == 403 and "'a'" in other.value.detail
        with pytest.raises(ApiError) as admin_only:
            agent_client.clusters()
        assert admin_only.value.status == 403
        assert (
            agent_client.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})["state"]
            == "READY"
        )

    with live_server.client() as admin:
        admin.request("DELETE", f"/v1/api-keys/{akey['id']}")
    with live_server.client(akey["token"]) as agent_client, pytest.raises(ApiError) as revoked:
        agent_client.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})
    assert revoked.value.status == 401
    with live_server.client("cpn_admin_garbage") as nobody, pytest.raises(ApiError) as unknown:
        nobody.clusters()
    assert unknown.value.status == 401
    r = httpx.get(f"{live_server.url}/v1/clusters")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_key_scope_rules(live_server: LiveServer) -> None:
    with live_server.client() as admin:
        for body, field in (
            ({"role": "agent", "scope": "no-such-cluster"}, "scope"),
            ({"role": "tenant"}, "scope"),
            ({"role": "admin", "scope": "x"}, "scope"),
            ({"role": "root"}, "role"),
        ):
            with pytest.raises(ApiError) as exc:
                admin.post("/v1/api-keys", body)
            assert exc.value.status == 422 and exc.value.errors[0]["field"] == field
        assert admin.get("/v1/api-keys")["total"] == 1  # only the bootstrap admin key


def test_health_ready_metrics_docs(live_server: LiveServer) -> None:
    assert httpx.get(f"{live_server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{live_server.url}/readyz").status_code == 200
    metrics = httpx.get(f"{live_server.url}/metrics").text
    assert "cpn_http_requests_total" in metrics and 'cpn_clusters{state="READY"}' in metrics
    assert 'cpn_jobs{state="PENDING"}' in metrics
    spec = httpx.get(f"{live_server.url}/openapi.json").json()
    assert "/v1/agent/heartbeat" in spec["paths"] and "/v1/clusters/{name}/drain" in spec["paths"]
    assert httpx.get(f"{live_server.url}/docs").status_code == 200


def test_if_match_survives_heartbeats_but_not_a_state_change(live_server: LiveServer) -> None:
    """An agent renews its lease every few seconds; an admin's conditional write must still
    be able to win (cpn apply sends If-Match), while a real change of the cluster refuses it."""
    with live_server.client() as admin:
        admin.create_cluster("eu-west", "eu-west-1")
        token = admin.create_api_key("agent", "eu-west")["token"]
    hb = {"cluster": "eu-west", "gpus": []}
    with live_server.client(token) as agent, live_server.client() as admin:
        assert agent.post("/v1/agent/heartbeat", hb)["state"] == "READY"  # PENDING -> READY
        url = f"{live_server.url}/v1/clusters/eu-west"
        auth = {"Authorization": f"Bearer {live_server.admin_token}"}
        before = httpx.get(url, headers=auth)
        agent.post("/v1/agent/heartbeat", hb)  # a renewal
        after = httpx.get(url, headers=auth)
        assert after.json()["last_heartbeat_at"] != before.json()["last_heartbeat_at"]
        etag = after.headers["ETag"]
        assert etag == before.headers["ETag"]
        admin.request(
            "PATCH", "/v1/clusters/eu-west", json={"labels": {"a": "1"}}, headers={"If-Match": etag}
        )
        admin.request("POST", "/v1/clusters/eu-west/cordon")
        fresh = httpx.get(url, headers=auth).headers["ETag"]
        assert fresh != etag  # the cordon changed the cluster
        admin.request(
            "PATCH",
            "/v1/clusters/eu-west",
            json={"labels": {"a": "2"}},
            headers={"If-Match": fresh},
        )
        with pytest.raises(ApiError) as old:
            admin.request(
                "PATCH",
                "/v1/clusters/eu-west",
                json={"labels": {"a": "3"}},
                headers={"If-Match": etag},
            )
        assert old.value.status == 412
        assert admin.get("/v1/clusters/eu-west")["labels"] == {"a": "2"}


def test_admins_see_each_uplink_and_downlink_and_what_is_reserved_of_it(
    live_server: LiveServer,
) -> None:
    """`GET /v1/network/ports` and `/metrics` show a declared capacity, what is reserved of it
    (written by the placement's own `reserve_wan`) and what is left; tenants are refused."""
    from sqlalchemy import select

    from controller.network.allocations import reserve_wan
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.models import Cluster

    with live_server.client() as admin:
        admin.create_cluster("hub", "r", uplink_gbps="10", downlink_gbps="4")
        admin.create_cluster("edge", "r")  # nothing declared, nothing reserved: not listed
        tenant = admin.post("/v1/tenants", {"name": "acme"})
        tkey = admin.create_api_key("tenant", tenant["id"], "acme key")
        before = admin.ports()
    assert [(p["cluster"], p["direction"], p["capacity_gbps"], p["free_gbps"]) for p in before] == [
        ("hub", "up", 10.0, 10.0),
        ("hub", "down", 4.0, 4.0),
    ]
    engine = make_engine(live_server.database_url)
    with make_sessionmaker(engine)() as s, s.begin():
        hub = s.scalars(select(Cluster.id).where(Cluster.name == "hub")).one()
        reserve_wan(s, hub, "hub", 1_500_000)  # 1.5 Gbit/s both ways
    engine.dispose()
    with live_server.client() as admin:
        after = {p["direction"]: p for p in admin.ports()}
    metrics = httpx.get(f"{live_server.url}/metrics").text
    assert after["up"]["reserved_gbps"] == 1.5 and after["up"]["free_gbps"] == 8.5
    assert after["down"]["reserved_gbps"] == 1.5 and after["down"]["free_gbps"] == 2.5
    port = 'cpn_wan_port_bytes_per_second{cluster="hub",direction="down",kind="%s"}'
    assert f"{port % 'reserved'} 1.875e+08" in metrics  # 1.5 Gbit/s
    assert f"{port % 'capacity'} 5e+08" in metrics
    with live_server.client(tkey["token"]) as tenant_client, pytest.raises(ApiError) as refused:
        tenant_client.ports()
    assert refused.value.status == 403
    from typer.testing import CliRunner

    from api.cli import app

    auth = ["--url", live_server.url, "--token", live_server.admin_token]
    table = CliRunner().invoke(app, ["ports", *auth], env={"COLUMNS": "160"})
    assert table.exit_code == 0, table.output
    [row] = [line for line in table.output.splitlines() if " up " in line]
    assert "hub" in row and "10.000" in row and "1.500" in row and "8.500" in row


def test_tenants_are_named_by_id_or_name(live_server: LiveServer) -> None:
    """Where a user types a tenant, its name does as well as its id (issue 51, item 2), and
    scoping holds by either: another tenant's usage by name is a 404 too."""
    from typer.testing import CliRunner

    from api.cli import app

    with live_server.client() as admin:
        acme = admin.post("/v1/tenants", {"name": "acme"})
        globex = admin.post("/v1/tenants", {"name": "globex"})
        assert admin.get("/v1/tenants/acme")["id"] == acme["id"]
        assert admin.request("PATCH", "/v1/tenants/acme", json={"gpu_quota": 7})["gpu_quota"] == 7
        key = admin.create_api_key("tenant", "acme")
        assert key["scope"] == acme["id"]  # stored by id
        assert admin.get("/v1/tenants/acme/usage")["tenant_id"] == acme["id"]
        assert admin.get("/v1/jobs", tenant="acme")["total"] == 0
        with pytest.raises(ApiError) as missing:
            admin.get("/v1/tenants/nobody")
        assert missing.value.status == 404 and "an id or a name" in missing.value.detail
    with live_server.client(key["token"]) as tenant:
        assert tenant.get("/v1/tenants/acme/ledger")["total"] == "0.000000"
        for ref in ("globex", globex["id"]):
            with pytest.raises(ApiError) as hidden:
                tenant.get(f"/v1/tenants/{ref}/usage")
            assert hidden.value.status == 404
    auth = ["--url", live_server.url, "--token", live_server.admin_token]
    used = CliRunner().invoke(app, ["usage", "--tenant", "acme", "-o", "json", *auth])
    assert used.exit_code == 0, used.output
    assert acme["id"] in used.output
    with live_server.client() as admin:
        admin.request("DELETE", "/v1/tenants/globex")
        assert [t["name"] for t in admin.paginate("/v1/tenants")] == ["acme"]
