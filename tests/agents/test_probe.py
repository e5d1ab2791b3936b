"""The probe endpoint and link measurement, between real probe servers on loopback."""

import json
import select
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agents.links import WINDOW, LinkProber, throughput_gbps, windowed
from agents.probe_server import ProbeLimits, ProbeServer, default_probe_url
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

    server = probe_servers()
    base = url(server)
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
        assert server.stats().transfers == MAX_CONCURRENT_BLOBS
        refused = clients[-1].get(f"{base}/probe/blob?bytes=10")
        assert refused.status_code == 503
        assert refused.headers["content-type"] == "application/problem+json"
        assert int(refused.headers["retry-after"]) > 0
        assert server.stats().refused_transfers == 1
        assert clients[-1].get(f"{base}/probe/ping").status_code == 204  # pings still answer
        for s in streams:
            s.__exit__(None, None, None)
    finally:
        for c in clients:
            c.close()
    # Readers gone: the server notices on its next write and frees the slots.
    assert server.wait_for(lambda st: st.transfers == 0, 30)
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
    assert got.free_gbps == 0.8  # what the newest probe carried: free now, not the capacity
    assert got.measured_at == ms[-1].measured_at
    # through measure_all: while the window fills, the reported bandwidth never falls
    peer = PeerProbe(cluster="b", probe_url=url(probe_servers()))
    prober = LinkProber(pings=1)
    reports = [prober.measure_all([peer], 200_000)[0].bandwidth_gbps for _ in range(WINDOW)]
    assert reports == sorted(reports)


# ---- the probe endpoint spends bounded threads, time and bytes, whoever connects ------------

SAFETY_S = 30.0  # only ever reached when the bound under test is broken


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response off a raw socket: status, headers (lower-case names), body."""
    sock.settimeout(SAFETY_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closes this connection (EOF); False if SAFETY_S passes first."""
    sock.settimeout(SAFETY_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: peer\r\n\r\n".encode()


def test_threads_stay_fixed_and_connections_beyond_the_pool_get_503() -> None:
    limits = ProbeLimits(workers=3, pending=2, idle_timeout_s=SAFETY_S * 2)
    held = limits.workers + limits.pending
    n = 25
    with ProbeServer("127.0.0.1", 0, limits) as server:
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(n)]
        try:
            # Silent clients: each admitted one holds a worker (or waits for one) until idle.
            assert server.wait_for(
                lambda st: st.connections == held and st.refused_connections == n - held,
                SAFETY_S,
            ), server.stats()
            assert threading.active_count() <= before  # not a thread per connection
            refused: list[socket.socket] = []
            while len(refused) < n - held:
                ready, _, _ = select.select(
                    [s for s in socks if s not in refused], [], [], SAFETY_S
                )
                assert ready, f"only {len(refused)} of {n - held} refusals arrived"
                refused.extend(ready)
            for sock in refused:
                status, headers, body = read_response(sock)
                assert status == 503
                assert headers["content-type"] == "application/problem+json"
                assert int(headers["retry-after"]) == limits.retry_after_s
                assert json.loads(body)["status"] == 503
                assert closed_by_server(sock)
            waiting = [s for s in socks if s not in refused]
            assert len(waiting) == held
            assert select.select(waiting, [], [], 0)[0] == []  # admitted ones got no 503
            busy = httpx.get(f"{url(server)}/probe/ping", timeout=SAFETY_S)
            assert busy.status_code == 503 and busy.headers["retry-after"]
        finally:
            for sock in socks:
                sock.close()
        # Clients gone: the pool is free again, with the same threads.
        assert server.wait_for(lambda st: st.connections == 0, SAFETY_S)
        assert httpx.get(f"{url(server)}/probe/ping", timeout=SAFETY_S).status_code == 204
        assert threading.active_count() <= before


def test_idle_connections_are_closed() -> None:
    with ProbeServer("127.0.0.1", 0, ProbeLimits(idle_timeout_s=0.2)) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as silent:
            assert closed_by_server(silent)  # connected, never sent a byte
        with socket.create_connection(("127.0.0.1", server.port)) as kept:
            kept.sendall(get("/probe/ping"))
            assert read_response(kept)[0] == 204
            assert closed_by_server(kept)  # a keep-alive connection, then silence
        with socket.create_connection(("127.0.0.1", server.port)) as trickle:
            trickle.sendall(b"GET /probe/ping HTTP/1.1\r\nHost:")  # and never the rest
            assert closed_by_server(trickle)
        assert server.wait_for(lambda st: st.connections == 0, SAFETY_S)


def test_a_peer_that_stops_reading_loses_its_transfer_slot() -> None:
    server = ProbeServer("127.0.0.1", 0, ProbeLimits(idle_timeout_s=0.2))
    with server, socket.create_connection(("127.0.0.1", server.port)) as stalled:
        stalled.sendall(get(f"/probe/blob?bytes={PROBE_MAX_BYTES}"))  # and reads nothing
        assert server.wait_for(lambda st: st.transfers == 1, SAFETY_S)
        # The socket buffers fill, the next write times out: the slot comes back while the
        # stalled client still holds its end.
        assert server.wait_for(lambda st: st.transfers == 0, SAFETY_S)
        assert server.wait_for(lambda st: st.connections == 0, SAFETY_S)


def test_a_transfer_is_cut_after_its_time_limit() -> None:
    limits = ProbeLimits(max_transfer_s=0.2, idle_timeout_s=SAFETY_S)
    with ProbeServer("127.0.0.1", 0, limits) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            slow.sendall(get(f"/probe/blob?bytes={PROBE_MAX_BYTES}"))
            slow.settimeout(SAFETY_S)
            received = 0
            while chunk := slow.recv(64 * 1024):  # a reader slower than max_transfer_s allows
                received += len(chunk)
                time.sleep(0.005)  # pacing a slow reader, not waiting for anything
            assert received < PROBE_MAX_BYTES  # header bytes included: still short
        assert server.wait_for(lambda st: st.transfers == 0 and st.connections == 0, SAFETY_S)


def test_one_blob_per_connection_and_a_request_cap() -> None:
    limits = ProbeLimits(max_requests=3)
    with ProbeServer("127.0.0.1", 0, limits) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(get("/probe/ping"))
            assert read_response(sock)[0] == 204
            sock.sendall(get("/probe/blob?bytes=1000"))
            status, headers, body = read_response(sock)
            assert (status, len(body), headers["connection"]) == (200, 1000, "close")
            assert closed_by_server(sock)  # no second blob on this connection
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            for i in range(limits.max_requests):
                sock.sendall(get("/probe/ping"))
                status, headers, _ = read_response(sock)
                assert status == 204
                assert ("connection" in headers) == (i == limits.max_requests - 1)
            assert closed_by_server(sock)


def test_blob_size_is_capped_per_server() -> None:
    with ProbeServer("127.0.0.1", 0, ProbeLimits(max_blob_bytes=1000)) as server:
        assert len(httpx.get(f"{url(server)}/probe/blob?bytes=1000").content) == 1000
        too_big = httpx.get(f"{url(server)}/probe/blob?bytes=1001")
        assert too_big.status_code == 400 and "between 0 and 1000" in too_big.json()["detail"]
    with pytest.raises(ValueError, match="max_blob_bytes"):
        ProbeLimits(max_blob_bytes=PROBE_MAX_BYTES + 1)
