"""Where the chart's jobs checkpoint: a writable volume by default, the same claim on the Ray
workers, or an object store whose settings reach the control plane and every Ray worker."""

from __future__ import annotations

import copy
from typing import Any

from tests.helm.chartkit import RAY_VALUES, env_of, render


def _ray_workers(values: dict[str, Any]) -> list[dict[str, Any]]:
    doc = render(values).one("RayCluster")
    return [g["template"]["spec"] for g in doc["spec"]["workerGroupSpecs"]]


def _control_plane_env(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deployment = render(values).one("Deployment", "control-plane")
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def test_the_default_checkpoints_to_the_writable_volume() -> None:
    env = _control_plane_env({})
    assert env["CPN_CHECKPOINT_ROOT"]["value"] == "/var/lib/cpn/checkpoints"
    assert not any(name.startswith("AWS_") for name in env)


def test_ray_without_shared_checkpoints_is_warned_about() -> None:
    assert "WARNING: checkpoints go to the control plane's emptyDir" in render(RAY_VALUES).notes


def test_an_object_store_reaches_the_control_plane_and_every_ray_worker() -> None:
    values = copy.deepcopy(RAY_VALUES)
    values["controlPlane"] = {
        "checkpoints": {
            "uri": "s3://cpn-ck/prod",
            "endpoint": "https://minio.example.com",
            "region": "eu-west-1",
            "credentialsSecret": "cpn-s3",
        }
    }
    env = _control_plane_env(values)
    assert "WARNING: checkpoints" not in render(values).notes
    assert env["CPN_CHECKPOINT_ROOT"]["value"] == "s3://cpn-ck/prod"
    assert env["AWS_ENDPOINT_URL"]["value"] == "https://minio.example.com"
    key = env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "cpn-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    for spec in _ray_workers(values):
        worker_env = env_of(spec["containers"][0])
        assert worker_env["AWS_REGION"]["value"] == "eu-west-1"
        assert "AWS_ACCESS_KEY_ID" in worker_env
        assert all(v["name"] != "checkpoints" for v in spec["volumes"])


def test_ray_workers_mount_the_checkpoint_claim_at_the_control_planes_path() -> None:
    values = copy.deepcopy(RAY_VALUES)
    values["controlPlane"] = {"checkpoints": {"persistentVolumeClaim": "cpn-ck-rwx"}}
    for spec in _ray_workers(values):
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["checkpoints"]["mountPath"] == "/var/lib/cpn/checkpoints"
        volume = next(v for v in spec["volumes"] if v["name"] == "checkpoints")
        assert volume["persistentVolumeClaim"] == {"claimName": "cpn-ck-rwx"}
