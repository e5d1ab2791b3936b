"""The agent's loops: heartbeats under the lease, and link probes to the peers it lists.

Nothing here may end the process: every failure is logged and retried, so a controller
that is down, misconfigured or answering garbage never turns into a crash loop. The loops
stop when `stop` is set (SIGTERM/SIGINT in `cpn agent`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from agents.backoff import Backoff
from agents.controller_client import ControllerClient, ControllerError, Rejected
from agents.discovery import DiscoveryError, GpuSource
from agents.links import LinkProber
from agents.protocol import (
    GpuInventory,
    Heartbeat,
    HeartbeatAck,
    LinkMeasurement,
    LinkReport,
    check_probe_url,
)

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
_MIN_INTERVAL_S = 0.05  # a controller that says 0 must not make us spin
_MAX_INTERVAL_S = 3600.0
_NO_PEERS_POLL_S = 0.5
_MAX_RETRY_AFTER_S = 300.0  # a server's Retry-After is honoured, within reason


def _utc(moment: datetime) -> datetime:
    """Controllers send UTC; a naive time is read as UTC rather than failing to compare."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _clamp_interval(seconds: float) -> float:
    return min(_MAX_INTERVAL_S, max(_MIN_INTERVAL_S, seconds))


@dataclass(frozen=True)
class AgentConfig:
    cluster: str
    probe_url: str | None
    agent_version: str = ""

    def __post_init__(self) -> None:
        # Refused here, once, at start: the controller would refuse every heartbeat carrying it.
        if self.probe_url is not None:
            try:
                check_probe_url(self.probe_url)
            except ValueError as exc:
                raise ValueError(f"probe URL {self.probe_url!r} {exc}") from None


class AgentRunner:
    def __init__(
        self,
        config: AgentConfig,
        source: GpuSource,
        controller: ControllerClient,
        *,
        backoff: Backoff | None = None,
        prober: LinkProber | None = None,
        stop: threading.Event | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.source = source
        self.controller = controller
        self.backoff = backoff or Backoff()
        self.prober = prober or LinkProber()
        self.stop = stop or threading.Event()
        self._now = now
        self._gpus: list[GpuInventory] = []
        self._lock = threading.Lock()
        self._last_ack: HeartbeatAck | None = None
        self._failures = 0
        self._lease_warned = False
        self.heartbeats_sent = 0  # attempts, for logs and tests
        self.heartbeats_acked = 0

    @property
    def last_ack(self) -> HeartbeatAck | None:
        with self._lock:
            return self._last_ack

    def _collect(self) -> list[GpuInventory]:
        try:
            self._gpus = self.source.collect()
        except DiscoveryError as exc:
            log.warning("GPU discovery failed, reporting the last known GPUs: %s", exc)
        except Exception:
            log.exception("GPU discovery failed unexpectedly, reporting the last known GPUs")
        return self._gpus

    def beat(self) -> float:
        """Send one heartbeat; return how long to wait before the next one."""
        beat = Heartbeat(
            cluster=self.config.cluster,
            agent_version=self.config.agent_version,
            probe_url=self.config.probe_url,
            discovery=self.source.source,
            gpus=self._collect(),
        )
        self.heartbeats_sent += 1
        try:
            ack = self.controller.heartbeat(beat)
        except ControllerError as exc:
            return self._failed(exc, str(exc), exc.retry_after_s, isinstance(exc, Rejected))
        except Exception as exc:  # a bug must not kill the agent either; log it whole
            log.exception("heartbeat failed unexpectedly")
            return self._failed(exc, f"{type(exc).__name__}: {exc}", None, False)
        self._accepted(ack)
        return _clamp_interval(ack.heartbeat_interval_s)

    def _accepted(self, ack: HeartbeatAck) -> None:
        with self._lock:
            previous, self._last_ack = self._last_ack, ack
        self.heartbeats_acked += 1
        if previous is None or self._failures or previous.state != ack.state:
            after = f" after {self._failures} failed attempts" if self._failures else ""
            log.info(
                "heartbeat accepted%s: cluster %s is %s, lease until %s, %d peers",
                after,
                ack.cluster,
                ack.state,
                ack.lease_expires_at.isoformat(),
                len(ack.peers),
            )
        else:
            log.debug("heartbeat accepted, lease until %s", ack.lease_expires_at.isoformat())
        self._failures = 0
        self._lease_warned = False

    def _failed(
        self, exc: BaseException, message: str, retry_after: float | None, auth: bool
    ) -> float:
        delay = self.backoff.delay(self._failures)
        if retry_after is not None:
            delay = max(delay, min(retry_after, _MAX_RETRY_AFTER_S))
        self._failures += 1
        level = logging.ERROR if auth else logging.WARNING
        log.log(
            level,
            "heartbeat failed (attempt %d): %s; retrying in %.1f s",
            self._failures,
            message,
            delay,
        )
        ack = self.last_ack
        if ack is not None and not self._lease_warned and self._now() >= _utc(ack.lease_expires_at):
            self._lease_warned = True
            log.warning(
                "lease expired at %s: the controller will mark cluster %s SUSPECT, "
                "then DOWN, until a heartbeat gets through",
                ack.lease_expires_at.isoformat(),
                self.config.cluster,
            )
        return delay

    def run_heartbeats(self, iterations: int | None = None) -> None:
        """Beat until `stop` is set (or `iterations` attempts were made)."""
        done = 0
        while not self.stop.is_set():
            try:
                delay = self.beat()
            except Exception:  # last line of defence: the agent must never crash-loop
                log.exception("heartbeat round failed unexpectedly")
                delay = self.backoff.delay(self._failures)
            done += 1
            if iterations is not None and done >= iterations:
                return
            self.stop.wait(delay)

    def probe_round(self) -> list[LinkMeasurement]:
        """Measure the links to the peers of the last ack and report them; return them."""
        ack = self.last_ack
        if ack is None:
            return []
        peers = [p for p in ack.peers if p.cluster != self.config.cluster]
        links = self.prober.measure_all(peers, ack.probe_bytes, should_stop=self.stop.is_set)
        if not links:
            return links
        try:
            self.controller.report_links(LinkReport(cluster=self.config.cluster, links=links))
        except ControllerError as exc:
            log.warning("link report failed, measuring again next round: %s", exc)
        except Exception:
            log.exception("link report failed unexpectedly")
        else:
            log.info("reported %d link measurements", len(links))
        return links

    def run_probes(self) -> None:
        while not self.stop.is_set():
            ack = self.last_ack
            if ack is None or not ack.peers:
                self.stop.wait(_NO_PEERS_POLL_S)
                continue
            try:
                self.probe_round()
            except Exception:
                log.exception("probe round failed unexpectedly")
            self.stop.wait(_clamp_interval(ack.probe_interval_s))

    def run(self, iterations: int | None = None) -> None:
        """Heartbeats on this thread, probes on another, until stopped."""
        prober = threading.Thread(target=self.run_probes, name="cpn-link-prober", daemon=True)
        prober.start()
        try:
            self.run_heartbeats(iterations)
        finally:
            self.stop.set()
            prober.join(timeout=5)
