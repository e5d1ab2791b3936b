"""`cpn train --parallel pipeline|hybrid`: bad flags fail on one line; a run reports activation
bytes per WAN link, the bubble and per-stage compute (in-process, on the session's Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app


def _train(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["train", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--parallel", "tensor"], "--parallel"),
        (["--parallel", "auto"], "--parallel"),
        (["--parallel", "pipeline", "--stages", "3"], "--stages"),
        (["--parallel", "hybrid", "--clusters", "a:2,b:1"], "--stages"),
        (["--parallel", "pipeline", "--stages", "@0"], "--stages"),
        (["--stages", "2"], "--stages"),
        (["--parallel", "pipeline", "--compression", "powersgd:2"], "--compression"),
        (["--parallel", "pipeline", "--schedule", "zigzag"], "--schedule"),
        (["--parallel", "hybrid", "--sync", "local-sgd:4"], "--sync"),
        (["--parallel", "pipeline", "--resume"], "resume"),
        (["--parallel", "pipeline", "--whole-pipelines"], "--whole-pipelines"),
        (["--parallel", "hybrid", "--whole-pipelines", "--clusters", "a:1,b:2"], "--stages"),
    ],
)
def test_bad_pipeline_flags_one_line(args: list[str], needle: str) -> None:
    code, _, err = _train(*args)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cpn train: error:") and needle in lines[0]


@pytest.mark.usefixtures("ray_session")
def test_three_cluster_int8_1f1b_json_report() -> None:
    code, out, err = _train(
        "--parallel",
        "pipeline",
        "--stages",
        "@1,3",
        "--clusters",
        "a:1,b:1,c:1",
        "--schedule",
        "1f1b",
        "--steps",
        "2",
        "--batch-size",
        "32",
        "--compression",
        "int8",
        "--link-mbps",
        "100",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["parallel"] == "pipeline" and report["cuts"] == [1, 3]
    assert report["schedule"] == "1f1b"
    wan = report["activation_bytes"]
    assert set(wan) == {"a->b", "b->a", "b->c", "c->b"}
    # 2 steps x 32 samples x 128 hidden units in int8 each way, a 96-byte header a message
    # (4 micro-batches a step); the eval pass sends the eval set forward once more
    assert wan["b->a"] == 2 * 32 * 128 + 2 * 4 * 96
    assert wan["c->b"] == 2 * 32 * 128 + 2 * 4 * 96
    assert wan["a->b"] > wan["b->a"]
    assert 3.0 < report["compression_ratio"] < 4.0  # headers keep it under 4
    assert report["bubble_fraction"] == pytest.approx(2 / 6)
    assert len(report["stage_compute_s"]) == 3 and all(c > 0 for c in report["stage_compute_s"])
    assert 0.0 <= report["final_accuracy"] <= 1.0
    assert 0.0 < report["final_eval_loss"] < 5.0


@pytest.mark.usefixtures("ray_session")
def test_pipeline_checkpoints_per_stage_and_resumes(tmp_path: Path) -> None:
    """`--checkpoint-dir` saves every stage's shard; a later run refuses the directory without
    `--resume`, and with it continues from the last step both stages saved."""
    ckpt = str(tmp_path / "ck")
    base = ["--parallel", "pipeline", "--clusters", "a:1,b:1", "--batch-size", "32"]
    base += ["--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--json"]
    code, out, err = _train(*base, "--steps", "4")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["resumed_from_step"] is None
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_dir()) == [
        "stage-0",
        "stage-1",
    ]
    code, _, err = _train(*base, "--steps", "6")
    assert code != 0 and "--checkpoint-dir" in err and "--resume" in err
    code, out, err = _train(*base, "--steps", "6", "--resume")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["resumed_from_step"] == 4 and report["steps"] == 6
    assert [h["step"] for h in report["history"]] == [5, 6]  # no step before 4 again
