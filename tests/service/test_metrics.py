"""/metrics as Prometheus and an operator read it (issue 51, item 7): base units, and the
queue and quota gauges per tenant and cluster that Kueue users look for, from a real server
on both database backends."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Allocation, Cluster
from tests.service.conftest import Network, spec


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return metrics.get((name, frozenset(labels.items())))


def test_queue_and_quota_per_tenant_and_cluster(network: Network) -> None:
    job = network.tenant.post("/v1/jobs", spec())
    assert job["state"] == "PENDING"
    engine = make_engine(network.server.database_url)
    with make_sessionmaker(engine)() as s, s.begin():
        us_east = s.scalars(select(Cluster.id).where(Cluster.name == "us-east")).one()
        s.add(Allocation(job_id=job["id"], cluster_id=us_east, gpu_model="H100", gpus=4,
                         qos_class="standard"))  # fmt: skip
    engine.dispose()
    m = samples(httpx.get(f"{network.server.url}/metrics").text)
    assert value(m, "cpn_tenant_jobs", tenant="acme", state="PENDING") == 1
    assert value(m, "cpn_tenant_jobs", tenant="globex", state="PENDING") == 0
    assert value(m, "cpn_tenant_jobs", tenant="acme", state="SUCCEEDED") is None  # finished
    assert value(m, "cpn_tenant_gpus", tenant="acme", kind="in_use") == 4
    assert value(m, "cpn_tenant_gpus", tenant="acme", kind="quota") == 20
    assert value(m, "cpn_tenant_gpus", tenant="globex", kind="in_use") == 0
    assert value(m, "cpn_tenant_gpus", tenant="globex", kind="quota") is None  # no quota
    assert value(m, "cpn_tenant_dollars", tenant="acme", kind="budget") == 10_000
    assert value(m, "cpn_tenant_dollars", tenant="acme", kind="charged") == 0
    assert value(m, "cpn_cluster_jobs", cluster="us-east") == 1
    assert value(m, "cpn_cluster_jobs", cluster="eu-west") == 0
    for cluster in ("us-east", "eu-west", "ap-south"):
        assert (value(m, "cpn_cluster_gpus", cluster=cluster, kind="count") or 0) > 0
    # Base units: 10 Gbit/s and 70 ms as declared.
    link = {"src": "us-east", "dst": "eu-west", "source": "declared"}
    assert value(m, "cpn_link_bandwidth_bytes_per_second", **link) == 1.25e9
    assert value(m, "cpn_link_rtt_seconds", **link) == pytest.approx(0.07)


def test_promtool_finds_nothing_to_fix(network: Network) -> None:
    """`promtool check metrics` (Prometheus's own linter: base units, counter suffixes, help
    text) passes on a live server's exposition with every family populated."""
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool is missing: `make tools` installs it (`make test` does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    network.tenant.post("/v1/jobs", spec())
    network.tenant.post("/v1/quotes", spec())
    text = httpx.get(f"{network.server.url}/metrics").text
    assert "cpn_tenant_jobs{" in text and "cpn_link_rtt_seconds{" in text
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
