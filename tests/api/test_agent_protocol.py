"""The agent protocol's server side and the lease monitor, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from api.client import ApiError, Client
from api.processes import wait_until
from tests.conftest import LiveServer, start_server

INTERVAL, GRACE = 0.4, 1.6


@pytest.fixture
def discovering(db_url: str) -> Iterator[LiveServer]:
    """A control plane whose agents probe every other cluster (CPN_LINK_DISCOVERY): the tests
    of what peers are told, whatever links are declared."""
    live = start_server(database_url=db_url, link_discovery=True)
    yield live
    live.stop()


@pytest.fixture
def fast_lease_server(db_url: str) -> Iterator[LiveServer]:
    live = start_server(
        database_url=db_url,
        heartbeat_interval_s=INTERVAL,
        lease_grace_s=GRACE,
        monitor_interval_s=0.05,
    )
    yield live
    live.stop()


def _agent(live: LiveServer, name: str) -> Client:
    with live.client() as admin:
        admin.create_cluster(name, "r1")
        token = admin.create_api_key("agent", name)["token"]
    return live.client(token)


def test_heartbeat_syncs_gpus_and_lists_peers(discovering: LiveServer) -> None:
    a, b = _agent(discovering, "a"), _agent(discovering, "b")
    gpus = [{"model": "A100-80GB", "memory_gib": 80, "count": 8, "allocatable": 6}]
    ack_a = a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": gpus, "probe_url": "http://x:1"})
    assert ack_a["state"] == "READY" and ack_a["peers"] == []
    ack_b = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": [], "probe_url": "http://y:2"})
    assert ack_b["peers"] == [{"cluster": "a", "probe_url": "http://x:1"}]
    with discovering.client() as admin:
        got = admin.get("/v1/clusters/a")
        assert got["gpus"][0]["allocatable"] == 6 and got["gpus"][0]["in_use"] == 0
        totals = admin.get("/v1/gpus/totals")
        assert totals == [
            {"model": "A100-80GB", "count": 8, "allocatable": 6, "in_use": 0, "clusters": 1}
        ]
    # A changed inventory replaces the old one; a duplicate model is refused whole.
    a.post(
        "/v1/agent/heartbeat", {"cluster": "a", "gpus": [{**gpus[0], "count": 4, "allocatable": 4}]}
    )
    with pytest.raises(ApiError) as dup:
        a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [gpus[0], gpus[0]]})
    assert dup.value.status == 422
    with discovering.client() as admin:
        assert admin.get("/v1/clusters/a")["gpus"][0]["count"] == 4


def test_measured_links_replace_declared_and_keep_both(live_server: LiveServer) -> None:
    a = _agent(live_server, "a")
    _agent(live_server, "b")
    with live_server.client() as admin:
        admin.declare_link("a", "b", bandwidth_gbps=10, rtt_ms=50, egress_price_per_gb=0.05)
    now = datetime.now(UTC).isoformat()
    report: dict[str, Any] = {
        "cluster": "a",
        "links": [
            {
                "dst": "b",
                "bandwidth_gbps": 0.8,
                "free_gbps": 0.3,  # the path's traffic took the rest when the probe ran
                "rtt_ms": 31.5,
                "bytes_transferred": 4 << 20,
                "measured_at": now,
            }
        ],
    }
    assert a.post("/v1/agent/links", report) == {"stored": 1}
    with live_server.client() as admin:
        effective = {(k["src"], k["dst"]): k for k in admin.links()}
        assert effective[("a", "b")]["source"] == "measured"
        assert effective[("a", "b")]["bandwidth_gbps"] == 0.8  # the capacity
        assert effective[("a", "b")]["free_gbps"] == 0.3  # and what was free when measured
        assert effective[("a", "b")]["egress_price_per_gb"] == 0.05  # the declared price holds
        assert effective[("b", "a")]["source"] == "declared"
        assert effective[("b", "a")]["free_gbps"] is None  # declared: a capacity only
        assert len(admin.links("all")) == 3
    metrics = httpx.get(f"{live_server.url}/metrics").text
    assert 'cpn_link_free_bytes_per_second{dst="b",src="a"} 3.75e+07' in metrics
    # A pinned declaration wins over measurements (e.g. probes that cannot see the real WAN).
    with live_server.client() as admin:
        admin.declare_link("a", "b", bandwidth_gbps=0.2, rtt_ms=45, pinned=True, symmetric=False)
        effective = {(k["src"], k["dst"]): k for k in admin.links()}
        assert effective[("a", "b")]["source"] == "declared" and effective[("a", "b")]["pinned"]
        assert effective[("a", "b")]["bandwidth_gbps"] == 0.2
        measured = next(k for k in admin.links("measured"))
        with pytest.raises(ApiError) as pin_measured:
            admin.request("PATCH", f"/v1/links/{measured['id']}", json={"pinned": True})
        assert pin_measured.value.status == 422
    bad = {**report, "links": [{**report["links"][0], "dst": "mars"}]}
    with pytest.raises(ApiError) as unknown:
        a.post("/v1/agent/links", bad)
    assert unknown.value.status == 422 and unknown.value.errors[0]["field"] == "links.dst"
    negative = {**report, "links": [{**report["links"][0], "bandwidth_gbps": -5}]}
    with pytest.raises(ApiError) as neg:
        a.post("/v1/agent/links", negative)
    assert neg.value.status == 422 and neg.value.errors[0]["field"] == "links.0.bandwidth_gbps"


def test_a_link_report_must_be_timely_and_a_replay_never_wins(live_server: LiveServer) -> None:
    """Issue 48: `measured_at` in year 9999 or year 1 was accepted, and a report stamped in
    2000 replaced a newer one as the link in use. Now a stamp outside a bounded skew of the
    server's clock is a 422 naming it, and an older report leaves the newer link in force."""
    a = _agent(live_server, "a")
    _agent(live_server, "b")
    with live_server.client() as admin:
        admin.declare_link("a", "b", bandwidth_gbps=10, rtt_ms=20, egress_price_per_gb=0.01)

    def link(at: datetime, gbps: float) -> dict[str, Any]:
        one = {"dst": "b", "bandwidth_gbps": gbps, "rtt_ms": 20.0, "bytes_transferred": 1024}
        return {"cluster": "a", "links": [{**one, "measured_at": at.isoformat()}]}

    now = datetime.now(UTC)
    for far in (now + timedelta(days=1), now - timedelta(days=30)):
        with pytest.raises(ApiError) as skewed:
            a.post("/v1/agent/links", link(far, 9.0))
        assert skewed.value.status == 422
        assert skewed.value.errors[0]["field"] == "links[0].measured_at"
    assert a.post("/v1/agent/links", link(now, 2.0)) == {"stored": 1}
    assert a.post("/v1/agent/links", link(now - timedelta(minutes=5), 50.0)) == {"stored": 1}
    with live_server.client() as admin:
        measured = [k for k in admin.links("measured") if (k["src"], k["dst"]) == ("a", "b")]
    assert [k["bandwidth_gbps"] for k in measured] == [2.0]  # the newer one stays in force


