"""A pipeline job that loses a cluster, end to end: real `cpn serve` (its SQLite database, its
control loop, its local Ray), real agents whose heartbeats keep the clusters' leases. One
stage's agent is killed after the stages checkpointed; its lease lapses, the cluster goes
DOWN, and only that stage moves (`controller.loop.restage`); the relaunched run resumes from the
stages' checkpoints and the job succeeds."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.world import World, build_world, wait_for
from tests.faults.invariants import assert_books, read_books

pytestmark = pytest.mark.slow

CLUSTERS: dict[str, dict[str, Any]] = {
    "east": {"model": "A100", "count": 1, "price": 2.5},
    "west": {"model": "A100", "count": 1, "price": 2.5},
    "south": {"model": "A100", "count": 1, "price": 2.5},  # the spare: cordoned at first
}
LINKS = [
    ("east", "west", 0.1, 200.0, 0.02),  # slow: the first run cannot finish before the loss
    ("east", "south", 1.0, 5.0, 0.02),
    ("west", "south", 1.0, 5.0, 0.02),
]
"""Pinned: the agents' probes (all on this host) would otherwise make every link fast."""
STEPS, EVERY = 120, 10
"""Segments (and stage checkpoints) every 10 steps: the run is stopped at a segment's end."""
SHARD = re.compile(r"step-(\d+)\.pt")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, clusters=CLUSTERS, links=[])
    for a, b, gbps, rtt, price in LINKS:
        w.admin.declare_link(
            a, b, bandwidth_gbps=gbps, rtt_ms=rtt, egress_price_per_gb=price, pinned=True
        )
    yield w
    w.stop()


def _saved_steps(root: Path, stages: int) -> set[int]:
    """The steps every stage has a checkpoint of (the run's consistent cuts)."""
    found = []
    for stage in range(stages):
        names = (p.name for p in (root / f"stage-{stage}").glob("step-*.pt"))
        found.append({int(m.group(1)) for n in names if (m := SHARD.fullmatch(n))})
    return set.intersection(*found)


def _gpu_faults(url: str) -> list[str]:
    """What the books say is wrong with the GPUs: in use beyond a cluster's count or below
    zero, in use that is not its open allocations, or held by a job that is not active."""
    return [b for b in read_books(url).broken if "in_use" in b or "GPUs held" in b or "holds" in b]


def test_a_down_clusters_stage_moves_and_the_pipeline_resumes(world: World) -> None:
    """Two stages on east and west (one A100 each) over a slow link; south, cordoned until
    the job runs, is the spare. The last stage's agent is killed once both stages
    checkpointed: its cluster goes DOWN, the job goes RESCHEDULING naming that stage's move
    to south, the first stage stays where it is, the relaunch resumes from a checkpoint past
    step 0, and the job succeeds with the GPUs never held beyond a cluster's count."""
    url = world.plane.env["CPN_DATABASE_URL"]
    world.admin.post("/v1/clusters/south/cordon")  # its fast links would win the first plan
    job = dict(
        world.tenant.post(
            "/v1/jobs",
            {"name": "pipe", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": STEPS,
             "parallelism": "pipeline", "compression": "none",
             "pipeline": {"micro_batches": 2},
             "args": {"eval_every": EVERY, "checkpoint_every": EVERY}},
        )
    )  # fmt: skip
    job_id = job["id"]
    faults: list[str] = []

    def sample() -> None:
        faults.extend(_gpu_faults(url))

    running = world.wait_state(job_id, {"RUNNING"}, 120)
    before = [s["cluster"] for s in running["placement"]["parallel"]["stages"]]
    assert sorted(before) == ["east", "west"], running["placement"]
    victim, keeper = before[1], before[0]
    world.admin.post("/v1/clusters/south/uncordon")
    root = Path(world.settings["CPN_CHECKPOINT_ROOT"]) / job_id

    def checkpointed() -> int:
        sample()
        return max(_saved_steps(root, 2), default=0)

    first = wait_for(checkpointed, 120, "both stages checkpointed a step")
    assert world.job(job_id)["state"] == "RUNNING", "the job ended before its cluster was lost"
    world.agents[victim].kill(signal.SIGKILL)

    def ended() -> dict[str, Any] | None:
        sample()
        j = world.job(job_id)
        return j if j["state"] in {"SUCCEEDED", "FAILED", "CANCELLED"} else None

    done = wait_for(ended, 240, "the pipeline job ends")
    events = list(world.admin.paginate(f"/v1/jobs/{job_id}/events"))
    assert done["state"] == "SUCCEEDED", events
    assert world.states(job_id) == [
        "PENDING", "SCHEDULED", "RUNNING", "RESCHEDULING", "SCHEDULED", "RUNNING", "SUCCEEDED",
    ]  # fmt: skip
    # RESCHEDULING names the moved stage; only it moved, the other kept its cluster
    moved = next(e for e in events if e.get("to_state") == "RESCHEDULING")
    assert moved["message"].startswith(f"cluster {victim} is DOWN"), moved
    assert f"stage 1: {victim} -> south" in moved["message"], moved
    assert "stage 0" not in moved["message"], moved
    assert moved["data"]["stages"] == [keeper, "south"]
    after = [s["cluster"] for s in done["placement"]["parallel"]["stages"]]
    assert after == [keeper, "south"]
    assert {c["cluster"]: c["gpus"] for c in done["placement"]["clusters"]} == {
        keeper: 1,
        "south": 1,
    }
    # the relaunch resumed from a stage checkpoint saved before the loss, not from step 0
    report = next(e for e in events if e.get("to_state") == "SUCCEEDED")["data"]["report"]
    assert report["steps"] == STEPS
    resumed = report["resumed_from_step"]
    assert resumed is not None and first <= resumed < STEPS and resumed % EVERY == 0, report
    assert STEPS in _saved_steps(root, 2)
    # the GPUs: never beyond a cluster's count, all given back, the books in order
    sample()
    assert not faults, faults
    assert world.gpus_in_use() == 0
    assert_books(url)
