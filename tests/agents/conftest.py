"""A scripted stand-in for the control plane's agent endpoints.

The real server lives in `api/` and has its own end-to-end tests with real agents; these
tests need a controller that misbehaves on cue (garbage, 5xx, 401), which a real one won't.
It is a real HTTP server on loopback, so the agent's HTTP client runs for real.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import BaseModel

from agents.protocol import ClusterState, Heartbeat, HeartbeatAck, LinkReport, PeerProbe


@dataclass
class Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


def ack(
    cluster: str,
    *,
    interval: float = 0.05,
    probe_interval: float = 0.05,
    probe_bytes: int = 256 * 1024,
    peers: list[PeerProbe] | None = None,
    state: ClusterState = "READY",
) -> HeartbeatAck:
    """A controller's answer to a heartbeat, in the protocol's own model: fast beats and probes."""
    return HeartbeatAck(
        cluster=cluster,
        state=state,
        lease_expires_at=datetime.now(UTC) + timedelta(seconds=40),
        heartbeat_interval_s=interval,
        probe_interval_s=probe_interval,
        probe_bytes=probe_bytes,
        peers=peers or [],
    )


def ok(body: BaseModel) -> Reply:
    """A 200 carrying a protocol model as JSON."""
    return Reply(200, body.model_dump_json().encode())


def problem(status: int, detail: str) -> Reply:
    return Reply(
        status,
        json.dumps({"title": "refused", "status": status, "detail": detail}).encode(),
        "application/problem+json",
    )


class FakeController:
    """Answers heartbeats from `script` in order, then with `default(heartbeat)` forever."""

    def __init__(self, script: list[Reply], default: Callable[[Heartbeat], Reply]) -> None:
        self.script = list(script)
        self.default = default
        self.received: list[Received] = []
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                reply = outer._answer(Received(self.path, dict(self.headers.items()), body))
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(reply.body)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(reply.body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def _answer(self, req: Received) -> Reply:
        with self.cond:
            self.received.append(req)
            self.cond.notify_all()
            if req.path == "/v1/agent/links":
                return Reply(204)
            if req.path != "/v1/agent/heartbeat":
                return Reply(404)
            if self.script:
                return self.script.pop(0)
        return self.default(Heartbeat.model_validate_json(req.body))

    def heartbeats(self) -> list[Heartbeat]:
        with self.cond:
            reqs = [r for r in self.received if r.path == "/v1/agent/heartbeat"]
        return [Heartbeat.model_validate_json(r.body) for r in reqs]

    def link_reports(self) -> list[LinkReport]:
        with self.cond:
            reqs = [r for r in self.received if r.path == "/v1/agent/links"]
        return [LinkReport.model_validate_json(r.body) for r in reqs]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def count(self, path: str) -> int:
        return sum(1 for r in self.received if r.path == path)


@pytest.fixture
def make_controller() -> Iterator[Callable[..., FakeController]]:
    started: list[FakeController] = []

    def make(
        script: list[Reply] | None = None, default: Callable[[Heartbeat], Reply] | None = None
    ) -> FakeController:
        fc = FakeController(script or [], default or (lambda hb: ok(ack(hb.cluster))))
        fc.thread.start()
        started.append(fc)
        return fc

    yield make
    for fc in started:
        fc.httpd.shutdown()
        fc.httpd.server_close()
