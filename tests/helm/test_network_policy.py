"""The chart's NetworkPolicies let through exactly the traffic each component needs.

The rendered policies are evaluated here as Kubernetes does (a pod selected by a policy of a
type is isolated for that direction; a connection needs the sender's egress and the receiver's
ingress to allow it; rules and peers are unions, selectors and named ports as the API defines
them) over a small world: the release's own pods as rendered, pods of other namespaces and
releases, and addresses outside the cluster.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import pytest

from tests.helm import chartkit
from tests.helm.chartkit import NAMESPACE, Rendered, render

_ips = count(10)


@dataclass(frozen=True)
class Pod:
    """A pod: its namespace, labels, named container ports and address."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int] = field(default_factory=dict)
    ip: str = field(default_factory=lambda: f"10.244.0.{next(_ips)}")


@dataclass(frozen=True)
class Outside:
    """An address outside the cluster: another datacenter, a database, the internet."""

    name: str
    ip: str


Endpoint = Pod | Outside

NAMESPACE_LABELS: dict[str, dict[str, str]] = {
    ns: {"kubernetes.io/metadata.name": ns}
    for ns in (NAMESPACE, "kube-system", "ingress-nginx", "monitoring", "tenant-a", "dc-lab")
}


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector: matchLabels and matchExpressions, all of them; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if not isinstance(other, Pod):
        return False  # pod and namespace selectors match pods only
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], NAMESPACE_LABELS[other.namespace]):
            return False
    elif other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], other.labels)


def _port_matches(
    ports: list[dict[str, Any]] | None, target: Endpoint, port: int, protocol: str
) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        want = entry.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            # A named port is the receiving pod's container port of that name.
            if isinstance(target, Pod) and target.ports.get(want) == port:
                return True
        elif want <= port <= entry.get("endPort", want):
            return True
    return False


def _direction_allows(
    policies: list[dict[str, Any]],
    pod: Endpoint,
    other: Endpoint,
    receiver: Endpoint,
    port: int,
    protocol: str,
    kind: str,
) -> bool:
    """Whether `pod`'s policies of `kind` (Ingress or Egress) let it talk with `other`."""
    if not isinstance(pod, Pod):
        return True  # outside the cluster: no NetworkPolicy applies
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and _selects(p["spec"]["podSelector"], pod.labels)
        and kind in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True  # not isolated in this direction
    key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    for policy in selecting:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if peers and not any(
                _peer_matches(peer, policy["metadata"]["namespace"], other) for peer in peers
            ):
                continue
            if _port_matches(rule.get("ports"), receiver, port, protocol):
                return True
    return False


