"""GPU discovery: which GPUs does this cluster have?

Three sources behind one small interface, tried in this order when the mode is `auto`:
NVML (a driver on this host), the Kubernetes API (the agent runs in a pod), a declared
inventory file. Sources are re-read on every heartbeat so allocatable counts and
utilisation stay current.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from agents.protocol import DiscoverySource, GpuInventory

DiscoveryMode = Literal["auto", "nvml", "kubernetes", "inventory"]


class DiscoveryError(Exception):
    """No usable GPU source, or a source failed; the message names the flag or field to fix."""


class GpuSource(Protocol):
    """Where the agent's GPU inventory comes from."""

    @property
    def source(self) -> DiscoverySource: ...

    def collect(self) -> list[GpuInventory]:
        """The cluster's GPUs now; raises DiscoveryError when the source cannot answer."""
        ...

    def close(self) -> None: ...


def in_kubernetes_pod(environ: Mapping[str, str]) -> bool:
    """Kubernetes injects KUBERNETES_SERVICE_HOST into every container of a pod."""
    return bool(environ.get("KUBERNETES_SERVICE_HOST"))


def select_source(
    mode: DiscoveryMode,
    inventory: Path | None,
    *,
    environ: Mapping[str, str] | None = None,
    nvml: Any = None,
    kube_api_client: Callable[[], Any] | None = None,
) -> GpuSource:
    """Pick the GPU source for `mode`, the first that applies when `mode` is auto.

    `nvml` stands in for the pynvml module and `kube_api_client` builds the Kubernetes
    ApiClient; both default to the real thing and exist so tests can use recorded responses.
    """
    from agents.discovery import inventory as inventory_mod
    from agents.discovery import k8s, nvml_source

    env = os.environ if environ is None else environ
    if mode == "nvml":
        opened = nvml_source.open_nvml(nvml)
        if opened is None:
            raise DiscoveryError(
                "--discovery: nvml: no NVIDIA driver answered (nvmlInit failed); "
                "install the driver or choose another --discovery mode"
            )
        return opened
    if mode == "kubernetes":
        return k8s.KubernetesSource.connect(kube_api_client, in_pod=in_kubernetes_pod(env))
    if mode == "inventory":
        if inventory is None:
            raise DiscoveryError("--inventory: required with --discovery inventory; pass FILE")
        return inventory_mod.InventorySource.load(inventory)
    # auto: first that applies.
    opened = nvml_source.open_nvml(nvml)
    if opened is not None:
        return opened
    if in_kubernetes_pod(env):
        return k8s.KubernetesSource.connect(kube_api_client, in_pod=True)
    if inventory is not None:
        return inventory_mod.InventorySource.load(inventory)
    raise DiscoveryError(
        "--inventory: no GPU source found (no NVIDIA driver, not in a Kubernetes pod); "
        "pass --inventory FILE declaring the cluster's GPUs"
    )
