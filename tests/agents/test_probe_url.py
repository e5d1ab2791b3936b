"""Probe URLs are plain base URLs, and an agent fetches no other, whatever a controller lists."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from agents.controller_client import ControllerClient
from agents.discovery.inventory import InventorySource
from agents.links import LinkProber
from agents.protocol import (
    PROBE_URL_MAX_LENGTH,
    Heartbeat,
    HeartbeatAck,
    PeerProbe,
    check_probe_url,
)
from agents.runner import AgentConfig, AgentRunner
from tests.agents.conftest import FakeController, Reply

GOOD = [
    "http://10.0.0.7:9100",
    "http://x:1",
    "https://probe.us-east.example.com",
    "https://probe.us-east.example.com/agents/us-east/",
    "http://[::1]:9100",
    "http://[2001:db8::7]/probe-base",
    "http://agent_1.svc:80/a%2Fb",
]

BAD = {
    "http://10.0.0.7:8500/v1/kv/secret#": "#fragment",  # the SSRF of issue 14
    "http://10.0.0.7:8500/v1/kv/secret?": "?query",
    "http://h:1/?x=1": "?query",
    "http://user:pw@h:1": "credentials",
    "http://user@h:1/": "credentials",
    "ftp://h:1": "http:// or https://",
    "HTTP://h:1": "http:// or https://",
    "//h:1": "http:// or https://",
    "file:///etc/passwd": "http:// or https://",
    "http://": "no host",
    "http://:9100": "no host",
    "http://h:0": "port",
    "http://h:65536": "port",
    "http://h:": "port",
    "http://h:9100x": "port",
    "http://::1:9100": "IPv6",
    "http://fe80::1:9100/": "IPv6",
    "http://[::1": "IPv6",
    "http://[fe80::1%25eth0]:9100": "IPv6",
    "http://[::1]x": "after the ]",
    "http://h/../admin": "path",
    "http://h/a/./b": "path",
    "http://h/%zz": "path",
    "http://h/a;b": "path",
    "http://-h-/": "host",
    "http://h\\@evil/": "credentials",
    "http://h /": "spaces",
    "http://h/\r\nX-Injected: 1": "spaces",
    "http://bücher.example/": "non-ASCII",
    "": "empty",
    "http://h/" + "a" * PROBE_URL_MAX_LENGTH: "characters long",
}


@pytest.mark.parametrize("url", GOOD)
def test_plain_base_urls_pass_unchanged(url: str) -> None:
    assert check_probe_url(url) == url
    assert Heartbeat(cluster="a", probe_url=url).probe_url == url


@pytest.mark.parametrize(("url", "why"), BAD.items())
def test_anything_else_is_refused_saying_what_and_how(url: str, why: str) -> None:
    with pytest.raises(
        ValueError, match=r"e\.g\. http://10\.0\.0\.7:9100|leave probe_url out"
    ) as exc:
        check_probe_url(url)
    assert why in str(exc.value)
    with pytest.raises(ValidationError) as invalid:
        Heartbeat(cluster="a", probe_url=url)
    (error,) = invalid.value.errors()
    assert error["loc"] == ("probe_url",)
    assert not error["msg"].startswith("Value error")  # the fix, not pydantic's prefix


def test_no_probe_url_is_still_allowed() -> None:
    assert Heartbeat(cluster="a").probe_url is None
    assert Heartbeat(cluster="a", probe_url=None).probe_url is None


def test_acks_stay_readable_with_a_bad_peer_url() -> None:
    """One bad stored URL must not make every agent's ack (and so its lease) fail."""
    ack = HeartbeatAck.model_validate(
        {
            "cluster": "a",
            "state": "READY",
            "lease_expires_at": "2030-01-01T00:00:00Z",
            "heartbeat_interval_s": 10,
            "probe_interval_s": 60,
            "probe_bytes": 1000,
            "peers": [{"cluster": "b", "probe_url": "http://10.0.0.7:8500/v1/kv/secret#"}],
        }
    )
    assert ack.peers[0].cluster == "b"