def test_an_agent_measures_only_declared_links(live_server: LiveServer) -> None:
    """Issue 48: an agent could create a 100,000 Gbit/s, RTT 0, free link to a cluster with
    no declared link; without CPN_LINK_DISCOVERY it measures declared links only."""
    a = _agent(live_server, "a")
    b = _agent(live_server, "b")
    fake = {"dst": "b", "bandwidth_gbps": 100_000, "rtt_ms": 0, "bytes_transferred": 1024}
    report = {"cluster": "a", "links": [{**fake, "measured_at": datetime.now(UTC).isoformat()}]}
    with pytest.raises(ApiError) as undeclared:
        a.post("/v1/agent/links", report)
    assert undeclared.value.status == 422
    assert undeclared.value.errors[0]["field"] == "links[0].dst"
    beat = {"cluster": "b", "gpus": [], "probe_url": "http://b:1"}
    assert b.post("/v1/agent/heartbeat", beat)["peers"] == []
    with live_server.client() as admin:
        assert admin.links("measured") == []
        admin.declare_link("b", "a", bandwidth_gbps=1, rtt_ms=30, egress_price_per_gb=0.01)
    assert a.post("/v1/agent/links", report) == {"stored": 1}  # either direction declares it
    ack = a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})
    assert [p["cluster"] for p in ack["peers"]] == ["b"]  # told to probe its declared peer


