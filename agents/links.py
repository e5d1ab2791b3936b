"""Measuring the WAN link to a peer cluster's probe endpoint.

RTT is the median of a few pings on a warm connection. Throughput comes from one bounded
blob transfer: its bytes over its duration minus one RTT (the request's trip out and the
first byte's trip back carry no payload). Loss is the fraction of probes that failed.

What an agent reports is filtered over its last few measurements of a link, as BBR filters
its path model: the largest bandwidth (the link's capacity) and the smallest RTT. Anything
sharing the path while a probe runs (another agent's probe, a job's traffic) can only lower
the throughput it sees and raise the delay, never the other way, so one unlucky probe must
not become the link. What the newest probe carried is reported beside it as what is free
now: the two differ by the traffic on the path.

Peers come only from the controller's `HeartbeatAck`, and a peer's URL is fetched only once it
passes `check_probe_url` here too (the store may hold a URL from before that check existed).
A peer is another datacenter, so nothing it answers is trusted to be small or quick: a ping
body is read up to a few KiB, a blob up to the bytes asked for, each within a deadline.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from agents.protocol import PROBE_MAX_BYTES, LinkMeasurement, PeerProbe, check_probe_url

log = logging.getLogger(__name__)

MAX_GBPS = 100_000.0  # LinkMeasurement's upper bound
MIN_GBPS = 1e-9
WINDOW = 3  # measurements of a link the report is filtered over
PING_MAX_BODY = 4096  # a ping answers 204 with no body; more than this is not a probe endpoint


def windowed(recent: Iterable[LinkMeasurement]) -> LinkMeasurement:
    """The newest measurement with the window's largest bandwidth (the capacity) and
    smallest RTT; its own bandwidth is what is free now."""
    window = list(recent)
    return window[-1].model_copy(
        update={
            "bandwidth_gbps": max(m.bandwidth_gbps for m in window),
            "free_gbps": window[-1].bandwidth_gbps,
            "rtt_ms": min(m.rtt_ms for m in window),
        }
    )


def throughput_gbps(nbytes: int, elapsed_s: float, rtt_s: float) -> float:
    """Payload rate in Gbit/s; the RTT is taken off unless that leaves nothing to divide by."""
    transfer_s = elapsed_s - rtt_s
    if transfer_s <= elapsed_s * 0.05:  # RTT dominated: a too-small blob or noisy pings
        transfer_s = elapsed_s
    if transfer_s <= 0:
        return MAX_GBPS
    return min(MAX_GBPS, max(MIN_GBPS, nbytes * 8 / transfer_s / 1e9))


@dataclass
class ProbeCounts:
    attempted: int = 0
    failed: int = 0

    @property
    def loss(self) -> float:
        return self.failed / self.attempted if self.attempted else 0.0


class LinkProber:
    """Measures links to peers' probe endpoints, one peer at a time.

    One at a time so that two transfers do not share this cluster's uplink and each report
    half the bandwidth.
    """

    def __init__(
        self,
        *,
        pings: int = 5,
        timeout_s: float = 10.0,
        blob_timeout_s: float = 60.0,
        blob_deadline_s: float = 600.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`timeout_s`: per network operation of a ping, and a ping's whole duration;
        `blob_timeout_s`: per operation of a blob transfer; `blob_deadline_s`: its whole."""
        self.pings = pings
        self.timeout_s = timeout_s
        self.blob_timeout_s = blob_timeout_s
        self.blob_deadline_s = blob_deadline_s
        self._clock = clock
        self._recent: dict[tuple[str, str], deque[LinkMeasurement]] = {}

    def measure(self, peer: PeerProbe, probe_bytes: int) -> LinkMeasurement | None:
        """The link to `peer`, or None when it is unreachable (logged)."""
        try:
            base = check_probe_url(peer.probe_url).rstrip("/")
        except ValueError as exc:
            log.warning("peer %s: probe URL %s; skipped", peer.cluster, exc)
            return None
        nbytes = max(1, min(probe_bytes, PROBE_MAX_BYTES))
        counts = ProbeCounts()
        rtts: list[float] = []
        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            # The first ping opens the connection; its time includes the handshake, so only
            # its success counts.
            for i in range(self.pings + 1):
                elapsed = self._ping(client, base + "/probe/ping", peer, counts)
                if elapsed is not None and i > 0:
                    rtts.append(elapsed)
            if counts.failed == counts.attempted:
                log.warning(
                    "peer %s at %s unreachable: every ping failed; skipped", peer.cluster, base
                )
                return None
            if not rtts:
                log.warning("peer %s: no timed ping succeeded; skipped", peer.cluster)
                return None
            rtt_s = statistics.median(rtts)
            blob = self._blob(client, f"{base}/probe/blob?bytes={nbytes}", nbytes, peer, counts)
        if blob is None:
            return None
        return LinkMeasurement(
            dst=peer.cluster,
            bandwidth_gbps=throughput_gbps(nbytes, blob, rtt_s),
            rtt_ms=min(600_000.0, rtt_s * 1000.0),
            loss=counts.loss,
            bytes_transferred=nbytes,
            measured_at=datetime.now(UTC),
        )

    def _ping(
        self, client: httpx.Client, url: str, peer: PeerProbe, counts: ProbeCounts
    ) -> float | None:
        counts.attempted += 1
        start = self._clock()
        received = 0
        try:
            with client.stream("GET", url) as response:
                # Read the (empty) body to its end, so the connection stays warm for the next
                # ping, but never more than a ping can carry.
                for chunk in response.iter_raw():
                    received += len(chunk)
                    if received > PING_MAX_BODY or self._clock() - start > self.timeout_s:
                        break
        except httpx.HTTPError as exc:
            counts.failed += 1
            log.debug("peer %s: ping failed: %s", peer.cluster, exc)
            return None
        elapsed = self._clock() - start
        if received > PING_MAX_BODY or elapsed > self.timeout_s:
            counts.failed += 1
            log.debug("peer %s: ping answered too much or too slowly; failed", peer.cluster)
            return None
        if response.status_code != 204:
            counts.failed += 1
            log.debug("peer %s: ping answered HTTP %d", peer.cluster, response.status_code)
            return None
        return elapsed

    def _blob(
        self, client: httpx.Client, url: str, nbytes: int, peer: PeerProbe, counts: ProbeCounts
    ) -> float | None:
        """Seconds from sending the request to the last byte, or None when it failed."""
        counts.attempted += 1
        received = 0
        start = self._clock()
        try:
            with client.stream("GET", url, timeout=self.blob_timeout_s) as response:
                if response.status_code != 200:
                    counts.failed += 1
                    log.warning(
                        "peer %s: blob transfer answered HTTP %d; skipped",
                        peer.cluster,
                        response.status_code,
                    )
                    return None
                for chunk in response.iter_raw():
                    received += len(chunk)
                    if received > nbytes or self._clock() - start > self.blob_deadline_s:
                        break  # too much, or a trickle that would hold this prober for hours
        except httpx.HTTPError as exc:
            counts.failed += 1
            log.warning(
                "peer %s: blob transfer failed after %d of %d bytes: %s; skipped",
                peer.cluster,
                received,
                nbytes,
                exc,
            )
            return None
        elapsed = self._clock() - start
        if elapsed > self.blob_deadline_s:
            counts.failed += 1
            log.warning(
                "peer %s: blob transfer took over %.0f s (%d of %d bytes); skipped",
                peer.cluster,
                self.blob_deadline_s,
                received,
                nbytes,
            )
            return None
        if received != nbytes:
            counts.failed += 1
            log.warning(
                "peer %s: blob transfer gave %d bytes, expected %d; skipped",
                peer.cluster,
                received,
                nbytes,
            )
            return None
        return elapsed

    def measure_all(
        self,
        peers: list[PeerProbe],
        probe_bytes: int,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[LinkMeasurement]:
        out = []
        for peer in peers:
            if should_stop():
                break
            try:
                m = self.measure(peer, probe_bytes)
            except Exception:  # one bad peer must not stop the others or the agent
                log.exception("peer %s: measurement failed unexpectedly", peer.cluster)
                continue
            if m is not None:
                # keyed by the URL too: a peer that moved starts a fresh window
                key = (peer.cluster, peer.probe_url)
                recent = self._recent.setdefault(key, deque(maxlen=WINDOW))
                recent.append(m)
                report = windowed(recent)
                log.info(
                    "link to %s: %.3f Gbit/s, rtt %.2f ms, loss %.2f (reported: %.3f Gbit/s, "
                    "rtt %.2f ms, best of the last %d)",
                    m.dst,
                    m.bandwidth_gbps,
                    m.rtt_ms,
                    m.loss,
                    report.bandwidth_gbps,
                    report.rtt_ms,
                    len(recent),
                )
                out.append(report)
        return out
