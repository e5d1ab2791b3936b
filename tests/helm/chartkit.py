"""Render the cpn chart with Helm's own engine (helm-python-sdk, Helm v4's Go SDK) and read it.

No helm binary and no cluster: `lookup` returns nothing offline, so generated Secrets are new
on every render here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native  # render() does not expose api_versions; the C ABI takes it

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "cpn"
RELEASE = "cpn"
NAMESPACE = "cpn-system"
KUBE_VERSION = "v1.37.0"

# The three ways the chart is installed (docs/operator/kubernetes.md's `helm install` lines use the same values).
DEFAULT_VALUES: dict[str, Any] = {}
AGENT_VALUES: dict[str, Any] = {
    "controlPlane": {"enabled": False},
    "agent": {
        "enabled": True,
        "clusterName": "dc-east",
        "controllerURL": "https://cpn.example.com",
        "tokenSecret": "cpn-agent-token",
    },
}
RAY_VALUES: dict[str, Any] = {
    "agent": {
        "enabled": True,
        "clusterName": "dc-west",
        "controllerURL": "http://cpn-control-plane.cpn-system.svc:8000",
        "tokenSecret": "cpn-agent-token",
    },
    "ray": {"enabled": True},
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": DEFAULT_VALUES,
    "agent-only": AGENT_VALUES,
    "with-ray": RAY_VALUES,
}


@dataclass(frozen=True)
class Rendered:
    """One release's manifests, parsed, plus its NOTES.txt."""

    docs: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name_contains: str = "") -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if name_contains in d["metadata"]["name"]]
        assert len(found) == 1, f"expected one {kind} named *{name_contains}*, got {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {d["metadata"]["name"] for d in self.of_kind(kind)}


def load_chart(path: Path = CHART_DIR) -> helm_python.Chart:
    return helm_python.Chart.load(path)


def render_raw(
    values: dict[str, Any] | None = None,
    *,
    chart_dir: Path = CHART_DIR,
    api_versions: list[str] | None = None,
) -> dict[str, str]:
    """Template path -> rendered text, as `helm install --dry-run` would render it."""
    opts: dict[str, Any] = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "is_install": True,
        "kube_version": KUBE_VERSION,
    }
    if api_versions:
        opts["api_versions"] = api_versions
    with load_chart(chart_dir) as chart:
        out = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)
        )
    rendered: dict[str, str] = json.loads(out)
    return rendered


def render_text(
    values: dict[str, Any] | None = None,
    *,
    api_versions: list[str] | None = None,
) -> str:
    """The release's manifests as one YAML stream, as `helm template` prints them."""
    raw = render_raw(values, api_versions=api_versions)
    return "\n---\n".join(
        text
        for path, text in sorted(raw.items())
        if not path.endswith("NOTES.txt") and text.strip()
    )


def render(
    values: dict[str, Any] | None = None,
    *,
    chart_dir: Path = CHART_DIR,
    api_versions: list[str] | None = None,
) -> Rendered:
    raw = render_raw(values, chart_dir=chart_dir, api_versions=api_versions)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(raw.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert isinstance(doc, dict), f"{path} rendered a non-mapping document"
                docs.append(doc)
    return Rendered(docs, notes)


def pod_templates(rendered: Rendered) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner, pod template) for every pod the release creates: workloads and Ray groups."""
    out = []
    for doc in rendered.docs:
        if doc["kind"] in ("Deployment", "Job"):
            out.append((doc, doc["spec"]["template"]))
        elif doc["kind"] == "RayCluster":
            groups = [doc["spec"]["headGroupSpec"], *doc["spec"]["workerGroupSpecs"]]
            out.extend((doc, group["template"]) for group in groups)
    return out


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment or Job."""
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def cpn_containers(rendered: Rendered) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container that runs the cpn entry point."""
    out = []
    for doc in rendered.docs:
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        spec = pod_spec(doc)
        for container in spec.get("initContainers", []) + spec["containers"]:
            if "command" not in container:
                out.append((doc, container))
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def values_yaml() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    return loaded