def allowed(
    policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """A connection from src to dst's port: the sender's egress and the receiver's ingress."""
    return _direction_allows(
        policies, src, dst, dst, port, protocol, "Egress"
    ) and _direction_allows(policies, dst, src, dst, port, protocol, "Ingress")


@dataclass
class World:
    policies: list[dict[str, Any]]
    pods: dict[str, Pod]
    outside: dict[str, Outside]

    def __getitem__(self, name: str) -> Endpoint:
        return self.pods.get(name) or self.outside[name]

    def can(self, src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        return allowed(self.policies, self[src], self[dst], port, protocol)


_ROLE_OF_COMPONENT = {
    "control-plane": "control-plane",
    "migrations": "migrate",
    "agent": "agent",
    "ray-head": "ray-head",
    "ray-worker": "ray-worker",
}


def _release_pods(rendered: Rendered) -> dict[str, Pod]:
    pods: dict[str, Pod] = {}
    for owner, template in chartkit.pod_templates(rendered):
        labels = template["metadata"]["labels"]
        role = _ROLE_OF_COMPONENT[labels["app.kubernetes.io/component"]]
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        assert role not in pods, f"two pods of role {role}"
        pods[role] = Pod(role, owner["metadata"]["namespace"], labels, ports)
    return pods


def world(values: dict[str, Any], *, api_versions: list[str] | None = None) -> World:
    rendered = render(values, api_versions=api_versions)
    pods = _release_pods(rendered)
    pods.update(
        {
            "dns": Pod("dns", "kube-system", {"k8s-app": "kube-dns"}),
            "ingress-controller": Pod(
                "ingress-controller", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}
            ),
            "prometheus": Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
            # A tenant's pod, and a pod beside the release that is no agent.
            "tenant": Pod("tenant", "tenant-a", {"app": "notebook"}),
            "neighbour": Pod(
                "neighbour",
                NAMESPACE,
                {"app.kubernetes.io/name": "cpn", "app.kubernetes.io/component": "other"},
            ),
            # Another release's agent in this Kubernetes cluster.
            "other-agent": Pod(
                "other-agent",
                "dc-lab",
                {"app.kubernetes.io/part-of": "cpn", "app.kubernetes.io/component": "agent"},
            ),
        }
    )
    outside = {
        "internet": Outside("internet", "198.51.100.7"),
        "remote-dc": Outside("remote-dc", "203.0.113.9"),
        "database": Outside("database", "192.0.2.20"),
    }
    return World(rendered.of_kind("NetworkPolicy"), pods, outside)


HUB = {  # control plane on PostgreSQL behind an Ingress, an agent and Ray in the same release
    **copy.deepcopy(chartkit.RAY_VALUES),
    "controlPlane": {
        "database": {"existingSecret": "cpn-pg"},
        "ingress": {"enabled": True, "className": "nginx"},
    },
}
PROMETHEUS = ["monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor"]
RELEASE_ROLES = ("control-plane", "migrate", "agent", "ray-head", "ray-worker")


@pytest.fixture(scope="module")
def hub() -> World:
    return world(HUB, api_versions=PROMETHEUS)


def test_every_pod_of_the_release_is_isolated_both_ways(hub: World) -> None:
    assert set(RELEASE_ROLES) <= set(hub.pods)
    for role in RELEASE_ROLES:
        pod = hub.pods[role]
        for kind in ("Ingress", "Egress"):
            assert any(
                _selects(p["spec"]["podSelector"], pod.labels) and kind in p["spec"]["policyTypes"]
                for p in hub.policies
            ), f"no NetworkPolicy isolates {role} for {kind}"
        # Nothing from outside the allow-lists, on any port.
        for port in (22, 8000, 8265, 9100, 10001):
            assert not hub.can("tenant", role, port), (role, port)
            assert not hub.can("internet", role, port), (role, port)


def test_control_plane_only_from_agents_the_ingress_and_prometheus(hub: World) -> None:
    for source in ("agent", "other-agent", "ingress-controller", "prometheus"):
        assert hub.can(source, "control-plane", 8000), source
    for source in (
        "tenant",
        "neighbour",
        "ray-head",
        "ray-worker",
        "migrate",
        "dns",
        "internet",
        "remote-dc",
    ):
        assert not hub.can(source, "control-plane", 8000), source
    assert not hub.can("agent", "control-plane", 8001), "the API port only"


def test_control_plane_egress(hub: World) -> None:
    assert hub.can("control-plane", "dns", 53, "UDP")
    assert hub.can("control-plane", "dns", 53, "TCP")
    assert hub.can("control-plane", "database", 5432)
    assert hub.can("control-plane", "ray-head", 10001), "it submits jobs to its Ray"
    assert not hub.can("control-plane", "ray-head", 6379), "through the client port only"
    assert not hub.can("control-plane", "ray-worker", 10001)
    assert not hub.can("control-plane", "agent", 9100), "the control plane never calls agents"
    assert not hub.can("control-plane", "internet", 443)
    assert not hub.can("control-plane", "tenant", 53, "UDP"), "DNS means kube-dns"


def test_agent_probe_only_from_agents(hub: World) -> None:
    assert hub.can("other-agent", "agent", 9100)
    for source in (
        "control-plane",
        "ray-head",
        "ray-worker",
        "tenant",
        "neighbour",
        "remote-dc",
        "internet",
    ):
        assert not hub.can(source, "agent", 9100), source
    assert not hub.can("other-agent", "agent", 9101), "the probe port only"


def test_agent_egress(hub: World) -> None:
    assert hub.can("agent", "dns", 53, "UDP")
    assert hub.can("agent", "control-plane", 8000)
    # Peers in other datacenters (their probe URLs name hosts) and the Kubernetes API.
    assert hub.can("agent", "remote-dc", 9100)
    assert hub.can("agent", "internet", 6443)
    assert not hub.can("agent", "database", 5432)
    assert not hub.can("agent", "ray-head", 10001)
    assert not hub.can("agent", "internet", 22)


def test_ray_ports_only_from_its_own_pods_and_the_control_plane(hub: World) -> None:
    for port in (6379, 8265, 10001, 12345):
        assert hub.can("ray-worker", "ray-head", port), port
        assert hub.can("ray-head", "ray-worker", port), port
    assert hub.can("control-plane", "ray-head", 10001)
    for source in ("agent", "tenant", "neighbour", "migrate", "internet"):
        for port in (6379, 8265, 10001):
            assert not hub.can(source, "ray-head", port), (source, port)
    assert hub.can("ray-worker", "dns", 53, "UDP")
    for target in ("control-plane", "agent", "internet", "database"):
        assert not hub.can("ray-worker", target, 443), target


def test_migration_job_takes_nothing_and_reaches_the_database(hub: World) -> None:
    assert hub.can("migrate", "database", 5432)
    assert hub.can("migrate", "dns", 53, "UDP")
    assert not hub.can("migrate", "internet", 443)
    assert not hub.can("migrate", "control-plane", 8000)
    for source in ("control-plane", "agent", "tenant"):
        assert not hub.can(source, "migrate", 8000), source
    policy = next(p for p in hub.policies if p["metadata"]["name"].endswith("-migrate"))
    # In force before the Job runs, on the first install too.
    annotations = policy["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    job = render(HUB).one("Job", "migrate")
    assert int(annotations["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )


def test_default_release_reaches_no_database_and_takes_no_ingress_traffic() -> None:
    w = world(chartkit.DEFAULT_VALUES)
    assert set(w.pods) >= {"control-plane", "migrate"}
    assert not w.can("control-plane", "database", 5432), "SQLite: no database to reach"
    assert not w.can("migrate", "database", 5432)
    assert not w.can("ingress-controller", "control-plane", 8000), "no Ingress, no rule"
    assert not w.can("prometheus", "control-plane", 8000), "no ServiceMonitor, no rule"
    assert w.can("other-agent", "control-plane", 8000)
    assert w.can("control-plane", "dns", 53, "UDP")
    assert not w.can("control-plane", "internet", 10001), "a local Ray stays in the pod"


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("https://cpn.example.com", 443),
        ("http://cpn.example.com", 80),
        ("https://cpn.example.com:8443/api", 8443),
        ("http://10.0.0.7:8000", 8000),
    ],
)
def test_agent_reaches_the_controller_url_port(url: str, port: int) -> None:
    values = copy.deepcopy(chartkit.AGENT_VALUES)
    values["agent"].update(
        {"controllerURL": url, "discovery": "inventory", "inventory": "gpus: []\n"}
    )
    w = world(values)
    assert w.can("agent", "internet", port)
    if port != 443:
        # Declared GPUs need no Kubernetes API, so 443 is no longer open for it.
        assert not w.can("agent", "internet", 443)
    assert not w.can("agent", "internet", 6443)


def test_peers_named_in_values_are_let_in() -> None:
    values = copy.deepcopy(HUB)
    values["networkPolicy"] = {
        "agent": {"probeFrom": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]},
        "controlPlane": {
            "extraFrom": [{"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.9/32"]}}]
        },
        "ray": {
            "clientFrom": [{"ipBlock": {"cidr": "198.51.100.0/24"}}],
            "dashboardFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        },
    }
    w = world(values)
    assert w.can("remote-dc", "agent", 9100)
    assert not w.can("internet", "agent", 9100)
    assert not w.can("remote-dc", "control-plane", 8000), "the except block holds"
    assert w.can("internet", "ray-head", 10001)
    assert not w.can("internet", "ray-head", 6379)
    assert not w.can("internet", "ray-worker", 10001), "the client port is the head's"
    assert w.can("prometheus", "ray-head", 8265)
    assert not w.can("prometheus", "ray-head", 10001)


