"""The probe endpoint each agent serves so its peers can measure the link to it.

`GET /probe/ping` answers 204 with no body (round-trip time); `GET /probe/blob?bytes=N`
answers N incompressible bytes (throughput). It is unauthenticated (the protocol carries no
secret peers share), so everything it spends is bounded, whoever asks:

- threads: a fixed pool of `workers` serves connections; up to `pending` more wait for one,
  and a connection beyond those is answered 503 with Retry-After at once and closed;
- time: a connection idle (or not reading what it asked for) for `idle_timeout_s` is closed,
  a blob transfer is cut after `max_transfer_s`, a connection serves `max_requests` requests;
- bytes: N <= `max_blob_bytes` (at most PROBE_MAX_BYTES), one blob per connection (it closes
  after it), and `max_blobs` transfers at a time: beyond, a 503 problem with Retry-After.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agents.protocol import PROBE_MAX_BYTES

log = logging.getLogger(__name__)

_CHUNK = os.urandom(1024 * 1024)  # random so no link compression inflates the measurement
_WRITE = 64 * 1024  # per send: each must finish within the idle timeout, even on a slow link

WORKERS = 16
PENDING_CONNECTIONS = 32
MAX_CONCURRENT_BLOBS = 4
IDLE_TIMEOUT_S = 10.0
MAX_TRANSFER_S = 300.0
MAX_REQUESTS_PER_CONNECTION = 64  # a measurement takes a handful: pings, then one blob
RETRY_AFTER_S = 5
_LINGER_S = 2.0  # a refused client has this long to read its 503 and hang up
_MAX_LINGERING = 256  # refused sockets lingering at once; beyond, they are closed at once


@dataclass(frozen=True)
class ProbeLimits:
    """What the probe endpoint spends at most; see the module's docstring."""

    workers: int = WORKERS
    pending: int = PENDING_CONNECTIONS
    max_blobs: int = MAX_CONCURRENT_BLOBS
    max_blob_bytes: int = PROBE_MAX_BYTES
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_transfer_s: float = MAX_TRANSFER_S
    max_requests: int = MAX_REQUESTS_PER_CONNECTION
    retry_after_s: int = RETRY_AFTER_S

    def __post_init__(self) -> None:
        if min(self.workers, self.max_blobs, self.max_requests) < 1 or self.pending < 0:
            raise ValueError("probe limits: workers, max_blobs and max_requests must be >= 1")
        if not 0 <= self.max_blob_bytes <= PROBE_MAX_BYTES:
            raise ValueError(f"probe limits: max_blob_bytes must be 0..{PROBE_MAX_BYTES}")
        if self.idle_timeout_s <= 0 or self.max_transfer_s <= 0 or self.retry_after_s < 0:
            raise ValueError("probe limits: timeouts must be > 0 s, retry_after_s >= 0")


@dataclass(frozen=True)
class ProbeStats:
    """Counters of a probe server, for logs and for tests to synchronise on."""

    connections: int  # being served, or waiting for a worker
    refused_connections: int  # answered 503 for want of a worker
    transfers: int  # blob transfers under way
    refused_transfers: int  # answered 503 for want of a transfer slot


