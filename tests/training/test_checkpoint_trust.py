"""Checkpoints are data, never code, and a run resumes only from its own.

The refusals come from the driver (`training.run`) before any worker or Ray starts; the
checkpoint files are real torch files in a real directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from training import TrainSpec, run
from training.checkpoint import FORMAT, ID_FILE, CheckpointRefused, DirectoryStore, plain


class _Planted:
    """What an attacker plants: unpickling it would create `marker` (it runs code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, int]]:
        return (os.open, (str(self.marker), os.O_CREAT | os.O_WRONLY))


def _spec(ck: Path, run_id: str | None = None) -> TrainSpec:
    return TrainSpec(clusters={"a": 1}, steps=10, checkpoint=str(ck), resume=True, run_id=run_id)


def _state(run_id: str, step: int = 4) -> dict[str, object]:
    return {"version": FORMAT, "run_id": run_id, "epoch": 0, "step": step, "task": "x"}


def test_a_planted_pickle_is_refused_and_runs_no_code(tmp_path: Path) -> None:
    ck, marker = tmp_path / "ck", tmp_path / "pwned"
    DirectoryStore(ck).claim("job-a")
    torch.save(
        {"version": FORMAT, "run_id": "job-a", "x": _Planted(marker)}, ck / "step-00000004.pt"
    )
    with pytest.raises(CheckpointRefused, match=r"step-00000004\.pt.*without --resume"):
        run(_spec(ck, "job-a"))
    assert not marker.exists()


def test_another_jobs_checkpoint_is_refused_on_resume(tmp_path: Path) -> None:
    other, mine = tmp_path / "other", tmp_path / "mine"
    DirectoryStore(other).save(4, _state("job-a"))
    DirectoryStore(mine).claim("job-b")
    (mine / "step-00000004.pt").write_bytes((other / "step-00000004.pt").read_bytes())
    with pytest.raises(
        CheckpointRefused, match="written by run 'job-a', not this run \\('job-b'\\)"
    ):
        run(_spec(mine, "job-b"))


def test_a_directory_of_another_run_is_refused(tmp_path: Path) -> None:
    DirectoryStore(tmp_path / "ck").claim("job-a")
    with pytest.raises(CheckpointRefused, match="belongs to run 'job-a', not 'job-b'"):
        run(_spec(tmp_path / "ck", "job-b"))


def test_an_old_format_checkpoint_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Written before checkpoints carried their run: refused, never read as code."""
    ck = tmp_path / "ck"
    ck.mkdir()
    torch.save({"version": 1, "step": 4, "task": "x"}, ck / "step-00000004.pt")
    with pytest.raises(CheckpointRefused, match=r"older format.*restart without --resume"):
        run(_spec(ck))
    assert (ck / ID_FILE).read_text().strip()  # the directory got its own id meanwhile


def test_a_later_attempts_checkpoint_is_refused_by_a_stale_run(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    DirectoryStore(ck).save(4, _state("job-a") | {"epoch": 3})
    DirectoryStore(ck).claim("job-a")
    spec = _spec(ck, "job-a")
    spec.epoch = 2
    with pytest.raises(CheckpointRefused, match="later attempt"):
        run(spec)


def test_what_is_saved_loads_as_weights_only(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    store.save(1, {"a": np.arange(3, dtype=np.float32), "n": np.int64(7), "t": (1, "x")})
    state = store.load(1)
    assert torch.equal(state["a"], torch.arange(3, dtype=torch.float32))
    assert state["n"] == 7 and type(state["n"]) is int and state["t"] == (1, "x")
    with pytest.raises(TypeError, match=r"state\['bad'\]: a object cannot be saved"):
        plain({"bad": object()})
