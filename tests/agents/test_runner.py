"""The heartbeat and probe loops against a scripted controller on loopback."""

import logging
import random
import threading
from datetime import datetime
from pathlib import Path

import pytest

from agents.backoff import Backoff
from agents.controller_client import ControllerClient
from agents.discovery.inventory import InventorySource
from agents.probe_server import ProbeServer, default_probe_url
from agents.protocol import PeerProbe
from agents.runner import AgentConfig, AgentRunner
from tests.agents.conftest import Reply, ack, ok, problem

NO_WAIT = Backoff(base_s=0.0, cap_s=0.0)


@pytest.fixture
def inventory(tmp_path: Path) -> InventorySource:
    path = tmp_path / "inv.yaml"
    path.write_text("gpus: [{model: A100-80GB, memory_gib: 80, count: 8, allocatable: 6}]")
    return InventorySource.load(path)


def make_runner(
    controller, inventory, *, cluster="east", probe_url=None, stop=None, backoff=NO_WAIT
):
    client = ControllerClient(controller.url, "tok-east")
    return AgentRunner(
        AgentConfig(cluster, probe_url, "test"), inventory, client, backoff=backoff, stop=stop
    )


def test_survives_garbage_then_500_then_gets_its_ack(make_controller, inventory, caplog):
    controller = make_controller(
        [
            Reply(200, b"<html>surprise</html>", "text/html"),
            Reply(200, b'{"cluster": "east"}'),  # JSON, wrong schema
            problem(500, "database is locked"),
        ]
    )
    runner = make_runner(controller, inventory)
    with caplog.at_level(logging.WARNING, logger="agents"):
        runner.run_heartbeats(iterations=4)
    assert runner.heartbeats_sent == 4
    assert runner.heartbeats_acked == 1
    assert runner.last_ack is not None and runner.last_ack.state == "READY"
    beats = controller.heartbeats()
    assert len(beats) == 4
    assert all(b.cluster == "east" and b.discovery == "inventory" for b in beats)
    assert beats[-1].gpus[0].model == "A100-80GB" and beats[-1].gpus[0].allocatable == 6
    assert {r.headers["Authorization"] for r in controller.received} == {"Bearer tok-east"}
    text = caplog.text
    assert "no valid HeartbeatAck" in text
    assert "HTTP 500" in text and "database is locked" in text


def test_bad_token_is_logged_with_the_problem_detail_and_retried(
    make_controller, inventory, caplog
):
    controller = make_controller(
        [
            problem(401, "API key revoked"),
            problem(403, "token is bound to cluster 'west', not 'east'"),
        ]
    )
    runner = make_runner(controller, inventory)
    with caplog.at_level(logging.WARNING, logger="agents"):
        runner.run_heartbeats(iterations=3)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("HTTP 401" in m and "API key revoked" in m for m in errors)
    assert any("HTTP 403" in m and "bound to cluster 'west'" in m for m in errors)
    assert runner.heartbeats_acked == 1  # the operator fixed the token: back in business


def test_unreachable_controller_backs_off_then_recovers(make_controller, inventory):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    controller = make_controller()
    client = ControllerClient(f"http://127.0.0.1:{port}", "t")
    runner = AgentRunner(
        AgentConfig("east", None),
        inventory,
        client,
        backoff=Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(7)),
    )
    delays = [runner.beat() for _ in range(6)]
    # Full jitter: each delay under its doubling ceiling, capped.
    assert all(0 <= d <= min(8.0, 2.0**i) for i, d in enumerate(delays))
    assert runner.heartbeats_acked == 0
    runner.controller = ControllerClient(controller.url, "t")
    assert runner.beat() == pytest.approx(0.05)  # the ack's heartbeat_interval_s
    assert runner.heartbeats_acked == 1


def test_retry_after_is_honoured(make_controller, inventory):
    controller = make_controller([Reply(503, b"busy", "text/plain", {"Retry-After": "0.25"})])
    runner = make_runner(controller, inventory)
    assert runner.beat() == pytest.approx(0.25)


def test_ack_for_another_cluster_is_rejected(make_controller, inventory, caplog):
    controller = make_controller([ok(ack("west"))])
    runner = make_runner(controller, inventory)
    with caplog.at_level(logging.WARNING, logger="agents"):
        runner.beat()
    assert runner.last_ack is None
    assert "acknowledged cluster 'west'" in caplog.text


def test_bad_inventory_edit_keeps_the_last_known_gpus(make_controller, inventory, caplog):
    controller = make_controller()
    runner = make_runner(controller, inventory)
    runner.beat()
    inventory.path.write_text("gpus: [{model: A100-80GB, memory_gib: -80, count: 8}]")
    with caplog.at_level(logging.WARNING, logger="agents"):
        runner.beat()
    beats = controller.heartbeats()
    assert beats[1].gpus == beats[0].gpus and beats[1].gpus
    assert "gpus[0].memory_gib" in caplog.text


def test_backoff_ceiling_doubles_to_the_cap():
    b = Backoff(base_s=0.5, cap_s=4.0, rng=random.Random(1))
    assert [b.ceiling(i) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.ceiling(10_000) == 4.0
    assert all(0 <= b.delay(i) <= b.ceiling(i) for i in range(50))


def test_run_measures_peers_and_reports_links_until_stopped(make_controller, inventory):
    own = ProbeServer("127.0.0.1", 0).start()
    peer = ProbeServer("127.0.0.1", 0).start()
    peer_url = default_probe_url(peer.host, peer.port)
    controller = make_controller(
        default=lambda hb: ok(
            ack(
                hb.cluster,
                peers=[
                    PeerProbe(cluster="west", probe_url=peer_url),
                    PeerProbe(cluster="east", probe_url="http://self.invalid"),
                ],
            )
        )
    )
    stop = threading.Event()
    runner = make_runner(
        controller, inventory, stop=stop, probe_url=default_probe_url(own.host, own.port)
    )
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        assert controller.wait_for(lambda: controller.count("/v1/agent/links") >= 2, 20)
    finally:
        stop.set()
        thread.join(timeout=10)
        own.stop()
        peer.stop()
    assert not thread.is_alive()
    report = controller.link_reports()[0]
    assert report.cluster == "east"
    assert [m.dst for m in report.links] == ["west"]  # never itself
    m = report.links[0]
    assert m.bandwidth_gbps > 0 and m.rtt_ms > 0 and m.bytes_transferred == 256 * 1024
    assert controller.heartbeats()[0].probe_url == default_probe_url(own.host, own.port)


def test_lease_expiry_is_warned_once_even_with_a_naive_time(make_controller, inventory, caplog):
    naive_past = datetime(2020, 1, 1)  # no time zone, long past: a controller may send one
    expired = ack("east").model_copy(update={"lease_expires_at": naive_past})
    controller = make_controller([ok(expired), problem(500, "down"), problem(500, "down")])
    runner = make_runner(controller, inventory)
    with caplog.at_level(logging.WARNING, logger="agents"):
        runner.run_heartbeats(iterations=3)
    assert sum("lease expired" in r.getMessage() for r in caplog.records) == 1
