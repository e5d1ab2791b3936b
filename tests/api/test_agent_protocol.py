"""The agent protocol's server side and the lease monitor, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from api.client import ApiError, Client
from api.processes import wait_until
from tests.conftest import LiveServer, start_server

INTERVAL, GRACE = 0.4, 1.6


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


def test_heartbeat_syncs_gpus_and_lists_peers(live_server: LiveServer) -> None:
    a, b = _agent(live_server, "a"), _agent(live_server, "b")
    gpus = [{"model": "A100-80GB", "memory_gib": 80, "count": 8, "allocatable": 6}]
    ack_a = a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": gpus, "probe_url": "http://x:1"})
    assert ack_a["state"] == "READY" and ack_a["peers"] == []
    ack_b = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": [], "probe_url": "http://y:2"})
    assert ack_b["peers"] == [{"cluster": "a", "probe_url": "http://x:1"}]
    with live_server.client() as admin:
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
    with live_server.client() as admin:
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
        assert effective[("a", "b")]["bandwidth_gbps"] == 0.8
        assert effective[("a", "b")]["egress_price_per_gb"] == 0.05  # the declared price holds
        assert effective[("b", "a")]["source"] == "declared"
        assert len(admin.links("all")) == 3
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


def test_lease_goes_suspect_down_and_back(fast_lease_server: LiveServer) -> None:
    live = fast_lease_server
    a = _agent(live, "a")
    silent_from = time.monotonic()  # the server stamps the beat after this instant
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})
    with live.client() as admin:
        state = lambda: admin.get("/v1/clusters/a")["state"]  # noqa: E731
        assert state() == "READY"
        wait_until(lambda: state() == "SUSPECT", 10, "SUSPECT")
        assert time.monotonic() - silent_from >= INTERVAL  # not before a beat was missed
        wait_until(lambda: state() == "DOWN", 10, "DOWN")
        assert time.monotonic() - silent_from >= GRACE
        a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": []})
        assert state() == "READY"
        moves = [
            (t["from_state"], t["to_state"])
            for t in admin.get("/v1/clusters/a/transitions")["items"]
        ]
        assert moves == [
            ("PENDING", "READY"),
            ("READY", "SUSPECT"),
            ("SUSPECT", "DOWN"),
            ("DOWN", "READY"),
        ]


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
    live_server: LiveServer,
) -> None:
    import httpx

    with live_server.client() as admin:
        admin.create_cluster("a", "r1")
        admin.create_cluster("b", "r1")
        token = admin.create_api_key("agent", "a")["token"]
        b = live_server.client(admin.create_api_key("agent", "b")["token"])
    good = "http://10.0.0.7:9100/probe-base"
    a = live_server.client(token)
    a.post("/v1/agent/heartbeat", {"cluster": "a", "gpus": [], "probe_url": good})
    for bad, why in PROBE_URL_REFUSALS.items():
        r = httpx.post(
            f"{live_server.url}/v1/agent/heartbeat",
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
    with live_server.client() as admin:
        assert admin.get("/v1/clusters/a")["probe_url"] == good
    ack = b.post("/v1/agent/heartbeat", {"cluster": "b", "gpus": []})
    assert ack["peers"] == [{"cluster": "a", "probe_url": good}]