def test_ingress_controller_selector_is_configurable() -> None:
    values = copy.deepcopy(HUB)
    values["networkPolicy"] = {
        "controlPlane": {
            "ingressController": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dc-lab"}},
                    "podSelector": {"matchLabels": {"app": "traefik"}},
                }
            ]
        }
    }
    w = world(values)
    assert not w.can("ingress-controller", "control-plane", 8000)
    traefik = Pod("traefik", "dc-lab", {"app": "traefik"})
    assert allowed(w.policies, traefik, w["control-plane"], 8000)


@pytest.mark.parametrize(
    ("address", "open_port", "closed_port"),
    [
        ("ray://ray.dc-east.example.com:10001", 10001, 6379),
        ("ray://ray.dc-east.example.com", 10001, 6379),
        ("ray-head.ray:6379", 6379, 10001),
    ],
)
def test_control_plane_reaches_an_external_ray(
    address: str, open_port: int, closed_port: int
) -> None:
    w = world({"controlPlane": {"rayAddress": address}})
    assert w.can("control-plane", "internet", open_port)
    assert not w.can("control-plane", "internet", closed_port)


def test_extra_egress_rules_are_added() -> None:
    s3 = {"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}], "ports": [{"port": 443}]}
    w = world({"networkPolicy": {"controlPlane": {"extraEgress": [s3]}}})
    assert w.can("control-plane", "database", 443)
    assert not w.can("control-plane", "internet", 443)


def test_network_policies_can_be_turned_off() -> None:
    for values in chartkit.SCENARIOS.values():
        off = copy.deepcopy(values) | {"networkPolicy": {"enabled": False}}
        assert render(off).of_kind("NetworkPolicy") == []
        assert render(values).of_kind("NetworkPolicy")


def test_the_evaluator_is_not_vacuous(hub: World) -> None:
    """Without the policies everything is open, so the denials above come from the chart."""
    open_world = World([], hub.pods, hub.outside)
    assert open_world.can("tenant", "control-plane", 8000)
    assert open_world.can("internet", "ray-head", 6379)
    assert not allowed(hub.policies, hub["tenant"], hub["control-plane"], 8000)


def test_dns_peers_are_configurable() -> None:
    node_local = [{"ipBlock": {"cidr": "169.254.20.10/32"}}]
    w = world({"networkPolicy": {"dns": node_local}})
    assert allowed(
        w.policies, w["control-plane"], Outside("nodelocaldns", "169.254.20.10"), 53, "UDP"
    )
    assert not w.can("control-plane", "dns", 53, "UDP"), "the list replaces the default"
    anywhere = world({"networkPolicy": {"dns": []}})
    assert anywhere.can("control-plane", "tenant", 53, "UDP")
    assert not anywhere.can("control-plane", "tenant", 54, "UDP")
