"""Every manifest the chart renders is valid Kubernetes, and the pieces refer to each other.

Built-in kinds validate against the Kubernetes API's own OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail) for the newest version it ships and the oldest. Custom resources
it does not know (RayCluster, ServiceMonitor) are checked field by field here, and their pod
templates validate as core/v1 PodTemplates.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import kubernetes_validate
import pytest

from tests.helm import chartkit
from tests.helm.chartkit import NAMESPACE, Rendered, render
from training.placement import cluster_resource

NEWEST = kubernetes_validate.utils.latest_version()
OLDEST = kubernetes_validate.utils.all_versions()[0]
CUSTOM_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
PROMETHEUS = ["monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor"]


def _validate(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(
            f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {where}: {exc.message}"
        )


def _check_ray_cluster(doc: dict[str, Any], version: str) -> None:
    spec = doc["spec"]
    assert spec["rayVersion"]
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), head
    _validate_template(head["template"], version)
    assert spec["workerGroupSpecs"], "a RayCluster without worker groups runs nothing"
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group
        _validate_template(group["template"], version)


def _check_service_monitor(doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"]
    assert spec["endpoints"] and all(e["port"] and e["path"] for e in spec["endpoints"])


def _validate_template(template: dict[str, Any], version: str) -> None:
    """An embedded pod template, validated as what it is: a core/v1 PodTemplate's template."""
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "embedded"},
        "template": template,
    }
    _validate(wrapper, version)


