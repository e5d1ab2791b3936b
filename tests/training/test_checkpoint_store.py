"""Checkpoint stores every datacenter's workers reach: a directory, or an S3-compatible object
store through fsspec, tested against a real S3-protocol server (moto's, started here as a
subprocess on its own port). Both stores share one set of rules: atomic saves, the newest
`keep` kept, data-only reads, a claimed owner, and a fence that refuses a stale run's writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from api.processes import wait_until
from controller.access import scrub
from training import TrainSpec, run
from training.checkpoint import (
    FORMAT,
    CheckpointRefused,
    CheckpointStore,
    DirectoryStore,
    ObjectStore,
    StaleRun,
    open_store,
)
from training.location import absolute, child, is_object_store

pytest.importorskip("s3fs")
ROOT = Path(__file__).resolve().parents[2]
BUCKET = "cpn-checkpoints"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server of this module's own, and the standard variables that point at it
    (set here too, so in-process stores reach it the way workers do)."""
    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        pytest.skip("moto_server is not installed (pip install -e '.[dev]')")
    port = _free_port()
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "cpn-test-key",
        "AWS_SECRET_ACCESS_KEY": "cpn-test-secret",
        "AWS_REGION": "us-east-1",
    }
    try:
        wait_until(lambda: _answers(f"{endpoint}/moto-api/"), 60, "the moto S3 server")
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                mp.setenv(name, value)
            import fsspec

            fsspec.filesystem("s3").mkdir(BUCKET)
            yield env
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(params=["directory", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "directory":
        return str(tmp_path / "ck")
    request.getfixturevalue("s3_env")
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/job-1"


def _state(epoch: int = 0, step: int = 1, run_id: str = "job-1") -> dict[str, object]:
    return {"version": FORMAT, "run_id": run_id, "epoch": epoch, "step": step, "w": torch.ones(2)}


def _put(store: CheckpointStore, name: str, data: bytes) -> None:
    """Plant a blob the way an attacker with write access would: bypassing the store's rules."""
    store._write(name, data)


def test_open_store_picks_the_store_by_uri(tmp_path: Path, s3_env: dict[str, str]) -> None:
    assert isinstance(open_store(str(tmp_path)), DirectoryStore)
    assert isinstance(open_store(f"file://{tmp_path}"), DirectoryStore)
    assert isinstance(open_store(f"s3://{BUCKET}/x"), ObjectStore)
    with pytest.raises(ValueError, match=r"'nope://b/x'.*not supported"):
        open_store("nope://b/x")
    with pytest.raises(ValueError, match=r"'gs://b/x'.*not installed"):
        open_store("gs://b/x")  # gcsfs is not a dependency: named, not an ImportError


def test_save_keep_steps_and_load(uri: str) -> None:
    store = open_store(uri)
    assert store.steps() == [] and store.latest() is None
    store.keep = 2
    for step in (2, 4, 6):
        store.save(step, _state(step=step))
    assert store.steps() == [4, 6]
    found = store.latest()
    assert found is not None and found[0] == 6
    assert found[1]["step"] == 6 and torch.equal(found[1]["w"], torch.ones(2))
    assert open_store(uri).steps() == [4, 6]  # a fresh store (another process) sees them


def test_clusters_parts_are_written_beside_and_merged_on_load(uri: str) -> None:
    """A cluster's part is written from that cluster (`save_part`, before the checkpoint that
    names it); `load` merges the parts; old steps' parts go with their checkpoints, and a part
    of a stale attempt is refused like a checkpoint."""
    store = open_store(uri)
    store.keep = 1
    for step in (2, 4):
        store.save_part(step, "us-east", 0, {"optimizer": torch.full((2,), float(step))})
        state = {**_state(step=step), "clusters": {"eu-west": {"optimizer": torch.zeros(2)}}}
        store.save(step, {**state, "parts": ["us-east"]})
    assert store.steps() == [4]
    found = store.latest()
    assert found is not None and "parts" not in found[1]
    clusters = found[1]["clusters"]
    assert set(clusters) == {"eu-west", "us-east"}
    assert torch.equal(clusters["us-east"]["optimizer"], torch.full((2,), 4.0))
    assert not store._read("step-00000002.us-east.pt")  # pruned with step 2
    with pytest.raises(ValueError, match="cluster 'a/b'"):
        store.save_part(6, "a/b", 0, {})
    open_store(uri).fence(1)
    with pytest.raises(StaleRun):
        store.save_part(6, "us-east", 0, {})
    assert not store._read("step-00000006.us-east.pt")


def test_a_planted_pickle_is_refused_and_runs_no_code(uri: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self) -> tuple[object, tuple[str, int]]:
            return (os.open, (str(marker), os.O_CREAT | os.O_WRONLY))

    store = open_store(uri)
    import io

    buf = io.BytesIO()
    torch.save({"version": FORMAT, "x": Planted()}, buf)
    _put(store, "step-00000004.pt", buf.getvalue())
    with pytest.raises(CheckpointRefused, match=r"step-00000004\.pt.*without --resume"):
        store.load(4)
    assert not marker.exists()


def test_claim_records_the_owner_and_refuses_another_run(uri: str) -> None:
    store = open_store(uri)
    assert store.claim("job-1") == "job-1"
    assert open_store(uri).claim(None) == "job-1"
    with pytest.raises(CheckpointRefused, match="belongs to run 'job-1', not 'job-2'"):
        open_store(uri).claim("job-2")


def test_a_fenced_store_refuses_a_stale_runs_writes(uri: str) -> None:
    store = open_store(uri)
    store.save(1, _state(epoch=1))
    open_store(uri).fence(2)  # the adopted job's new attempt starts
    with pytest.raises(StaleRun, match="attempt 2 of this run has started"):
        store.save(2, _state(epoch=1, step=2))
    assert store.steps() == [1]  # nothing written
    with pytest.raises(StaleRun, match="this run is stale"):
        store.fence(1)
    store.fence(2)  # the same attempt again (a restart of its workers): fine
    store.save(3, _state(epoch=2, step=3))
    store.fence(3)
    assert store.fenced_epoch() == 3 and store.steps() == [1, 3]


def test_the_runner_fences_the_store_and_a_stale_run_stops_at_start(uri: str) -> None:
    """`training.run` records its epoch before any worker starts; an older attempt that starts
    after a newer one is refused there (no Ray is started: the refusal comes first)."""
    open_store(uri).fence(2)
    spec = TrainSpec(clusters={"a": 1}, steps=4, checkpoint=uri, run_id="job-1", epoch=1)
    with pytest.raises(StaleRun, match="this run is stale"):
        run(spec)
    assert open_store(uri).fenced_epoch() == 2


def test_another_runs_checkpoint_is_refused_on_resume(uri: str) -> None:
    """An object copied in from another run's prefix is refused by the driver, before Ray."""
    other = open_store(uri + "-other")
    other.save(4, _state(run_id="job-a", step=4))
    mine = open_store(uri)
    mine.claim("job-b")
    data = other._read("step-00000004.pt")
    assert data is not None
    _put(mine, "step-00000004.pt", data)
    spec = TrainSpec(clusters={"a": 1}, steps=8, checkpoint=uri, resume=True, run_id="job-b")
    with pytest.raises(CheckpointRefused, match=r"written by run 'job-a', not this run"):
        run(spec)


def test_locations_join_paths_and_uris(tmp_path: Path) -> None:
    assert child("s3://b/root/", "job") == "s3://b/root/job"
    assert child(tmp_path, "job") == str(tmp_path / "job")
    assert absolute("s3://b/root") == "s3://b/root"
    assert absolute("var/ck") == str(Path("var/ck").resolve())
    assert is_object_store("s3://b/x") and not is_object_store("file:///x")
    assert not is_object_store("var/ck")


def test_s3_settings_reach_workers_only_for_an_object_store() -> None:
    env = {"AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://s3", "HOME": "/h"}
    assert scrub.withheld(env) == ["AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY"]
    assert scrub.withheld(env, object_store=True) == []


@pytest.mark.slow
def test_cpn_train_checkpoints_to_s3_and_resumes_from_it(s3_env: dict[str, str]) -> None:
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    common = ["--task", "builtin:mnist1d-mlp", "--clusters", "a:1", "--checkpoint-dir", uri]
    env = {**os.environ, **s3_env}

    def cpn(*args: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "api.cli", "train", *common, *args, "--json"],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        report: dict[str, object] = json.loads(out.stdout)
        return report

    first = cpn("--steps", "2", "--checkpoint-every", "1")
    assert first["steps"] == 2 and first["resumed_from_step"] is None
    assert open_store(uri).steps() == [1, 2]
    second = cpn("--steps", "3", "--resume")
    assert second["steps"] == 3 and second["resumed_from_step"] == 2
    assert open_store(uri).steps() == [1, 2, 3]
