"""`cpn plan` run for real (a subprocess of the installed entry point) on files in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CPN = str(Path(sys.executable).with_name("cpn"))

SNAPSHOT: dict[str, Any] = {
    "clusters": [
        {
            "name": "us-east",
            "region": "us",
            "gpu_model": "H100",
            "gpus_free": 8,
            "intra_bandwidth_gbps": 400,
            "price_per_gpu_hour": 2.5,
            "state": "READY",
        },
        {
            "name": "us-west",
            "region": "us",
            "gpu_model": "H100",
            "gpus_free": 8,
            "intra_bandwidth_gbps": 400,
            "price_per_gpu_hour": 2.2,
            "state": "READY",
        },
        {
            "name": "eu-west",
            "region": "eu",
            "gpu_model": "A100",
            "gpus_free": 16,
            "intra_bandwidth_gbps": 200,
            "price_per_gpu_hour": 1.2,
            "state": "READY",
            "cordoned": False,
            "note": "extra fields are fine",
        },
        {
            "name": "ap-south",
            "region": "ap",
            "gpu_model": "H100",
            "gpus_free": 64,
            "intra_bandwidth_gbps": 400,
            "price_per_gpu_hour": 1.0,
            "state": "DOWN",
        },
    ],
    "links": [
        {
            "a": "us-east",
            "b": "us-west",
            "bandwidth_gbps": 10,
            "rtt_ms": 62,
            "egress_price_per_gb": 0.02,
        },
        {
            "a": "us-east",
            "b": "eu-west",
            "bandwidth_gbps": 5,
            "rtt_ms": 75,
            "egress_price_per_gb": 0.05,
        },
        {
            "a": "us-west",
            "b": "eu-west",
            "bandwidth_gbps": 2,
            "rtt_ms": 140,
            "egress_price_per_gb": 0.05,
        },
    ],
}
JOB: dict[str, Any] = {
    "gpus": 16,
    "params": 350_000_000,
    "flops_per_step": 1.1e15,
    "steps": 5000,
    "qos": {"priority": 1, "deadline_s": 36000, "max_clusters": 2},
    "compression": "auto",
}


def cpn_plan(
    tmp_path: Path, *args: str, snapshot: Any = SNAPSHOT, job: Any = JOB, raw_job: str | None = None
) -> subprocess.CompletedProcess[str]:
    s, j = tmp_path / "snapshot.json", tmp_path / "job.json"
    s.write_text(json.dumps(snapshot))
    j.write_text(raw_job if raw_job is not None else json.dumps(job))
    return subprocess.run(
        [CPN, "plan", "--snapshot", str(s), "--job", str(j), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_json_plan_has_the_contract_keys(tmp_path: Path) -> None:
    r = cpn_plan(tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("feasible", "reason", "placement", "compression", "sync", "estimate"):
        assert key in out
    assert out["feasible"] is True
    assert {p["cluster"] for p in out["placement"]} == {"us-east", "us-west"}
    assert sum(p["gpus"] for p in out["placement"]) == 16
    est = out["estimate"]
    for key in ("step_time_s", "total_time_s", "wan_bytes", "cost"):
        assert isinstance(est[key], int | float) and est[key] > 0
    assert est["total_time_s"] <= 36000
    assert any("excluded ap-south: DOWN" in line for line in out["explanation"])


def test_objective_cost_and_text_output(tmp_path: Path) -> None:
    r = cpn_plan(tmp_path, "--objective", "cost")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("feasible plan (cost)")
    assert "placement:" in r.stdout and "compression:" in r.stdout


def test_evaluate_a_given_placement(tmp_path: Path) -> None:
    pl = tmp_path / "placement.json"
    pl.write_text(
        json.dumps([{"cluster": "us-east", "gpus": 8}, {"cluster": "eu-west", "gpus": 8}])
    )
    r = cpn_plan(tmp_path, "--evaluate", str(pl), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["feasible"] is True
    assert out["placement"] == [
        {"cluster": "eu-west", "gpus": 8},
        {"cluster": "us-east", "gpus": 8},
    ]
    assert out["compression"] != "none"  # 5 Gb/s: the planner's pick for it compresses
    # a placement on a DOWN cluster breaks a rule: feasible false, reason, exit 1
    pl.write_text(json.dumps([{"cluster": "ap-south", "gpus": 16}]))
    r = cpn_plan(tmp_path, "--evaluate", str(pl), "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["feasible"] is False and "DOWN" in out["reason"]


def test_infeasible_plan_exits_1_with_reason(tmp_path: Path) -> None:
    job = {**JOB, "qos": {"deadline_s": 10}}
    r = cpn_plan(tmp_path, "--json", job=job)
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["feasible"] is False and out["constraint"] == "deadline"
    assert "deadline" in out["reason"]


@pytest.mark.parametrize(
    ("snapshot", "job", "raw_job", "field"),
    [
        (
            {"clusters": [{**SNAPSHOT["clusters"][0], "gpus_free": -1}]},
            JOB,
            None,
            "snapshot.clusters[0].gpus_free",
        ),
        (
            {"clusters": [{k: v for k, v in SNAPSHOT["clusters"][0].items() if k != "state"}]},
            JOB,
            None,
            "snapshot.clusters[0].state",
        ),
        (
            {**SNAPSHOT, "links": [{**SNAPSHOT["links"][0], "b": "mars"}]},
            JOB,
            None,
            "snapshot.links[0].b",
        ),
        (
            {"clusters": [{**SNAPSHOT["clusters"][0], "gpu_model": "Z9000"}]},
            JOB,
            None,
            "snapshot.clusters[0].gpu_model",
        ),
        (SNAPSHOT, {**JOB, "compression": "zip"}, None, "job.compression"),
        (SNAPSHOT, {k: v for k, v in JOB.items() if k != "gpus"}, None, "job.gpus"),
        (SNAPSHOT, {**JOB, "qos": {"max_clusters": 0}}, None, "job.qos.max_clusters"),
        (SNAPSHOT, JOB, '{"gpus": 16,', "job"),
        (
            SNAPSHOT,
            {**JOB, "flops_per_step": None, "step_time_s_ref": 1.0},
            None,
            "job.ref_gpu",
        ),
        (SNAPSHOT, [1, 2], None, "job"),
        (
            {**SNAPSHOT, "clusters": SNAPSHOT["clusters"] + SNAPSHOT["clusters"][:1]},
            JOB,
            None,
            "snapshot.clusters[4].name",
        ),
    ],
)
def test_bad_files_get_one_line_naming_the_field(
    tmp_path: Path, snapshot: Any, job: Any, raw_job: str | None, field: str
) -> None:
    r = cpn_plan(tmp_path, "--json", snapshot=snapshot, job=job, raw_job=raw_job)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"cpn plan: error: {field}"), lines[0]
    assert r.stdout == ""


def test_bad_flags_and_missing_deadline(tmp_path: Path) -> None:
    r = cpn_plan(tmp_path, "--objective", "fastest")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "fastest" in r.stderr
    r = cpn_plan(tmp_path, "--objective", "cost-within-deadline", job={**JOB, "qos": {}})
    assert r.returncode == 2
    assert r.stderr.strip().startswith("cpn plan: error: job.qos.deadline_s")


BIG_SNAPSHOT: dict[str, Any] = {
    "clusters": [
        {**SNAPSHOT["clusters"][0], "name": n, "gpus_free": 8, "gpu_model": m}
        for n, m in (("a", "H100"), ("b", "H100"), ("c", "A100"))
    ],
    "links": [
        {"a": x, "b": y, "bandwidth_gbps": 10, "rtt_ms": 70, "egress_price_per_gb": 0.02}
        for x, y in (("a", "b"), ("a", "c"), ("b", "c"))
    ],
}


@pytest.mark.parametrize("seq", [256, 4096])
def test_a_70b_model_is_never_a_feasible_data_parallel_plan(tmp_path: Path, seq: int) -> None:
    """Memory binds: 70 B parameters with Adam need about 1.1 TB, no 80 GB GPU holds them. At
    a short sequence a pipeline over the 3 x 8 GPUs fits and the top level says so (its
    placement, every GPU of its split stages; its estimate); at 4096 the activations fit
    nowhere: infeasible, exit 1."""
    job = {
        "gpus": 24,
        "params": 70_000_000_000,
        "flops_per_step": 1e18,
        "steps": 1000,
        "model": {"blocks": 80, "dim": 8192, "seq": seq, "vocab": 32000},
    }
    r = cpn_plan(tmp_path, "--json", snapshot=BIG_SNAPSHOT, job=job)
    out = json.loads(r.stdout)
    assert out["mode"] != "data"
    if seq == 256:
        assert r.returncode == 0, r.stderr
        assert out["feasible"] is True and out["mode"] == "pipeline"
        stages, tensor = out["parallelism"]["stages"], out["parallelism"]["tensor"]
        # the fastest of the plans weighed: stages of 2 GPUs splitting their layers (3D)
        assert tensor == 2 and "weighed: " in out["parallelism"]["reason"]
        assert sum(p["gpus"] for p in out["placement"]) == len(stages) * tensor <= 24
        assert (out["stages"], out["tensor"]) == (len(stages), tensor)
        text = cpn_plan(tmp_path, snapshot=BIG_SNAPSHOT, job=job).stdout.splitlines()[0]
        assert text == (
            f"feasible plan (time): a pipeline of {len(stages)} stages, each split over "
            f"{tensor} GPUs (3D)"
        )
        assert all(st["layers"][1] - st["layers"][0] >= 2 for st in stages)  # layers grouped
        assert out["estimate"] == out["parallelism"]["estimate"]
    else:
        assert r.returncode == 1
        assert out["feasible"] is False and out["constraint"] == "memory"
        assert "fits no pipeline" in out["reason"]
