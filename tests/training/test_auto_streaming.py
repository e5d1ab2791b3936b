"""`--sync auto` on a real local Ray: when the link slows down it streams (fragments in flight
under the inner steps), and when the link recovers it leaves streaming by draining it, so the
run ends with every cluster holding the same parameters; resumed from a checkpoint taken
while streaming (each cluster its own view), it ends so too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import training
from grammar import SyncKind, parse_sync
from grammar.auto import SURVIVES_LOSS
from training import TrainSpec
from training.checkpoint import open_store
from training.runner import WorkerPool

pytestmark = pytest.mark.usefixtures("ray_session")

MLP = "builtin:mnist1d-mlp"
FAST, SLOW, RTT = 100_000.0, 0.5, 2.0
"""Mbit/s and ms. FAST puts the int8 model (23 K parameters, 23 KB) on the link in 2 us, so
an exchange costs the RTT: blocking local-sgd:32 is cheap (<= 0.1 x 32 steps of compute) for
any compute above 0.63 ms a step; never every-step below 20 ms (the RTT alone is more than
0.1 x a step). SLOW takes ~370 ms at int8 and ~190 ms at int4: blocking would need 30 ms
of compute a step even at int4 and H=64 (auto blocks at any period before it streams), while
streaming's fragments fit their delay from about 3 ms (int4 at H=64), int2's and top-k's
below that: so it streams over a wide range of compute (mnist1d-mlp's step measured 1.3 ms
alone in one session, 6-10 ms in another)."""


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool()
    yield workers
    workers.close()


def _models(pool: WorkerPool) -> list[dict[str, torch.Tensor]]:
    """Each worker's parameters as the run left them (the pool keeps its actors)."""
    actors: list[Any] = [a for group in pool._idle.values() for a in group]

    def params(worker: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}

    return list(ray.get([a.__ray_call__.remote(params) for a in actors]))


def test_auto_streams_on_a_slow_link_and_drains_when_it_recovers(pool: WorkerPool) -> None:
    spec = TrainSpec(
        task=MLP,
        clusters={"a": 1, "b": 1},
        # observed every period (32 or 64): two rounds on the slow link make it stream; after
        # the recovery at 136, two rounds at streaming's period make it leave
        steps=296,
        sync="auto",
        compression="auto",
        link_mbps=FAST,
        rtt_ms=RTT,
        link_schedule=[(8, SLOW, RTT), (136, FAST, RTT)],
        eval_every=74,
    )
    report = training.run(spec, pool=pool)
    assert report.steps == 296
    seen = [(c.step, c.sync, c.compression) for c in report.auto_decisions]
    assert seen[0][0] == 4, seen
    assert all(parse_sync(s).kind is not SyncKind.EVERY_STEP for _, s, _ in seen), seen
    slow = [(s, sync) for s, sync, _ in seen if 8 < s <= 136]
    # the slow link made it stream (from the warm-up's local SGD or from local SGD), its step
    # within the slack of the fastest candidate's
    assert slow and parse_sync(slow[-1][1]).kind is SyncKind.STREAMING, seen
    streamed = slow[-1][1]
    # the recovered link made it leave that streaming (drained), to local SGD or another
    assert any(s > 136 and sync != streamed for s, sync, _ in seen), seen
    why = next(c.why for c in report.auto_decisions if c.sync == streamed)
    assert why.startswith(streamed) and "step " in why and "quality cost" in why, why
    models = _models(pool)
    assert len(models) == 2
    for k, v in models[0].items():
        assert torch.equal(models[1][k], v), k
    losses = [h["loss"] for h in report.history]
    assert losses[-1] < losses[0], losses
    # leaving streaming drained it: one blocking exchange on the slow link (of the level it
    # streamed at: 20 ms for the lightest, 0.2 s for int4)
    assert report.sync_stats["drain_s"] > 0.01, report.sync_stats


