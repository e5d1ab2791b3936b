"""The Grafana dashboard: every query names metrics a live cpn exports, and the chart ships it
as a ConfigMap with the label Grafana's dashboard sidecar looks for."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.protocol import GpuInventory, Heartbeat
from api.processes import wait_until
from tests.conftest import LiveServer, start_server
from tests.helm import chartkit

DASHBOARD = chartkit.CHART_DIR / "dashboards" / "cpn.json"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}
METRIC = re.compile(r"\b(cpn_[a-zA-Z0-9_:]+)\b")
SELECTOR = re.compile(r"\b(cpn_[a-zA-Z0-9_:]+)\{([^}]*)\}")
ON = {"controlPlane": {"grafanaDashboard": {"enabled": True}}}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold theirs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(scope="module")
def exported(migrated_url: str) -> dict[str, set[str]]:
    """Every sample name a live server's /metrics can carry, with the label names seen, after
    a link is declared and an agent reported GPUs (so the labelled gauges have samples)."""
    live: LiveServer = start_server(database_url=migrated_url, run_controller=False)
    east, west = (f"{side}-{uuid.uuid4().hex[:6]}" for side in ("east", "west"))
    try:
        with live.client() as client:
            client.create_cluster(east, "us-east")
            client.create_cluster(west, "us-west")
            client.declare_link(east, west, bandwidth_gbps=10, rtt_ms=70)
            token = client.create_api_key("agent", east)["token"]
            tenant = f"acme-{uuid.uuid4().hex[:6]}"  # so the per-tenant gauges have samples
            client.post("/v1/tenants", {"name": tenant, "gpu_quota": 8, "budget": 100})
        beat = Heartbeat(
            cluster=east,
            gpus=[GpuInventory(model="A100", memory_gib=80, count=8, allocatable=8)],
        )
        with live.client(token) as agent:  # GPUs reported, so cpn_gpus has samples
            agent.post("/v1/agent/heartbeat", beat.model_dump(mode="json", exclude_unset=True))
        text = httpx.get(f"{live.url}/metrics", timeout=30).text
    finally:
        live.stop()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_every_panel_queries_only_metrics_cpn_exports(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    queried: set[str] = set()
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            assert names, f"{panel['title']!r}: {target['expr']} names no cpn metric"
            unknown = names - exported.keys()
            assert not unknown, f"{panel['title']!r} queries {unknown}, which cpn does not export"
            for name, matchers in SELECTOR.findall(target["expr"]):
                labels = {m.split("=")[0].strip() for m in matchers.split(",") if m.strip()}
                assert labels <= exported[name], f"{panel['title']!r}: {name} has no {labels}"
            queried |= names
    # What the issue asks the dashboard to show is there.
    for wanted in (
        "cpn_clusters",
        "cpn_gpus",
        "cpn_link_bandwidth_bytes_per_second",
        "cpn_jobs",
        "cpn_placement_seconds_bucket",
        "cpn_wan_bytes_total",
        "cpn_http_request_seconds_bucket",
        "cpn_tenant_jobs",
        "cpn_tenant_gpus",
        "cpn_cluster_gpus",
    ):
        assert wanted in queried, f"no panel shows {wanted}"
    assert {"src", "dst", "source"} <= exported["cpn_link_bandwidth_bytes_per_second"]


def test_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    """What Grafana needs to import it: a stable uid, a Prometheus datasource variable that
    every query uses, unique panel ids."""
    assert dashboard["uid"] == "cpn-overview" and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_chart_ships_the_dashboard_in_a_labelled_configmap_when_enabled() -> None:
    assert not [d for d in chartkit.render().of_kind("ConfigMap") if "grafana_dashboard" in str(d)]
    rendered = chartkit.render(ON)
    config_map = rendered.one("ConfigMap", "dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == chartkit.NAMESPACE
    assert json.loads(config_map["data"]["cpn.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(
        config_map, kubernetes_validate.utils.latest_version(), strict=True
    )

    moved = chartkit.render(
        {
            "controlPlane": {
                "grafanaDashboard": {
                    "enabled": True,
                    "namespace": "monitoring",
                    "labels": {"grafana_dashboard": "cpn"},
                    "annotations": {"grafana_folder": "cpn"},
                }
            }
        }
    ).one("ConfigMap", "dashboard")
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["labels"]["grafana_dashboard"] == "cpn"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "cpn"}
    no_control_plane = {"enabled": False, "grafanaDashboard": {"enabled": True}}
    agent_only = chartkit.render({**chartkit.AGENT_VALUES, "controlPlane": no_control_plane})
    assert not [d for d in agent_only.of_kind("ConfigMap") if "dashboard" in d["metadata"]["name"]]


def _placements(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "cpn_placement_wait_seconds":
            return sum(s.value for s in family.samples if s.name.endswith("_count"))
    return 0.0


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_the_controller_times_each_placement(db_url: str) -> None:
    """The placement panels have data: the controller of `cpn serve` reports each job it
    places (no Ray: jobs are placed, not launched)."""
    from tests.service.conftest import build_network, spec

    live = start_server(database_url=db_url, launch_jobs=False, reconcile_interval_s=0.1)
    try:
        net = build_network(live)
        assert _placements(live.url) == 0
        job = net.tenant.submit(spec(gpus=2))
        wait_until(lambda: _placements(live.url) >= 1, 60, "a placement counted in /metrics")
        assert net.tenant.job(job.id).state in ("SCHEDULED", "RUNNING")
        for c in (net.admin, net.tenant, net.other):
            c.close()
    finally:
        live.stop()