def test_lease_goes_suspect_down_and_back(fast_lease_server: LiveServer) -> None:
    live = fast_lease_server
    a = _agent(live, "a")
    silent_from = time.monotonic()  # the server stamps the beat after this instant
    # the beat's answer says the state it left the cluster in (a read after it may come more
    # than INTERVAL later on a loaded machine, and find it SUSPECT already)
    assert a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})["state"] == "READY"
    with live.client() as admin:
        state = lambda: admin.get("/v1/clusters/a")["state"]  # noqa: E731
        wait_until(lambda: state() == "SUSPECT", 10, "SUSPECT")
        assert time.monotonic() - silent_from >= INTERVAL  # not before a beat was missed
        wait_until(lambda: state() == "DOWN", 10, "DOWN")
        assert time.monotonic() - silent_from >= GRACE
        assert a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})["state"] == "READY"
        moves = [
            (t["from_state"], t["to_state"])
            for t in admin.get("/v1/clusters/a/transitions")["items"]
        ]
        assert moves[:4] == [
            ("PENDING", "READY"),
            ("READY", "SUSPECT"),
            ("SUSPECT", "DOWN"),
            ("DOWN", "READY"),
        ]
        # silent again since the last beat: the lease may have lapsed again meanwhile
        assert moves[4:] == [("READY", "SUSPECT"), ("SUSPECT", "DOWN")][: len(moves) - 4]


@pytest.fixture
def slow_lease_server(db_url: str) -> Iterator[LiveServer]:
    live = start_server(
        database_url=db_url, heartbeat_interval_s=2.0, lease_grace_s=8.0, monitor_interval_s=0.05
    )
    yield live
    live.stop()


def test_steady_heartbeats_keep_cluster_ready(slow_lease_server: LiveServer) -> None:
    live = slow_lease_server
    a = _agent(live, "a")
    with live.client() as admin:
        # Beats every 0.25 s against a 2 s interval: the monitor runs 40 times meanwhile and
        # must never call a missed window.
        for _ in range(10):
            a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})
            assert admin.get("/v1/clusters/a")["state"] == "READY"
            time.sleep(0.25)
        assert admin.get("/v1/clusters/a/transitions")["total"] == 1


PROBE_URL_REFUSALS = {
    "http://10.0.0.7:8500/v1/kv/secret#": "#fragment",  # would make every peer GET that URL
    "http://10.0.0.7:9100/?x=1": "?query",
    "http://user:pw@10.0.0.7:9100": "credentials",
    "gopher://10.0.0.7:70": "http:// or https://",
    "http://10.0.0.7:99999": "port",
    "http://10.0.0.7/../v1": "path",
    "http://10.0.0.7:9100/" + "a" * 600: "512",
}


def test_probe_urls_are_plain_base_urls_or_a_422_naming_the_field(
    discovering: LiveServer,
) -> None:
    import httpx

    with discovering.client() as admin:
        admin.create_cluster("a", "r1")
        admin.create_cluster("b", "r1")
        token = admin.create_api_key("agent", "a")["token"]
        b = discovering.client(admin.create_api_key("agent", "b")["token"])
    good = "http://10.0.0.7:9100/probe-base"
    a = discovering.client(token)
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [], "probe_url": good})
    for bad, why in PROBE_URL_REFUSALS.items():
        r = httpx.post(
            f"{discovering.url}/v1/agent/heartbeat",
            json={"cluster": "a", "gpus": [], "probe_url": bad},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 422, (bad, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        problem = r.json()
        assert problem["status"] == 422 and "probe_url" in problem["detail"]
        assert [e["field"] for e in problem["errors"]] == ["probe_url"]
        assert why in problem["errors"][0]["message"], problem
    # Nothing stored changed: the cluster keeps its URL, and peers are told that one.
    with discovering.client() as admin:
        assert admin.get("/v1/clusters/a")["probe_url"] == good
    ack = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": []})
    assert ack["peers"] == [{"cluster": "a", "probe_url": good}]


def test_admin_pins_a_clusters_probe_url(discovering: LiveServer) -> None:
    """Peers are told the pin over the reported URL; null unpins; both are audited."""
    a, b = _agent(discovering, "a"), _agent(discovering, "b")
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [], "probe_url": "http://x:1"})

    def peers_of_b() -> list[Any]:
        ack = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": [], "probe_url": "http://y:2"})
        return ack["peers"]

    assert peers_of_b() == [{"cluster": "a", "probe_url": "http://x:1"}]
    with discovering.client() as admin:
        pinned = admin.request(
            "PATCH", "/v1/clusters/a", json={"pinned_probe_url": "https://10.0.0.7:9100/cpn"}
        )
        assert pinned["pinned_probe_url"] == "https://10.0.0.7:9100/cpn"
        assert pinned["probe_url"] == "http://x:1"
    assert peers_of_b() == [{"cluster": "a", "probe_url": "https://10.0.0.7:9100/cpn"}]
    # The agent reporting another URL changes what is stored, not what peers are told.
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [], "probe_url": "http://z:3"})
    assert peers_of_b() == [{"cluster": "a", "probe_url": "https://10.0.0.7:9100/cpn"}]
    with discovering.client() as admin:
        got = admin.get("/v1/clusters/a")
        assert got["probe_url"] == "http://z:3"
        assert got["pinned_probe_url"] == "https://10.0.0.7:9100/cpn"
        # A PATCH that leaves probe_url out keeps the pin.
        admin.request("PATCH", "/v1/clusters/a", json={"region": "r2"})
        assert admin.get("/v1/clusters/a")["pinned_probe_url"] == "https://10.0.0.7:9100/cpn"
        unpinned = admin.request("PATCH", "/v1/clusters/a", json={"pinned_probe_url": None})
        assert unpinned["pinned_probe_url"] is None
        pins = [
            e["detail"]["pinned_probe_url"]
            for e in admin.get("/v1/audit")["items"]
            if e["action"] == "cluster.update" and "pinned_probe_url" in e["detail"]
        ]
        assert sorted(pins, key=str) == sorted(["https://10.0.0.7:9100/cpn", None], key=str)
    assert peers_of_b() == [{"cluster": "a", "probe_url": "http://z:3"}]


