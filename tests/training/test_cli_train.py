"""`cpn train` as a user runs it: a real subprocess with its own local Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CPN = [sys.executable, "-m", "api.cli"]
ROOT = Path(__file__).resolve().parents[2]


def _cpn(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CPN, "train", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--clusters", "a"], "--clusters"),
        (["--sync", "sometimes"], "--sync"),
        (["--compression", "topk:2"], "--compression"),
        (["--task", "builtin:nope"], "--task"),
        (["--steps", "0"], "--steps"),
        (["--rtt-ms", "30"], "--link-mbps"),
        (["--resume"], "resume"),
        (["--links", "/nonexistent/links.json"], "--links"),
        (["--sync", "streaming:4:f9"], "--sync"),
        (["--compression", "int3"], "--compression"),
        (["--outer-lr", "0"], "--outer-lr"),
        (["--outer-lr", "nan"], "--outer-lr"),
        (["--outer-momentum", "1"], "--outer-momentum"),
        (["--outer-momentum", "-0.5", "--no-nesterov"], "--outer-momentum"),
    ],
)
def test_bad_flags_one_line_nonzero_exit(args: list[str], needle: str) -> None:
    out = _cpn(*args)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("cpn train: error:") and needle in lines[0]


def test_link_table_regions_must_name_every_cluster(tmp_path: Path) -> None:
    """Regions from the link table reach the run's spec, checked like any flag."""
    links = tmp_path / "links.json"
    table = {"links": [{"a": "a", "b": "b", "mbps": 50}], "regions": {"a": "eu"}}
    links.write_text(json.dumps(table))
    out = _cpn("--clusters", "a:1,b:1", "--sync", "async-ps:4", "--links", str(links))
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("cpn train: error: --links (regions): name the region"), line
    assert "missing ['b']" in line


@pytest.mark.slow
def test_train_json_report_and_plot(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"links": [{"a": "a", "b": "b", "mbps": 50, "rtt_ms": 20}]}))
    plot = tmp_path / "acc.png"
    out = _cpn(
        "--task",
        "builtin:mnist1d-cnn",
        "--clusters",
        "a:1,b:1",
        "--links",
        str(links),
        "--compression",
        "topk:0.05",
        "--sync",
        "every-step",
        "--steps",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--json",
        "--plot",
        str(plot),
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # one JSON object, nothing else on stdout
    for key in (
        "task",
        "clusters",
        "compression",
        "sync",
        "steps",
        "final_loss",
        "final_accuracy",
        "wall_s",
        "compute_s",
        "comm_s",
        "wan_bytes",
        "wan_bytes_total",
        "compression_ratio",
        "wan_emulated",
        "hosts",
    ):
        assert key in report
    assert report["clusters"] == {"a": 1, "b": 1} and report["steps"] == 8
    assert report["wan_emulated"] is True
    assert report["wan_bytes_total"] == sum(report["wan_bytes"].values()) > 0
    assert report["compression_ratio"] > 5
    assert 0.0 <= report["final_accuracy"] <= 1.0
    # The evaluation set's loss (10 classes: ln 10 = 2.30 at chance), the last evaluation's.
    assert 0.0 < report["final_eval_loss"] < 5.0
    assert report["history"][-1]["eval_loss"] == report["final_eval_loss"]
    assert report["final_eval_loss"] != report["final_loss"]  # not the training loss again
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "ck").glob("step-*.pt"))
