"""The compiled scheduler (`make compile`, `scheduler.native`): used only when built from the
sources beside it, and deciding exactly as the interpreted one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import native

ROOT = Path(__file__).resolve().parents[2]


def _manifest(where: Path, digest: str) -> None:
    (where / "scheduler").mkdir(parents=True)
    (where / native.MANIFEST).write_text(json.dumps({"digest": digest}))


@pytest.fixture
def restored_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # `enable` appends the shared runtime


@pytest.mark.usefixtures("restored_path")
def test_a_build_of_other_sources_or_none_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPN_COMPILED", "1")
    monkeypatch.setenv("CPN_COMPILED_DIR", str(tmp_path / "stale"))
    path = ["src"]
    assert native.enable(path) is False  # no build at all
    _manifest(tmp_path / "stale", "0" * 64)  # a build of sources since edited
    assert native.enable(path) is False and path == ["src"]

    _manifest(tmp_path / "current", native.digest())
    monkeypatch.setenv("CPN_COMPILED_DIR", str(tmp_path / "current"))
    monkeypatch.setenv("CPN_COMPILED", "0")
    assert native.enable(path) is False and path == ["src"]  # switched off
    monkeypatch.setenv("CPN_COMPILED", "1")
    assert native.enable(path) is True
    assert path == [str(tmp_path / "current" / "scheduler"), "src"]


def test_the_digest_follows_every_source(tmp_path: Path) -> None:
    pkg, grammar = tmp_path / "scheduler", tmp_path / "grammar"
    for d in (pkg, grammar):
        d.mkdir()
        (d / "__init__.py").write_text("")
    (pkg / "cost.py").write_text("X = 1\n")
    (grammar / "sync.py").write_text("Y = 1\n")
    first = native.digest(pkg, grammar)
    (grammar / "sync.py").write_text("Y = 2\n")  # not compiled, but compiled against
    second = native.digest(pkg, grammar)
    (pkg / "cost.py").write_text("X = 2\n")
    assert len({first, second, native.digest(pkg, grammar)}) == 3


JOBS = 80
"""Enough for queues to form at load 1.2 (waits, queue order and preemption all decide)."""


def _sim(env: dict[str, str]) -> dict[str, object]:
    argv = [sys.executable, "-m", "bench.sim", "--clusters", "6,30", "--jobs", str(JOBS)]
    argv += ["--load", "1.2", "--seed", "3", "--json", "--no-save", "--policies", "cpn,cpn-cost"]
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True
    )
    out: dict[str, object] = json.loads(done.stdout)
    return out


@pytest.mark.slow
def test_the_compiled_scheduler_decides_as_the_interpreted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built with mypyc into a scratch folder (the tree's own build is left alone), a trace
    simulated through the compiled planner, waits and queue order gives the same JCTs, costs
    and placements, to the last bit, as the interpreted code: exhaustive search at 6 clusters,
    the heuristic at 30. Compiled at -O1: the C compiler's level changes no decision, and
    -O3 took most of this test's time compiling."""
    monkeypatch.setenv("MYPYC_OPT_LEVEL", "1")
    where = native.build(tmp_path / "native")
    env = {**os.environ, "CPN_COMPILED_DIR": str(where), "CPN_COMPILED": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "import scheduler.optimizer as o; print(o.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(where)) and probe.stdout.strip().endswith(".so")

    compiled = _sim(env)
    interpreted = _sim({**env, "CPN_COMPILED": "0"})
    assert (compiled["planner"], interpreted["planner"]) == ("compiled", "interpreted")
    by_size = compiled["by_clusters"], interpreted["by_clusters"]
    assert isinstance(by_size[0], dict) and isinstance(by_size[1], dict)
    for metrics in (*by_size[0].values(), *by_size[1].values()):
        for m in metrics.values():
            m.pop("sim_jobs_per_cpu_min")  # the one figure that should differ
    assert by_size[0] == by_size[1]
    assert by_size[0]["30"]["cpn"]["finished"] == JOBS