def _problem_body(status: HTTPStatus, detail: str) -> bytes:
    return json.dumps({"title": status.phrase, "status": int(status), "detail": detail}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: pings after the first measure RTT, not handshakes
    server_version = "cpn-probe"
    sys_version = ""
    server: _ProbeHTTPServer

    def setup(self) -> None:
        super().setup()
        # every read and every write of this connection: an idle or non-reading peer is cut
        self.connection.settimeout(self.server.limits.idle_timeout_s)
        self.served = 0

    def log_message(self, format: str, *args: object) -> None:
        log.debug("probe %s: " + format, self.address_string(), *args)

    def _problem(self, status: HTTPStatus, detail: str, retry: bool = False) -> None:
        body = _problem_body(status, detail)
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json")
        self.send_header("Content-Length", str(len(body)))
        if retry:
            self.send_header("Retry-After", str(self.server.limits.retry_after_s))
        self.end_headers()
        self.wfile.write(body)

    def end_headers(self) -> None:
        if self.served >= self.server.limits.max_requests and not self.close_connection:
            self.send_header("Connection", "close")  # sets close_connection too
        super().end_headers()

    def do_GET(self) -> None:
        self.served += 1
        url = urlsplit(self.path)
        if url.path == "/probe/ping":
            self.send_response(HTTPStatus.NO_CONTENT)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/probe/blob":
            self._blob(parse_qs(url.query).get("bytes", []))
        else:
            self._problem(HTTPStatus.NOT_FOUND, f"no {url.path}; use /probe/ping or /probe/blob")

    def _blob(self, values: list[str]) -> None:
        limit = self.server.limits.max_blob_bytes
        try:
            n = int(values[0]) if len(values) == 1 and len(values[0]) <= 12 else -1
        except ValueError:
            n = -1
        if not 0 <= n <= limit:
            self._problem(
                HTTPStatus.BAD_REQUEST,
                f"bytes: give one integer between 0 and {limit}, e.g. ?bytes=4194304",
            )
            return
        if not self.server.blob_slots.acquire(blocking=False):
            self.server.count(refused_transfers=1)
            self._problem(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"{self.server.limits.max_blobs} probe transfers are under way; retry later",
                retry=True,
            )
            return
        self.server.count(transfers=1)
        try:
            self._send_blob(n)
        except (ConnectionError, TimeoutError) as exc:  # the peer gave up or stopped reading
            log.debug("probe %s: blob transfer cut off: %s", self.address_string(), exc)
            self.close_connection = True
        finally:
            self.server.blob_slots.release()
            self.server.count(transfers=-1)

    def _send_blob(self, n: int) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")  # one blob per connection: bytes are bounded
        self.end_headers()
        deadline = time.monotonic() + self.server.limits.max_transfer_s
        view = memoryview(_CHUNK)
        left = n
        while left > 0:
            if time.monotonic() > deadline:
                log.info(
                    "probe %s: blob transfer cut after %.0f s with %d bytes left",
                    self.address_string(),
                    self.server.limits.max_transfer_s,
                    left,
                )
                return  # the connection closes: the peer sees a short body
            step = min(left, _WRITE)
            self.wfile.write(view[:step])
            left -= step


_Pending = tuple[socket.socket, Any] | None


class _ProbeHTTPServer(HTTPServer):
    """An HTTP server whose connections are served by a fixed pool of threads.

    The accepting thread only admits or refuses; admission takes one of `workers + pending`
    places, so the thread count never depends on how many connect.
    """

    request_queue_size = 128  # listen backlog: refusals come from us, with a 503, not SYN drops

    def __init__(self, address: tuple[str, int], limits: ProbeLimits) -> None:
        self.limits = limits
        self.blob_slots = threading.BoundedSemaphore(limits.max_blobs)
        self._places = threading.BoundedSemaphore(limits.workers + limits.pending)
        self._pending: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._open: set[socket.socket] = set()
        self._lingering: dict[socket.socket, float] = {}  # refused, until EOF or a deadline
        self._lock = threading.Lock()
        self._stopping = False
        self.changed = threading.Condition()
        self._stats = ProbeStats(0, 0, 0, 0)
        detail = f"the probe endpoint is busy; retry in {limits.retry_after_s} s"
        body = _problem_body(HTTPStatus.SERVICE_UNAVAILABLE, detail)
        self._busy = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/problem+json\r\n"
            b"Content-Length: %d\r\nRetry-After: %d\r\nConnection: close\r\n\r\n%s"
            % (len(body), limits.retry_after_s, body)
        )
        super().__init__(address, _Handler)

    def count(self, **deltas: int) -> None:
        with self.changed:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + d for k, d in deltas.items()})
            self.changed.notify_all()

    def stats(self) -> ProbeStats:
        with self.changed:
            return self._stats

    def wait_for(self, predicate: Callable[[ProbeStats], bool], timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self._stats), timeout)

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: hand the connection to the pool, or refuse it now."""
        if self._stopping or not self._places.acquire(blocking=False):
            self._refuse(request)
            return
        self.count(connections=1)
        self._pending.put((request, client_address))

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 without waiting on the client: the accepting thread serves everyone.

        The socket then lingers (see `service_actions`) until the client hangs up: closing it
        while its request is still arriving would send an RST that can destroy the 503.
        """
        self.count(refused_connections=1)
        try:
            request.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # nothing sent yet
                request.recv(65536)
            request.send(self._busy)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            request.close()
            return
        if len(self._lingering) >= _MAX_LINGERING:
            request.close()
            return
        self._lingering[request] = time.monotonic() + _LINGER_S

    def service_actions(self) -> None:
        """On the accepting thread, between accepts: read refused clients to their end."""
        now = time.monotonic()
        for sock, deadline in list(self._lingering.items()):
            done = now > deadline
            try:
                for _ in range(4):  # a bounded read: a client that floods cannot hold us here
                    if not sock.recv(65536):  # dropped; end of file: it read its 503, hung up
                        done = True
                        break
            except BlockingIOError:
                pass
            except OSError:
                done = True
            if done:
                del self._lingering[sock]
                sock.close()

    def server_close(self) -> None:
        for sock in self._lingering:
            sock.close()
        self._lingering.clear()
        super().server_close()

    def work(self) -> None:
        """One pool thread: serve admitted connections one at a time until told to stop."""
        while (item := self._pending.get()) is not None:
            request, client_address = item
            try:
                with self._lock:
                    self._open.add(request)
                    stopping = self._stopping
                if not stopping:
                    self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                with self._lock:
                    self._open.discard(request)
                self.shutdown_request(request)
                self._places.release()
                self.count(connections=-1)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that hangs up or times out is routine; anything else is a bug worth a trace."""
        routine = isinstance(sys.exc_info()[1], OSError)
        log.log(
            logging.DEBUG if routine else logging.WARNING,
            "probe connection from %s failed",
            client_address,
            exc_info=True,
        )

    def close_connections(self, workers: int) -> None:
        """Stop serving: end open connections (their threads are blocked reading them)."""
        with self._lock:
            self._stopping = True
            for sock in self._open:
                with contextlib.suppress(OSError):  # already closed by its client
                    sock.shutdown(socket.SHUT_RDWR)
        for _ in range(workers):
            self._pending.put(None)


class _ProbeHTTPServer6(_ProbeHTTPServer):
    address_family = socket.AF_INET6


class ProbeServer:
    """The probe endpoint on background threads; `port` is the bound one (0 picks a free one)."""

    def __init__(
        self, host: str = "0.0.0.0", port: int = 9100, limits: ProbeLimits | None = None
    ) -> None:
        self.limits = limits or ProbeLimits()
        server_cls = _ProbeHTTPServer6 if ":" in host else _ProbeHTTPServer
        self._httpd = server_cls((host, port), self.limits)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"cpn-probe-{self.port}",
            daemon=True,
        )
        self._workers = [
            threading.Thread(
                target=self._httpd.work, name=f"cpn-probe-{self.port}-{i}", daemon=True
            )
            for i in range(self.limits.workers)
        ]

    def start(self) -> ProbeServer:
        for worker in self._workers:
            worker.start()
        self._thread.start()
        log.info("probe endpoint listening on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.close_connections(len(self._workers))
        for worker in self._workers:
            if worker.is_alive():
                worker.join(timeout=5)
        self._httpd.server_close()

    def stats(self) -> ProbeStats:
        return self._httpd.stats()

    def wait_for(self, predicate: Callable[[ProbeStats], bool], timeout: float) -> bool:
        """Block until `predicate(stats)` holds (True) or `timeout` seconds pass (False)."""
        return self._httpd.wait_for(predicate, timeout)

    def __enter__(self) -> ProbeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_probe_url(host: str, port: int) -> str:
    """The URL peers should use, when no --advertise-url was given."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