@pytest.fixture(scope="module", params=sorted(chartkit.SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, Rendered]:
    name: str = request.param
    return name, render(chartkit.SCENARIOS[name], api_versions=PROMETHEUS)


@pytest.mark.parametrize("version", [NEWEST, OLDEST])
def test_every_manifest_validates(scenario: tuple[str, Rendered], version: str) -> None:
    name, rendered = scenario
    assert rendered.docs, f"{name} rendered nothing"
    for doc in rendered.docs:
        assert doc["metadata"]["name"], doc
        key = (doc["apiVersion"], doc["kind"])
        if key == ("ray.io/v1", "RayCluster"):
            _check_ray_cluster(doc, version)
        elif key == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            _check_service_monitor(doc)
        else:
            assert key not in CUSTOM_KINDS
            _validate(doc, version)


def test_validation_catches_a_broken_manifest() -> None:
    """The validator above is not vacuous: a misspelt field in a rendered Deployment fails."""
    deployment = render().one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = (
        "/healthz"
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, NEWEST, strict=True)


def test_references_resolve(scenario: tuple[str, Rendered]) -> None:
    """Services select their pods, ports and Secrets/claims/accounts named in pods exist."""
    name, rendered = scenario
    values = chartkit.SCENARIOS[name]
    external_secrets = {values.get("agent", {}).get("tokenSecret")}
    workloads = rendered.of_kind("Deployment") + rendered.of_kind("Job")
    secrets = rendered.names("Secret") | external_secrets
    claims = rendered.names("PersistentVolumeClaim")
    accounts = rendered.names("ServiceAccount") | {"default"}
    configmaps = rendered.names("ConfigMap")
    pods = [chartkit.pod_spec(doc) for doc in workloads]
    for ray_cluster in rendered.of_kind("RayCluster"):
        groups = [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]
        pods.extend(group["template"]["spec"] for group in groups)
    for pod in pods:
        if "serviceAccountName" in pod:
            assert pod["serviceAccountName"] in accounts
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
        for container in pod["containers"]:
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])}
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets, f"{env['name']} -> missing Secret {ref}"
    for service in rendered.of_kind("Service"):
        selector = service["spec"]["selector"]
        targets = [
            d
            for d in rendered.of_kind("Deployment")
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {targets}"
        ports = {
            p["name"]
            for c in chartkit.pod_spec(targets[0])["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    for doc in rendered.docs:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]


def test_default_is_a_single_sqlite_control_plane() -> None:
    rendered = render()
    assert {d["kind"] for d in rendered.docs} == {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Secret",
        "PersistentVolumeClaim",
        "Job",
        "NetworkPolicy",
    }
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    container = chartkit.pod_spec(deployment)["containers"][0]
    assert container["args"] == ["serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "1"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = chartkit.env_of(container)
    assert env["CPN_DATABASE_URL"]["value"] == "sqlite:////data/cpn.db"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert env["CPN_HEARTBEAT_INTERVAL_S"]["value"] == "10"
    assert env["CPN_LEASE_GRACE_S"]["value"] == "40"
    assert "CPN_RAY_ADDRESS" not in env
    # The claim exists before the migration Job that writes the SQLite file, and outlives uninstall.
    pvc = rendered.one("PersistentVolumeClaim")
    job = rendered.one("Job")
    assert pvc["metadata"]["annotations"]["helm.sh/hook"] == "pre-install"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert int(pvc["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert rendered.of_kind("PodDisruptionBudget") == []
    assert rendered.of_kind("ServiceMonitor") == [], "no Prometheus operator, no ServiceMonitor"


def test_migration_job_is_a_pre_install_and_pre_upgrade_hook() -> None:
    job = render().one("Job", "migrate")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    pod = chartkit.pod_spec(job)
    assert pod["restartPolicy"] == "Never"
    # Hooks run before the release's own ServiceAccount exists.
    assert "serviceAccountName" not in pod
    container = pod["containers"][0]
    assert container["args"] == ["db", "upgrade"]
    deployment_env = chartkit.env_of(chartkit.pod_spec(render().one("Deployment"))["containers"][0])
    assert chartkit.env_of(container)["CPN_DATABASE_URL"] == deployment_env["CPN_DATABASE_URL"]


def test_admin_token_secret_is_generated_and_kept() -> None:
    rendered = render()
    secret = rendered.one("Secret", "admin-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    env = chartkit.env_of(chartkit.pod_spec(rendered.one("Deployment"))["containers"][0])
    assert env["CPN_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "token",
    }
    template = (chartkit.CHART_DIR / "templates/controlplane/secret-admin-token.yaml").read_text()
    # Kept on upgrade: the installed Secret's token wins over a fresh one (lookup is empty
    # offline, so this part can only be read, not rendered, without an API server).
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template


def test_existing_admin_secret_is_used_not_generated() -> None:
    rendered = render(
        {
            "controlPlane": {
                "adminToken": {"existingSecret": "ops-admin", "existingSecretKey": "key"}
            }
        }
    )
    assert rendered.of_kind("Secret") == []
    env = chartkit.env_of(chartkit.pod_spec(rendered.one("Deployment"))["containers"][0])
    assert env["CPN_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "ops-admin",
        "key": "key",
    }


def test_postgres_allows_replicas_and_adds_a_disruption_budget() -> None:
    rendered = render({"controlPlane": {"replicas": 3, "database": {"existingSecret": "cpn-pg"}}})
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert "strategy" not in deployment["spec"], "rolling updates are fine on PostgreSQL"
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert rendered.of_kind("PersistentVolumeClaim") == []
    for workload in (deployment, rendered.one("Job")):
        container = chartkit.pod_spec(workload)["containers"][0]
        assert chartkit.env_of(container)["CPN_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": "cpn-pg",
            "key": "url",
        }
        assert not any(m["mountPath"] == "/data" for m in container["volumeMounts"])


def test_workers_reach_serve() -> None:
    deployment = render({"controlPlane": {"workers": 4}}).one("Deployment")
    args = chartkit.pod_spec(deployment)["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == "4"


def test_every_cpn_container_is_locked_down(scenario: tuple[str, Rendered]) -> None:
    _, rendered = scenario
    pairs = chartkit.cpn_containers(rendered)
    assert pairs
    for workload, container in pairs:
        pod = chartkit.pod_spec(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"], "every container states its requests"
        # A read-only root needs a writable scratch directory.
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    for ray_cluster in rendered.of_kind("RayCluster"):
        groups = [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]
        for group in groups:
            template = group["template"]["spec"]
            assert template["securityContext"]["runAsNonRoot"] is True
            for container in template["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_service_monitor_only_with_the_prometheus_operator() -> None:
    assert render().of_kind("ServiceMonitor") == []
    rendered = render(api_versions=PROMETHEUS)
    monitor = rendered.one("ServiceMonitor")
    service = rendered.one("Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    off = render({"controlPlane": {"serviceMonitor": {"enabled": False}}}, api_versions=PROMETHEUS)
    assert off.of_kind("ServiceMonitor") == []


def test_ingress_routes_to_the_api_service() -> None:
    rendered = render(
        {
            "controlPlane": {
                "ingress": {
                    "enabled": True,
                    "className": "nginx",
                    "hosts": [
                        {"host": "cpn.example.org", "paths": [{"path": "/", "pathType": "Prefix"}]}
                    ],
                    "tls": [{"hosts": ["cpn.example.org"], "secretName": "cpn-tls"}],
                }
            }
        }
    )
    ingress = rendered.one("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == rendered.one("Service")["metadata"]["name"]
    assert backend["port"]["name"] == "http"
    assert "https://cpn.example.org/docs" in rendered.notes
    _validate(ingress, NEWEST)


def test_agent_only_release() -> None:
    rendered = render(chartkit.AGENT_VALUES)
    assert {d["kind"] for d in rendered.docs} == {
        "Deployment",
        "Service",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "NetworkPolicy",
    }
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 1, "one agent per cluster"
    pod = chartkit.pod_spec(deployment)
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "agent"
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags["--cluster"] == "dc-east"
    assert flags["--controller"] == "https://cpn.example.com"
    assert flags["--discovery"] == "kubernetes"
    assert flags["--probe-port"] == "9100"
    probe_service = rendered.one("Service", "probe")
    assert flags["--advertise-url"] == (
        f"http://{probe_service['metadata']['name']}.{NAMESPACE}.svc:9100"
    )
    # The token comes from the Secret through the environment, never on the command line.
    assert "--token" not in args
    assert chartkit.env_of(container)["CPN_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "cpn-agent-token",
        "key": "token",
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/probe/ping", "port": "probe"}
    assert probe_service["spec"]["ports"][0]["port"] == 9100
    # Node discovery: a bound token for the agent container only (nothing automounted), and
    # the one call agents/discovery/k8s.py makes, listing nodes.
    assert pod["automountServiceAccountToken"] is False
    assert rendered.one("ServiceAccount")["automountServiceAccountToken"] is False
    volume = next(v for v in pod["volumes"] if v["name"] == "kube-api-access")
    sources = {k for source in volume["projected"]["sources"] for k in source}
    assert sources == {"serviceAccountToken", "configMap", "downwardAPI"}
    token = next(
        s["serviceAccountToken"]
        for s in volume["projected"]["sources"]
        if "serviceAccountToken" in s
    )
    assert token["path"] == "token" and token["expirationSeconds"] <= 3607
    assert {
        "name": "kube-api-access",
        "readOnly": True,
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
    } in container["volumeMounts"]
    role = rendered.one("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    binding = rendered.one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert "WARNING: agent.advertiseURL is not set" in rendered.notes


def test_agent_options_reach_the_command_line() -> None:
    values = json.loads(json.dumps(chartkit.AGENT_VALUES))
    values["agent"].update(
        {
            "advertiseURL": "http://probe.dc-east.example.com:9100",
            "discovery": "inventory",
            "inventory": "gpus:\n  - model: A100-80GB\n    memory_gib: 80\n    count: 8\n",
            "probe": {"service": {"type": "LoadBalancer"}},
        }
    )
    rendered = render(values)
    container = chartkit.pod_spec(rendered.one("Deployment"))["containers"][0]
    flags = dict(zip(container["args"][1::2], container["args"][2::2], strict=True))
    assert flags["--advertise-url"] == "http://probe.dc-east.example.com:9100"
    assert flags["--discovery"] == "inventory"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "inventory")
    assert flags["--inventory"] == f"{mount['mountPath']}/inventory.yaml"
    assert rendered.one("ConfigMap")["data"]["inventory.yaml"] == values["agent"]["inventory"]
    assert rendered.one("Service", "probe")["spec"]["type"] == "LoadBalancer"
    assert "WARNING: agent.advertiseURL" not in rendered.notes
    # Exposed, but peers outside this Kubernetes cluster are not let in yet: say so.
    assert "WARNING: networkPolicy.agent.probeFrom is empty" in rendered.notes
    values["networkPolicy"] = {"agent": {"probeFrom": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]}}
    assert "WARNING" not in render(values).notes
    # Declared GPUs need no Kubernetes API credentials in the pod, nor any role.
    pod = chartkit.pod_spec(rendered.one("Deployment"))
    assert pod["automountServiceAccountToken"] is False
    assert not [v for v in pod["volumes"] if "projected" in v]
    assert rendered.of_kind("ClusterRole") == rendered.of_kind("ClusterRoleBinding") == []


def _ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """Parse KubeRay's rayStartParams.resources: a JSON object inside literal double quotes."""
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), raw
    parsed: dict[str, float] = json.loads(raw[1:-1].replace('\\"', '"'))
    return parsed


def test_ray_cluster_pins_workers_to_the_datacenter() -> None:
    rendered = render(chartkit.RAY_VALUES)
    ray_cluster = rendered.one("RayCluster")
    assert ray_cluster["spec"]["rayVersion"] == "2.60.0"
    (group,) = ray_cluster["spec"]["workerGroupSpecs"]
    # The very name the launcher pins actors with, so chart and runtime cannot drift apart.
    assert _ray_resources(group) == {cluster_resource("dc-west"): 1}
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (
        worker["image"]
        == ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        == "cpn:0.1.0"
    ), "Ray nodes run the cpn image"
    # The control plane of the same release joins this Ray cluster with its token.
    cp_env = chartkit.env_of(
        chartkit.pod_spec(rendered.one("Deployment", "control-plane"))["containers"][0]
    )
    name = ray_cluster["metadata"]["name"]
    assert cp_env["CPN_RAY_ADDRESS"]["value"] == f"ray://{name}-head-svc.{NAMESPACE}.svc:10001"
    auth = rendered.one("Secret", "auth")
    cp_pod = chartkit.pod_spec(rendered.one("Deployment", "control-plane"))
    pods = [(cp_pod, cp_pod["containers"][0]), (group["template"]["spec"], worker)]
    for pod, container in pods:
        # The token is a file from the Secret, never a value in the environment.
        env = chartkit.env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "RAY_AUTH_TOKEN" not in env
        mount = next(m for m in container["volumeMounts"] if m["name"] == "ray-auth")
        assert mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == "ray-auth")
        assert volume["secret"]["secretName"] == auth["metadata"]["name"]
        (item,) = volume["secret"]["items"]
        assert item["key"] in auth["data"]
        assert env["RAY_AUTH_TOKEN_PATH"]["value"] == f"{mount['mountPath']}/{item['path']}"
    assert "kuberay-operator" in rendered.notes


def test_ray_worker_groups_per_datacenter_and_custom_resource_name() -> None:
    values = json.loads(json.dumps(chartkit.RAY_VALUES))
    values["ray"].update(
        {
            "clusterResource": "dc",
            "auth": {"enabled": False},
            "workerGroups": [
                {
                    "name": "a100",
                    "clusterName": "dc-a",
                    "gpusPerWorker": 8,
                    "replicas": 2,
                    "minReplicas": 0,
                    "maxReplicas": 2,
                },
                {
                    "name": "cpu",
                    "gpusPerWorker": 0,
                    "resourceQuantity": 4,
                    "replicas": 1,
                    "minReplicas": 1,
                    "maxReplicas": 1,
                },
            ],
        }
    )
    rendered = render(values)
    groups = {g["groupName"]: g for g in rendered.one("RayCluster")["spec"]["workerGroupSpecs"]}
    assert _ray_resources(groups["a100"]) == {"dc": 8}
    assert _ray_resources(groups["cpu"]) == {"dc": 4}
    a100 = groups["a100"]["template"]["spec"]["containers"][0]
    assert a100["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert groups["a100"]["template"]["metadata"]["labels"]["cpn.io/cluster"] == "dc-a"
    assert groups["cpu"]["template"]["metadata"]["labels"]["cpn.io/cluster"] == "dc-west"
    cpu = groups["cpu"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert "RAY_AUTH_MODE" not in chartkit.env_of(cpu)
    assert rendered.of_kind("Secret") == [rendered.one("Secret", "admin-token")]


def test_ray_head_service_type() -> None:
    values = json.loads(json.dumps(chartkit.RAY_VALUES))
    values["ray"]["head"] = {"serviceType": "LoadBalancer"}
    ray_cluster = render(values).one("RayCluster")
    assert ray_cluster["spec"]["headGroupSpec"]["serviceType"] == "LoadBalancer"


def test_explicit_ray_address_wins() -> None:
    rendered = render({"controlPlane": {"rayAddress": "ray-head.ray:6379"}})
    env = chartkit.env_of(chartkit.pod_spec(rendered.one("Deployment"))["containers"][0])
    assert env["CPN_RAY_ADDRESS"]["value"] == "ray-head.ray:6379"


def test_notes_tell_how_to_reach_the_api_and_fetch_the_token() -> None:
    rendered = render()
    secret = rendered.one("Secret", "admin-token")["metadata"]["name"]
    service = rendered.one("Service")["metadata"]["name"]
    assert f"port-forward service/{service} 8000:8000" in rendered.notes
    assert f"get secret {secret} -o jsonpath='{{.data.token}}' | base64 -d" in rendered.notes


DIGEST = "sha256:" + "0123456789abcdef" * 4


def _images(rendered: Rendered) -> list[tuple[str, str]]:
    """(image, pull policy) of every container the release runs."""
    return [
        (c["image"], c["imagePullPolicy"])
        for _, template in chartkit.pod_templates(rendered)
        for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]
    ]


def test_images_by_tag_are_always_pulled() -> None:
    images = _images(render(chartkit.RAY_VALUES))
    assert images and set(images) == {("cpn:0.1.0", "Always")}


def test_a_digest_pins_every_image_and_overrides_the_tag() -> None:
    values = json.loads(json.dumps(chartkit.RAY_VALUES))
    values["image"] = {"repository": "registry.example.com/cpn", "tag": "0.1.0", "digest": DIGEST}
    images = _images(render(values))
    # Content-addressed: nothing to fetch again once present.
    assert set(images) == {(f"registry.example.com/cpn@{DIGEST}", "IfNotPresent")}
    values["image"]["pullPolicy"] = "Always"
    assert {policy for _, policy in _images(render(values))} == {"Always"}, "an explicit policy"


def test_ray_image_of_its_own() -> None:
    values = json.loads(json.dumps(chartkit.RAY_VALUES))
    values["image"] = {"digest": DIGEST}
    values["ray"]["image"] = {"repository": "rayproject/ray"}
    ray_cluster = render(values).one("RayCluster")
    head = ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The cpn image's digest is not another image's digest.
    assert (head["image"], head["imagePullPolicy"]) == ("rayproject/ray:0.1.0", "Always")
    values["ray"]["image"]["digest"] = "sha256:" + "f" * 64
    head = render(values).one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ][0]
    assert head["image"] == "rayproject/ray@sha256:" + "f" * 64


def test_every_container_states_cpu_and_memory_requests_and_limits(
    scenario: tuple[str, Rendered],
) -> None:
    _, rendered = scenario
    for owner, template in chartkit.pod_templates(rendered):
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= resources[kind].keys(), (
                    owner["metadata"]["name"],
                    container["name"],
                    kind,
                )


def test_checkov_skips_say_why_and_go_with_a_digest() -> None:
    """What checkov would fault and the chart accepts is annotated with the reason; a pinned
    image needs no digest skip, and the SQLite migration Job reads no secret."""
    rendered = render(chartkit.RAY_VALUES)
    for workload in rendered.of_kind("Deployment") + rendered.of_kind("Job"):
        skips = {
            k: v
            for k, v in workload["metadata"].get("annotations", {}).items()
            if k.startswith("checkov.io/skip")
        }
        ids = {v.split("=", 1)[0] for v in skips.values()}
        assert "CKV_K8S_43" in ids
        assert all(v.count("=") == 1 and len(v.split("=")[1]) > 40 for v in skips.values())
    job = render().one("Job")
    ids = {
        v.split("=", 1)[0]
        for k, v in job["metadata"]["annotations"].items()
        if k.startswith("checkov.io/skip")
    }
    assert ids == {"CKV_K8S_43"}
    pinned = render({"image": {"digest": DIGEST}})
    for workload in pinned.of_kind("Deployment") + pinned.of_kind("Job"):
        values = workload["metadata"].get("annotations", {}).values()
        assert not [v for v in values if v.startswith("CKV_K8S_43")]


def test_no_pod_gets_an_api_token_it_does_not_use(scenario: tuple[str, Rendered]) -> None:
    """Only the agent calls the Kubernetes API (node discovery), through its own mount."""
    _, rendered = scenario
    for owner, template in chartkit.pod_templates(rendered):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False, owner["metadata"]["name"]
        projected = [v for v in spec.get("volumes", []) if "projected" in v]
        if template["metadata"]["labels"]["app.kubernetes.io/component"] != "agent":
            assert projected == [], owner["metadata"]["name"]


def test_notes_warn_when_the_ray_client_port_admits_no_one() -> None:
    values = json.loads(json.dumps(chartkit.RAY_VALUES))
    values["controlPlane"] = {"enabled": False}
    assert "WARNING: networkPolicy.ray.clientFrom is empty" in render(values).notes
    values["networkPolicy"] = {"ray": {"clientFrom": [{"ipBlock": {"cidr": "198.51.100.0/24"}}]}}
    assert "networkPolicy.ray.clientFrom" not in render(values).notes
    assert "networkPolicy.ray.clientFrom" not in render(chartkit.RAY_VALUES).notes


def test_checkpoints_go_to_a_writable_volume_at_an_absolute_path() -> None:
    """The root filesystem is read-only: CPN_CHECKPOINT_ROOT must name a mounted volume."""
    for values, source in (
        ({}, {"emptyDir": {"sizeLimit": "10Gi"}}),
        (
            {"controlPlane": {"checkpoints": {"persistentVolumeClaim": "shared-ckpt"}}},
            {"persistentVolumeClaim": {"claimName": "shared-ckpt"}},
        ),
    ):
        deployment = render(values).one("Deployment")
        pod = chartkit.pod_spec(deployment)
        container = pod["containers"][0]
        root = chartkit.env_of(container)["CPN_CHECKPOINT_ROOT"]["value"]
        assert root == "/var/lib/cpn/checkpoints"
        assert {"name": "checkpoints", "mountPath": root} in container["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
        assert {k: v for k, v in volume.items() if k != "name"} == source
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
