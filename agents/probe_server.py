"""The probe endpoint each agent serves so its peers can measure the link to it.

`GET /probe/ping` answers 204 with no body (round-trip time); `GET /probe/blob?bytes=N`
answers N incompressible bytes (throughput). Unauthenticated by design, so it is bounded:
N <= PROBE_MAX_BYTES and a few blob transfers at a time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from agents.protocol import PROBE_MAX_BYTES

log = logging.getLogger(__name__)

_CHUNK = os.urandom(1024 * 1024)  # random so no link compression inflates the measurement
MAX_CONCURRENT_BLOBS = 4


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: pings after the first measure RTT, not handshakes
    server_version = "cpn-probe"
    sys_version = ""
    timeout = 60.0
    server: _ProbeHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        log.debug("probe %s: " + format, self.address_string(), *args)

    def _problem(self, status: HTTPStatus, detail: str) -> None:
        body = json.dumps(
            {"title": status.phrase, "status": int(status), "detail": detail}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
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
        try:
            n = int(values[0]) if len(values) == 1 else -1
        except ValueError:
            n = -1
        if not 0 <= n <= PROBE_MAX_BYTES:
            self._problem(
                HTTPStatus.BAD_REQUEST,
                f"bytes: give one integer between 0 and {PROBE_MAX_BYTES}, e.g. ?bytes=4194304",
            )
            return
        if not self.server.blob_slots.acquire(blocking=False):
            self._problem(HTTPStatus.SERVICE_UNAVAILABLE, "too many probe transfers; retry later")
            return
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            view = memoryview(_CHUNK)
            left = n
            while left > 0:
                step = min(left, len(view))
                self.wfile.write(view[:step])
                left -= step
        except (ConnectionError, TimeoutError) as exc:  # the peer gave up or timed out
            log.debug("probe %s: blob transfer cut off: %s", self.address_string(), exc)
            self.close_connection = True
        finally:
            self.server.blob_slots.release()


class _ProbeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    blob_slots: threading.BoundedSemaphore


class _ProbeHTTPServer6(_ProbeHTTPServer):
    address_family = socket.AF_INET6


class ProbeServer:
    """The probe endpoint on a background thread; `port` is the bound one (0 picks a free one)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 9100) -> None:
        server_cls = _ProbeHTTPServer6 if ":" in host else _ProbeHTTPServer
        self._httpd = server_cls((host, port), _Handler)
        self._httpd.blob_slots = threading.BoundedSemaphore(MAX_CONCURRENT_BLOBS)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="cpn-probe-server",
            daemon=True,
        )

    def start(self) -> ProbeServer:
        self._thread.start()
        log.info("probe endpoint listening on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

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
