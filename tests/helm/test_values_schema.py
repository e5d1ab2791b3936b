"""Bad values fail at install, with a message naming the field: values.schema.json first, and
the templates' own `fail` (with the reason) for installs that skip schema validation."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest

from tests.helm import chartkit
from tests.helm.chartkit import render, render_raw


def _refusal(values: dict[str, Any]) -> str:
    """The error a `helm install` with these values stops with."""
    with pytest.raises(helm_python.HelmError) as caught:
        render_raw(values)
    return str(caught.value)


def _agent(**overrides: Any) -> dict[str, Any]:
    values = copy.deepcopy(chartkit.AGENT_VALUES)
    values["agent"].update(overrides)
    return values


def test_replicas_above_one_need_postgres() -> None:
    message = _refusal({"controlPlane": {"replicas": 2}})
    assert "/controlPlane/replicas" in message
    assert "/controlPlane/database/existingSecret" in message, "the message names the fix"
    render({"controlPlane": {"replicas": 2, "database": {"existingSecret": "cpn-pg"}}})
    # Without a control plane the replica count is moot.
    render(_agent() | {"controlPlane": {"enabled": False, "replicas": 2}})


@pytest.mark.parametrize("cluster_name", ["", None])
def test_agent_needs_a_cluster_name(cluster_name: str | None) -> None:
    """Empty, or absent (null removes a key in Helm)."""
    message = _refusal(_agent(clusterName=cluster_name))
    assert "clusterName" in message


@pytest.mark.parametrize(
    "url",
    [
        "cpn.example.com",  # no scheme
        "ftp://cpn.example.com",  # not http(s)
        "http//cpn.example.com",  # no colon
        "https://",  # no host
        "https://cpn example.com",  # space in the host
        "",
    ],
)
def test_agent_needs_a_well_formed_controller_url(url: str) -> None:
    message = _refusal(_agent(controllerURL=url))
    assert "controllerURL" in message


@pytest.mark.parametrize(
    "url",
    [
        "http://cpn:8000",
        "https://cpn.example.com/",
        "https://cpn.example.com/api",
        "http://10.0.0.7:8000",
    ],
)
def test_well_formed_controller_urls_pass(url: str) -> None:
    render(_agent(controllerURL=url))


def test_agent_needs_a_token_secret() -> None:
    assert "tokenSecret" in _refusal(_agent(tokenSecret=""))


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"controlPlane": {"replica": 2}}, "replica"),  # typo
        ({"controlPlane": {"replicas": 0}}, "/controlPlane/replicas"),
        ({"controlPlane": {"workers": 0}}, "/controlPlane/workers"),
        ({"controlPlane": {"workers": 65}}, "/controlPlane/workers"),
        ({"controlPlane": {"workers": "4"}}, "/controlPlane/workers"),
        ({"controlPlane": {"service": {"type": "Ingress"}}}, "/controlPlane/service/type"),
        ({"agent": {"discovery": "dns"}}, "/agent/discovery"),
        ({"agent": {"advertiseURL": "probe.example.com:9100"}}, "/agent/advertiseURL"),
        ({"agent": {"clusterName": "dc east"}}, "/agent/clusterName"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"ray": {"enabled": True, "workerGroups": [{"name": "gpu"}]}}, "clusterName"),
        ({"ray": {"workerGroups": [{"name": "GPU"}]}}, "/ray/workerGroups/0/name"),
        ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        ({"networkPolicy": {"enable": False}}, "enable"),
        (
            {"networkPolicy": {"agent": {"peerProbePorts": [0]}}},
            "/networkPolicy/agent/peerProbePorts/0",
        ),
        (
            {"networkPolicy": {"controlPlane": {"extraFrom": [{}]}}},
            "/networkPolicy/controlPlane/extraFrom/0",
        ),
    ],
)
def test_other_bad_values_name_their_field(values: dict[str, Any], field: str) -> None:
    assert field in _refusal(values)


def test_chart_defaults_satisfy_the_schema() -> None:
    with chartkit.load_chart() as chart:
        assert chart.schema is not None
        chart.validate_schema(chart.values)
        for values in chartkit.SCENARIOS.values():
            chart.validate_schema(chart.merge_values(values))


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart as `helm install --skip-schema-validation` sees it."""
    target = tmp_path_factory.mktemp("chart") / "cpn"
    shutil.copytree(chartkit.CHART_DIR, target)
    (target / "values.schema.json").unlink()
    return target


def _template_refusal(chart_dir: Path, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmRenderError) as caught:
        render_raw(values, chart_dir=chart_dir)
    return str(caught.value)


def test_templates_refuse_replicas_without_postgres_and_say_why(
    chart_without_schema: Path,
) -> None:
    message = _template_refusal(chart_without_schema, {"controlPlane": {"replicas": 3}})
    assert "controlPlane.replicas=3 needs PostgreSQL" in message
    assert "controlPlane.database.existingSecret" in message
    assert "ReadWriteOnce" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"clusterName": ""}, "agent.clusterName is required"),
        ({"controllerURL": "cpn.example.com"}, 'agent.controllerURL="cpn.example.com" is not'),
        ({"tokenSecret": ""}, "agent.tokenSecret is required"),
    ],
)
def test_templates_refuse_incomplete_agents(
    chart_without_schema: Path,
    overrides: dict[str, Any],
    expected: str,
) -> None:
    assert expected in _template_refusal(chart_without_schema, _agent(**overrides))


def test_templates_refuse_a_ray_group_without_a_cluster(chart_without_schema: Path) -> None:
    message = _template_refusal(chart_without_schema, {"ray": {"enabled": True}})
    assert "ray.workerGroups[gpu].clusterName is empty" in message
