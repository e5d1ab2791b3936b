"""Which GPU source `auto` picks: NVML, then Kubernetes (in a pod), then the inventory file."""

from pathlib import Path

import pynvml
import pytest

from agents.discovery import DiscoveryError, select_source
from tests.agents.test_k8s import FakeApiServer
from tests.agents.test_nvml import DGX_MIXED, RecordedNvml

IN_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text("gpus: [{model: T4, memory_gib: 16, count: 2}]")
    return path


@pytest.fixture
def kube():
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def no_driver():
    return RecordedNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_nvml_first_when_a_driver_answers(inventory, kube):
    src = select_source(
        "auto",
        inventory,
        environ=IN_POD,
        nvml=RecordedNvml(DGX_MIXED),
        kube_api_client=kube.api_client,
    )
    assert src.source == "nvml"


def test_kubernetes_next_in_a_pod(inventory, kube):
    src = select_source(
        "auto", inventory, environ=IN_POD, nvml=no_driver(), kube_api_client=kube.api_client
    )
    assert src.source == "kubernetes"
    assert sum(g.count for g in src.collect()) == 34


def test_inventory_last(inventory, kube):
    src = select_source(
        "auto", inventory, environ={}, nvml=no_driver(), kube_api_client=kube.api_client
    )
    assert src.source == "inventory"
    assert kube.requests == []


def test_nothing_applies_asks_for_an_inventory():
    with pytest.raises(DiscoveryError, match=r"^--inventory: no GPU source found"):
        select_source("auto", None, environ={}, nvml=no_driver())


def test_forced_modes(inventory, kube):
    assert (
        select_source("inventory", inventory, environ=IN_POD, nvml=RecordedNvml(DGX_MIXED)).source
        == "inventory"
    )
    assert (
        select_source(
            "kubernetes",
            None,
            environ={},
            nvml=RecordedNvml(DGX_MIXED),
            kube_api_client=kube.api_client,
        ).source
        == "kubernetes"
    )
    with pytest.raises(DiscoveryError, match=r"^--discovery: nvml: no NVIDIA driver"):
        select_source("nvml", inventory, environ={}, nvml=no_driver())
    with pytest.raises(DiscoveryError, match=r"^--inventory: required"):
        select_source("inventory", None, environ={}, nvml=no_driver())


def test_forced_kubernetes_outside_a_pod_without_kubeconfig(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    with pytest.raises(DiscoveryError, match=r"^--discovery: kubernetes: cannot load"):
        select_source("kubernetes", None, environ={}, nvml=no_driver())