def test_an_agent_with_a_bad_probe_url_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"probe URL 'http://h:1/\?x' has a \?query"):
        AgentConfig("east", "http://h:1/?x")
    assert AgentConfig("east", "http://h:1").probe_url == "http://h:1"


class Recorder:
    """A real HTTP server standing for an internal service (or a peer): it notes every path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.paths.append(self.path)
                if self.path.startswith("/probe/ping"):
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                n = int(self.path.rsplit("=", 1)[-1]) if "bytes=" in self.path else 10
                self.send_response(200)
                self.send_header("Content-Length", str(n))
                self.end_headers()
                self.wfile.write(b"\0" * n)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


def steering(base: str) -> list[str]:
    """URLs that would make an agent fetch something of `base` other than its probe paths."""
    return [
        f"{base}/v1/kv/secret#",
        f"{base}/v1/kv/secret?x=",
        base.replace("http://", "http://user:pw@"),
        f"{base}/v1/../probe",
        f" {base}",
    ]


def test_prober_never_fetches_a_refused_url(recorder: Recorder) -> None:
    peers = [PeerProbe(cluster=f"p{i}", probe_url=u) for i, u in enumerate(steering(recorder.base))]
    peers.append(PeerProbe(cluster="ok", probe_url=recorder.base))
    links = LinkProber(pings=1, timeout_s=5).measure_all(peers, 1000)
    assert [m.dst for m in links] == ["ok"]
    # Only the listed good peer was fetched, and only at its probe paths.
    assert recorder.paths == ["/probe/ping", "/probe/ping", "/probe/blob?bytes=1000"]


def test_a_ping_that_answers_too_much_is_a_failed_probe() -> None:
    """A hostile peer's endless ping body is not read into memory: the probe fails."""
    written = {"bytes": 0}

    class Flood(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)  # a 204 would tell the client there is no body
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            try:
                for _ in range(1 << 14):
                    self.wfile.write(b"x" * 65536)
                    written["bytes"] += 65536
            except OSError:
                pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flood)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        m = LinkProber(pings=2, timeout_s=5).measure(
            PeerProbe(cluster="f", probe_url=f"http://127.0.0.1:{httpd.server_address[1]}"), 1000
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert m is None
    assert written["bytes"] < 1 << 30  # the prober hung up long before the gigabyte


def test_an_agent_probes_only_the_peers_its_controller_lists(
    make_controller, recorder: Recorder, tmp_path: Path
) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("gpus: [{model: A100-80GB, memory_gib: 80, count: 8, allocatable: 6}]")
    peers = [{"cluster": f"p{i}", "probe_url": u} for i, u in enumerate(steering(recorder.base))]
    peers.append({"cluster": "west", "probe_url": recorder.base})

    def answer(hb: Heartbeat) -> Reply:
        ack = HeartbeatAck.model_validate(
            {
                "cluster": hb.cluster,
                "state": "READY",
                "lease_expires_at": "2030-01-01T00:00:00Z",
                "heartbeat_interval_s": 0.05,
                "probe_interval_s": 0.05,
                "probe_bytes": 2000,
                "peers": peers,
            }
        )
        return Reply(200, ack.model_dump_json().encode())

    controller: FakeController = make_controller(default=answer)
    stop = threading.Event()
    client = ControllerClient(controller.url, "tok-east")
    runner = AgentRunner(
        AgentConfig("east", None, "test"), InventorySource.load(inv), client, stop=stop
    )
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        assert controller.wait_for(lambda: controller.count("/v1/agent/links") >= 2, 20)
    finally:
        stop.set()
        thread.join(timeout=10)
        client.close()
    assert not thread.is_alive()
    assert all(m.dst == "west" for r in controller.link_reports() for m in r.links)
    assert recorder.paths  # it did measure
    assert set(recorder.paths) == {"/probe/ping", "/probe/blob?bytes=2000"}
