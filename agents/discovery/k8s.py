"""GPU discovery through the Kubernetes API, when the agent runs in a pod.

Reads nodes: `status.capacity` / `status.allocatable` of the `nvidia.com/gpu` resource (the
NVIDIA device plugin), the product from the `nvidia.com/gpu.product` label and the memory per
GPU from `nvidia.com/gpu.memory` (MiB), both set by GPU Feature Discovery. GPUs on nodes that
are not Ready or are cordoned count as present but not allocatable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agents.discovery import DiscoveryError
from agents.protocol import GpuInventory

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
_PAGE = 500
_TIMEOUT_S = 10.0


@dataclass
class _Group:
    count: int = 0
    allocatable: int = 0


def _gpus(quantities: dict[str, str] | None) -> int:
    from kubernetes.utils import parse_quantity

    if not quantities or GPU_RESOURCE not in quantities:
        return 0
    try:
        return max(0, int(parse_quantity(quantities[GPU_RESOURCE])))
    except ValueError:
        return 0


def _ready(node: Any) -> bool:
    conditions = node.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _memory_gib(labels: dict[str, str]) -> float:
    raw = labels.get(MEMORY_LABEL)
    if raw is None:
        return 0.0
    try:
        return round(int(raw) / 1024, 2)
    except ValueError:
        return 0.0


def _default_api_client(in_pod: bool) -> Any:
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if in_pod:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(client_configuration=cfg)
    except (config.ConfigException, OSError) as exc:
        where = (
            "in-cluster service account" if in_pod else "kubeconfig (KUBECONFIG or ~/.kube/config)"
        )
        raise DiscoveryError(
            f"--discovery: kubernetes: cannot load the {where}: {exc}; "
            "run in a pod with a service account or choose another --discovery mode"
        ) from None
    return client.ApiClient(cfg)


class KubernetesSource:
    source: Literal["kubernetes"] = "kubernetes"

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._api = client.CoreV1Api(api_client)
        self._api_client = api_client
        self._warned_memory: set[str] = set()

    @classmethod
    def connect(
        cls, api_client_factory: Callable[[], Any] | None, *, in_pod: bool
    ) -> KubernetesSource:
        api_client = (
            api_client_factory() if api_client_factory is not None else _default_api_client(in_pod)
        )
        return cls(api_client)

    def _nodes(self) -> list[Any]:
        from kubernetes.client.exceptions import ApiException

        nodes: list[Any] = []
        token: str | None = None
        try:
            while True:
                kwargs: dict[str, Any] = {"limit": _PAGE, "_request_timeout": _TIMEOUT_S}
                if token:
                    kwargs["_continue"] = token
                page = self._api.list_node(**kwargs)
                nodes.extend(page.items or [])
                token = page.metadata._continue if page.metadata is not None else None
                if not token:
                    return nodes
        except ApiException as exc:
            hint = (
                "; grant the agent's service account 'list' on nodes (ClusterRole)"
                if exc.status in (401, 403)
                else ""
            )
            raise DiscoveryError(
                "--discovery: kubernetes: listing nodes failed: "
                f"HTTP {exc.status} {exc.reason}{hint}"
            ) from None
        except Exception as exc:  # urllib3 connection and decode errors have no common base
            raise DiscoveryError(
                f"--discovery: kubernetes: listing nodes failed: {type(exc).__name__}: {exc}"
            ) from None

    def collect(self) -> list[GpuInventory]:
        groups: dict[tuple[str, float], _Group] = {}
        for node in self._nodes():
            capacity = _gpus(node.status.capacity)
            allocatable = _gpus(node.status.allocatable)
            present = max(capacity, allocatable)
            if present == 0:
                continue
            labels = node.metadata.labels or {}
            product = str(labels.get(PRODUCT_LABEL) or "unknown")[:128]
            memory = _memory_gib(labels)
            if memory == 0.0 and product not in self._warned_memory:
                self._warned_memory.add(product)
                log.warning(
                    "node %s: no %s label; reporting memory 0 GiB for %s",
                    node.metadata.name,
                    MEMORY_LABEL,
                    product,
                )
            usable = node.spec is None or not node.spec.unschedulable
            group = groups.setdefault((product, memory), _Group())
            group.count += present
            group.allocatable += allocatable if (usable and _ready(node)) else 0
        return [
            GpuInventory(model=product, memory_gib=memory, count=g.count, allocatable=g.allocatable)
            for (product, memory), g in sorted(groups.items())
        ]

    def close(self) -> None:
        self._api_client.close()