def test_streaming_reports_the_waits_the_inner_steps_did_not_hide(pool: WorkerPool) -> None:
    """With no delay every fragment is applied at the step it left, so each one's whole
    exchange is waited for: at SLOW, ~0.19 s for half the int8 model (11.6 KB at 0.5 Mbit/s);
    the same run on the FAST link waits for its RTTs only."""

    def run(mbps: float) -> dict[str, float]:
        spec = TrainSpec(
            task=MLP,
            clusters={"a": 1, "b": 1},
            steps=32,
            sync="streaming:8:f2:d0",
            compression="int8",
            link_mbps=mbps,
            rtt_ms=RTT,
        )
        return training.run(spec, pool=pool).sync_stats

    slow, fast = run(SLOW), run(FAST)
    # 2 fragments every 8 steps, each applied when due; the last step's drain sends the
    # fragment that left 4 steps before the end once more, outside the late ones
    assert slow["late_fragments"] == 8, slow
    assert slow["late_wait_s"] >= 8 * 0.15, slow
    assert slow["drain_s"] >= 0.15, slow
    # what the slow link adds is its transfer time (the fast run's waits are its RTTs and
    # whatever the machine's load adds to both runs alike: a ratio of the two failed under load)
    assert slow["late_wait_s"] - fast["late_wait_s"] >= 0.75 * 8 * 0.15, (fast, slow)


def test_a_run_resumed_from_a_streaming_checkpoint_ends_with_equal_clusters(
    pool: WorkerPool, tmp_path: Path
) -> None:
    def spec() -> TrainSpec:
        return TrainSpec(
            task=MLP,
            clusters={"a": 1, "b": 1},
            steps=48,
            sync="auto",
            compression="auto",
            link_mbps=SLOW,
            rtt_ms=RTT,
            checkpoint=str(tmp_path / "ck"),
            checkpoint_every=20,
            eval_every=20,
        )

    seen: list[int] = []
    stopped = training.run(
        spec(), pool=pool, on_progress=lambda p: seen.append(p.step), should_stop=lambda: bool(seen)
    )
    assert stopped.stopped and stopped.steps == 20
    assert parse_sync(stopped.auto_decisions[-1].sync).kind is SyncKind.STREAMING
    # streaming's clusters differ between their fragments' syncs: each resumes its own view
    state = open_store(str(tmp_path / "ck")).latest()
    assert state is not None and state[0] == 20
    views = [c["model"] for c in state[1]["clusters"].values()]
    assert not torch.equal(views[0]["0.weight"], views[1]["0.weight"])
    again = spec()
    again.resume = True
    resumed = training.run(again, pool=pool)
    assert resumed.resumed_from_step == 20 and resumed.steps == 48
    assert resumed.auto_decisions[0].step == 24  # the warm-up's first exchange after 20
    models = _models(pool)
    for k, v in models[0].items():
        assert torch.equal(models[1][k], v), k


def test_every_step_after_the_local_warm_up_keeps_the_clusters_equal(pool: WorkerPool) -> None:
    """The warm-up's local steps leave each cluster its own optimizer momentum; every-step
    starts both from none, or their parameters drift apart though their gradients agree."""
    spec = TrainSpec(
        task=MLP,
        clusters={"a": 1, "b": 1},
        steps=24,
        sync="auto",
        compression="auto",
        link_mbps=FAST,
        rtt_ms=0.0,
        eval_every=12,
    )
    report = training.run(spec, pool=pool)
    assert [parse_sync(c.sync).kind for c in report.auto_decisions] == [SyncKind.EVERY_STEP]
    models = _models(pool)
    for k, v in models[0].items():
        assert torch.equal(models[1][k], v), k


def test_a_planned_run_keeps_its_plan_until_the_link_slows_then_re_decides(
    pool: WorkerPool,
) -> None:
    """A control-plane run (`adapt`) starts on its plan's local-sgd:8 fp32 with no warm-up;
    on the fast link it never re-decides. When the link slows (at step 64), the next two
    observations (each period) see it and the policy moves to a lighter pair, among the modes
    that shrink in place (fault domains are on); the decision and its reason are reported."""
    planned = {
        "task": MLP,
        "clusters": {"a": 1, "b": 1},
        "sync": "local-sgd:8",
        "compression": "none",
        "adapt": ("sync", "compression"),
        "link_mbps": FAST,
        "rtt_ms": RTT,
    }
    steady = training.run(TrainSpec(**planned, steps=48, eval_every=48), pool=pool)  # type: ignore[arg-type]
    assert steady.auto_decisions == [] and steady.compression == "none"
    slowed = training.run(
        TrainSpec(**planned, steps=128, eval_every=64, link_schedule=[(64, SLOW, RTT)]),  # type: ignore[arg-type]
        pool=pool,
    )
    assert slowed.auto_decisions, slowed.sync_stats
    first = slowed.auto_decisions[0]
    assert 64 <= first.step <= 88, slowed.auto_decisions
    assert (first.sync, first.compression) != ("local-sgd:8", "none")
    assert parse_sync(first.sync).kind in SURVIVES_LOSS
    assert "0.5 Mbit/s" in first.why, first.why
    assert slowed.steps == 128