def test_a_cluster_can_be_created_pinned(discovering: LiveServer) -> None:
    with discovering.client() as admin:
        made = admin.post(
            "/v1/clusters",
            {"name": "p", "region": "r1", "pinned_probe_url": "http://10.1.2.3:9100"},
        )
        assert made["pinned_probe_url"] == "http://10.1.2.3:9100" and made["probe_url"] is None
        assert made["version"] == 1
        token = admin.create_api_key("agent", "p")["token"]
    b = _agent(discovering, "b")
    with discovering.client(token) as p:  # an agent serving no probe endpoint of its own
        p.post("/v1/agent/heartbeat", {"cluster": "p", "gpus": []})
    ack = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": []})
    assert ack["peers"] == [{"cluster": "p", "probe_url": "http://10.1.2.3:9100"}]


@pytest.mark.parametrize(
    "url",
    ["http://x:1/?a=b", "ftp://x", "http://user:pw@x", "", "http://x/" + "a" * 600, 7],
)
def test_a_bad_pin_is_refused_naming_its_field(live_server: LiveServer, url: object) -> None:
    with live_server.client() as admin:
        admin.create_cluster("a", "r1")
        for method, path, body in (
            ("PATCH", "/v1/clusters/a", {"pinned_probe_url": url}),
            ("POST", "/v1/clusters", {"name": "c", "region": "r1", "pinned_probe_url": url}),
        ):
            with pytest.raises(ApiError) as bad:
                admin.request(method, path, json=body)
            assert bad.value.status == 422
            assert [e["field"] for e in bad.value.errors] == ["pinned_probe_url"]
        assert admin.get("/v1/clusters/a")["pinned_probe_url"] is None


def test_only_admins_pin(live_server: LiveServer) -> None:
    a = _agent(live_server, "a")
    with live_server.client() as admin:
        tenant = admin.post("/v1/tenants", {"name": "acme", "gpu_quota": 4})
        tkey = admin.create_api_key("tenant", tenant["id"], "acme key")["token"]
    for client in (live_server.client(tkey), a):
        with client, pytest.raises(ApiError) as refused:
            client.request("PATCH", "/v1/clusters/a", json={"pinned_probe_url": "http://evil:1"})
        assert refused.value.status in (403, 404)
    with live_server.client() as admin:
        assert admin.get("/v1/clusters/a")["pinned_probe_url"] is None


def test_a_stored_url_that_fails_the_check_is_not_listed(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A URL stored before the check existed reaches no agent, and is logged once."""
    from sqlalchemy import update

    from controller.store.db import make_engine
    from controller.store.models import Cluster

    a, b = _agent(live_server, "a"), _agent(live_server, "b")
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [], "probe_url": "http://x:1"})
    engine = make_engine(live_server.database_url)
    with engine.begin() as conn:
        conn.execute(
            update(Cluster).where(Cluster.name == "a").values(probe_url="http://x:1/?steer=1")
        )
    engine.dispose()
    caplog.set_level("WARNING", logger="controller.network.resources")
    with live_server.client() as admin:  # any pin change drops the cached peer list
        admin.request("PATCH", "/v1/clusters/a", json={"pinned_probe_url": None})
    for _ in range(2):
        assert b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": []})["peers"] == []
        with live_server.client() as admin:
            admin.request("PATCH", "/v1/clusters/a", json={"pinned_probe_url": None})
    logged = [r for r in caplog.records if "not listing cluster a" in r.getMessage()]
    assert len(logged) == 1
