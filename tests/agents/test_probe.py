"""The probe endpoint and link measurement, between real probe servers on loopback."""

import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agents.links import WINDOW, LinkProber, throughput_gbps, windowed
from agents.probe_server import ProbeServer, default_probe_url
from agents.protocol import PROBE_MAX_BYTES, LinkMeasurement, PeerProbe


@pytest.fixture
def probe_servers():
    servers = []

    def start():
        s = ProbeServer("127.0.0.1", 0).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def url(server: ProbeServer) -> str:
    return default_probe_url(server.host, server.port)


def test_ping_and_blob(probe_servers):
    base = url(probe_servers())
    assert httpx.get(base + "/probe/ping").status_code == 204
    r = httpx.get(base + "/probe/blob?bytes=3000000")
    assert r.status_code == 200 and len(r.content) == 3_000_000
    assert len(set(r.content[:4096])) > 200  # random-ish, not a compressible run of zeros
    assert httpx.get(base + "/probe/blob?bytes=0").content == b""


@pytest.mark.parametrize(
    "query", [f"bytes={PROBE_MAX_BYTES + 1}", "bytes=-1", "bytes=abc", "", "bytes=1&bytes=2"]
)
def test_bad_blob_sizes_are_400_problems(probe_servers, query):
    r = httpx.get(url(probe_servers()) + "/probe/blob?" + query)
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert "bytes: give one integer between 0 and" in r.json()["detail"]


def test_unknown_path_is_404(probe_servers):
    r = httpx.get(url(probe_servers()) + "/probe/other")
    assert r.status_code == 404 and "/probe/ping" in r.json()["detail"]


def test_measures_between_two_probe_servers(probe_servers):
    probe_servers()  # this cluster's own endpoint, serving while it measures
    peer = probe_servers()
    m = LinkProber(pings=3).measure(PeerProbe(cluster="b", probe_url=url(peer)), 2_000_000)
    assert m is not None
    assert m.dst == "b"
    assert m.rtt_ms > 0
    assert m.bandwidth_gbps > 0
    assert m.bytes_transferred == 2_000_000
    assert m.loss == 0.0


def test_unreachable_peers_are_skipped(probe_servers):
    live = probe_servers()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    peers = [
        PeerProbe(cluster="dead", probe_url=f"http://127.0.0.1:{dead_port}"),
        PeerProbe(cluster="ftp", probe_url="ftp://127.0.0.1/"),
        PeerProbe(cluster="live", probe_url=url(live)),
    ]
    links = LinkProber(pings=2, timeout_s=2).measure_all(peers, 100_000)
    assert [m.dst for m in links] == ["live"]


def test_loss_counts_failed_probes():
    """A peer whose every other ping fails with 503."""
    seen = {"pings": 0}

    class Flaky(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path.startswith("/probe/ping"):
                seen["pings"] += 1
                status = 204 if seen["pings"] % 2 else 503
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                body = b"x" * 1000
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        m = LinkProber(pings=5).measure(
            PeerProbe(cluster="f", probe_url=f"http://127.0.0.1:{httpd.server_address[1]}"), 1000
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert m is not None
    # 6 pings (3 fail) + 1 blob = 7 probes.
    assert seen["pings"] == 6
    assert m.loss == pytest.approx(3 / 7)


def test_short_blob_is_not_a_measurement():
    class Liar(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path.startswith("/probe/ping"):
                self.send_response(204)
                self.end_headers()
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps({"not": "a blob"}).encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        m = LinkProber(pings=1).measure(
            PeerProbe(cluster="l", probe_url=f"http://127.0.0.1:{httpd.server_address[1]}"), 10_000
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert m is None


def test_throughput_accounts_for_rtt():
    assert throughput_gbps(125_000_000, 1.0, 0.0) == pytest.approx(1.0)
    # Half the time was the round trip: the payload moved at twice the naive rate.
    assert throughput_gbps(125_000_000, 1.0, 0.5) == pytest.approx(2.0)
    # RTT (noisily) as long as the whole transfer: fall back to the naive rate.
    assert throughput_gbps(125_000_000, 1.0, 1.2) == pytest.approx(1.0)
    assert throughput_gbps(1, 1.0, 0.0) > 0


def test_default_probe_url():
    assert default_probe_url("0.0.0.0", 9100) == "http://127.0.0.1:9100"
    assert default_probe_url("10.1.2.3", 80) == "http://10.1.2.3:80"
    assert default_probe_url("::1", 9100) == "http://[::1]:9100"


def test_blob_transfers_are_bounded_in_number(probe_servers):
    from agents.probe_server import MAX_CONCURRENT_BLOBS

    base = url(probe_servers())
    clients = [httpx.Client(timeout=10) for _ in range(MAX_CONCURRENT_BLOBS + 1)]
    try:
        # Each response has its headers once the server holds a slot; nobody reads the
        # 64 MiB bodies, so the slots stay held.
        streams = [
            c.stream("GET", f"{base}/probe/blob?bytes={PROBE_MAX_BYTES}")
            for c in clients[:MAX_CONCURRENT_BLOBS]
        ]
        responses = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        refused = clients[-1].get(f"{base}/probe/blob?bytes=10")
        assert refused.status_code == 503
        assert refused.headers["content-type"] == "application/problem+json"
        for s in streams:
            s.__exit__(None, None, None)
    finally:
        for c in clients:
            c.close()
    # Readers gone: the server notices on its next write and frees the slots.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/probe/blob?bytes=10").status_code == 200:
            break
        time.sleep(0.05)
    assert httpx.get(f"{base}/probe/blob?bytes=10").status_code == 200


def test_reports_are_the_best_of_the_last_few_measurements(probe_servers):
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    ms = [
        LinkMeasurement(
            dst="b",
            bandwidth_gbps=bw,
            rtt_ms=rtt,
            loss=loss,
            bytes_transferred=1,
            measured_at=t0 + timedelta(seconds=i),
        )
        for i, (bw, rtt, loss) in enumerate([(1.0, 5.0, 0.0), (0.4, 9.0, 0.1), (0.8, 7.0, 0.2)])
    ]
    # a probe that shared the path saw less bandwidth and more delay; the newest loss stands
    got = windowed(ms)
    assert (got.bandwidth_gbps, got.rtt_ms, got.loss) == (1.0, 5.0, 0.2)
    assert got.measured_at == ms[-1].measured_at
    # through measure_all: while the window fills, the reported bandwidth never falls
    peer = PeerProbe(cluster="b", probe_url=url(probe_servers()))
    prober = LinkProber(pings=1)
    reports = [prober.measure_all([peer], 200_000)[0].bandwidth_gbps for _ in range(WINDOW)]
    assert reports == sorted(reports)
