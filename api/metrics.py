"""Prometheus metrics: request rate and latency by route, heartbeats, cluster states, failed
authentications and rate-limit refusals, placement latency, link bandwidth and WAN bytes, and
queue and quota gauges per tenant and cluster. Names and values in base units (seconds,
bytes), as `promtool check metrics` asks.

`helm/cpn/dashboards/cpn.json` (the Grafana dashboard) queries these; its test checks that
every metric it names is exported here."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where prometheus_client keeps each worker's counters (its own variable, read at import)."""


class Metrics:
    """One registry per app, so several apps in one process (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cpn_http_requests_total",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "cpn_http_request_seconds",
            "HTTP request latency by route template.",
            ["route", "method"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "cpn_agent_heartbeats_total", "Agent heartbeats accepted.", registry=self.registry
        )
        # What the database says, read at scrape: the same from every replica and worker.
        self.cluster_states = Scraped("cpn_clusters", "Clusters by state.", ("state",))
        self.gpus = Scraped(
            "cpn_gpus", "GPUs by model and kind (count, allocatable, in_use).", ("model", "kind")
        )
        self.jobs = Scraped("cpn_jobs", "Jobs by state.", ("state",))
        self.lease_transitions = Counter(
            "cpn_cluster_transitions_total",
            "Cluster state changes made by the lease monitor.",
            ["to_state"],
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "cpn_auth_failures_total",
            "Requests answered 401: no key (missing) or a key unknown, revoked or expired "
            "(rejected).",
            ["reason"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "cpn_rate_limited_total",
            "Requests answered 429, by the limit that refused them "
            "(key, agent, auth_failures, quotes).",
            ["limit"],
            registry=self.registry,
        )
        placement_buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.placement = Histogram(
            "cpn_placement_seconds",
            "Seconds one job's placement took to decide (plan, budget, reservation).",
            buckets=placement_buckets,
            registry=self.registry,
        )
        self.placement_wait = Histogram(
            "cpn_placement_wait_seconds",
            "Seconds from a job's submission until its GPUs were reserved.",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400),
            registry=self.registry,
        )
        self.wan_ports = Scraped(
            "cpn_wan_port_bytes_per_second",
            "Each datacenter's WAN uplink and downlink: what placed jobs reserve of it "
            "(reserved) and the capacity an admin declared (capacity), bytes per second.",
            ("cluster", "direction", "kind"),
        )
        self.link_bandwidth = Scraped(
            "cpn_link_bandwidth_bytes_per_second",
            "Effective bandwidth of each WAN link (measured over declared), bytes per second.",
            ("src", "dst", "source"),
        )
        self.link_free = Scraped(
            "cpn_link_free_bytes_per_second",
            "What each measured WAN link's newest probe carried beside the traffic on it, "
            "bytes per second (its capacity: cpn_link_bandwidth_bytes_per_second).",
            ("src", "dst"),
        )
        self.link_rtt = Scraped(
            "cpn_link_rtt_seconds",
            "Effective round-trip time of each WAN link, seconds.",
            ("src", "dst", "source"),
        )
        self.wan_bytes = Scraped(
            "cpn_wan_bytes",
            "WAN bytes metered per link since the start.",
            ("src", "dst"),
            CounterMetricFamily,
        )
        # Kueue's queue and quota gauges, per tenant (its queue) and per cluster.
        self.tenant_jobs = Scraped(
            "cpn_tenant_jobs",
            "Each tenant's jobs not yet finished, by state (PENDING: waiting for a placement).",
            ("tenant", "state"),
        )
        self.tenant_gpus = Scraped(
            "cpn_tenant_gpus",
            "GPUs each tenant's jobs hold now (in_use) and its quota (quota; absent: none).",
            ("tenant", "kind"),
        )
        self.tenant_dollars = Scraped(
            "cpn_tenant_dollars",
            "Each tenant's money: its ledger's total (charged), what its running jobs are "
            "estimated to cost yet (held), and its budget (budget; absent: none), dollars.",
            ("tenant", "kind"),
        )
        self.provider_dollars = Scraped(
            "cpn_provider_dollars",
            "Each provider's books: credited for its resources less the fee (earned), paid out "
            "(paid), and owed now (owed), dollars.",
            ("provider", "kind"),
        )
        self.cluster_gpus = Scraped(
            "cpn_cluster_gpus",
            "GPUs of each cluster (count, allocatable, in_use).",
            ("cluster", "kind"),
        )
        self.cluster_jobs = Scraped(
            "cpn_cluster_jobs", "Jobs holding GPUs on each cluster now.", ("cluster",)
        )
        self.scraped = (
            self.cluster_states,
            self.gpus,
            self.jobs,
            self.link_bandwidth,
            self.link_free,
            self.link_rtt,
            self.wan_ports,
            self.wan_bytes,
            self.tenant_jobs,
            self.tenant_gpus,
            self.tenant_dollars,
            self.provider_dollars,
            self.cluster_gpus,
            self.cluster_jobs,
        )
        for collector in self.scraped:
            self.registry.register(collector)

    def exposition(self) -> bytes:
        """The text Prometheus reads. Under `cpn serve --workers N` (PROMETHEUS_MULTIPROC_DIR
        set) the counters and histograms are summed over every worker, dead ones included, so
        a scrape that lands on any worker sees the whole server."""
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path)
        for collector in self.scraped:
            registry.register(collector)
        return generate_latest(registry)

    def observe_placement(self, waited_s: float, decided_s: float) -> None:
        self.placement.observe(decided_s)
        self.placement_wait.observe(waited_s)


class Scraped(Collector):
    """A gauge or counter whose values live in the database and are set at each scrape (so
    every replica and every worker reports the same), never kept in this process's files."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, ...],
        family: type[GaugeMetricFamily] | type[CounterMetricFamily] = GaugeMetricFamily,
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.family = family
        self.values: dict[tuple[str, ...], float] = {}

    def set_all(self, values: Mapping[tuple[str, ...], float]) -> None:
        """Replace every value: label sets not given are gone (links come and go)."""
        self.values = dict(values)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = self.family(self.name, self.documentation, labels=self.labels)
        for labels, value in sorted(self.values.items()):
            family.add_metric(list(labels), value)
        yield family


class MetricsMiddleware:
    """Counts and times requests by route template (never raw paths: bounded label sets)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(path, method, str(status)).inc()
            self.metrics.latency.labels(path, method).observe(time.perf_counter() - start)
