"""Datacenter fault domains on a local Ray: a cluster whose worker is killed leaves the run and
the others go on from where they were (no restart, no checkpoint read); a cluster the caller
takes away leaves, one it adds joins and takes a peer's state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray

import training
from training import TrainSpec
from training.faults import Membership
from training.runner import run

pytestmark = pytest.mark.usefixtures("ray_session")


def _spec(tmp_path: Path, **kw: object) -> TrainSpec:
    base: dict[str, object] = {
        "task": "builtin:mnist1d-mlp",
        "clusters": {"a": 1, "b": 1, "c": 1},
        "steps": 48,
        "sync": "local-sgd:4",
        "checkpoint": str(tmp_path / "ckpt"),
        "checkpoint_every": 8,
        "eval_every": 8,
        "fault_grace_s": 20.0,
    }
    base.update(kw)
    return TrainSpec(**base)  # type: ignore[arg-type]


PLANNED: dict[str, object] = {
    "adapt": ("sync", "compression"),
    "compression": "int8",
    "sync": "local-sgd:8",
}
"""A control-plane job that left sync and compression to auto: it runs under `AutoSync`,
started on its plan's pair, and must shrink and grow in place as a fixed plan does."""
PARTIAL: dict[str, object] = {"sync": "partial:4", "slowdown": {"a": 2.0}}
"""Partial sync with a slow cluster: the others take extra local steps in a round."""
ASYNC_PS: dict[str, object] = {"sync": "async-ps:4", "compression": "int8"}
GOSSIP: dict[str, object] = {"sync": "gossip:4", "compression": "int8"}
STREAMING: dict[str, object] = {"sync": "streaming:8", "compression": "int8"}
ALL = {
    "fixed": {},
    "adapting": PLANNED,
    "partial": PARTIAL,
    "gossip": GOSSIP,
    "streaming": STREAMING,
    "async-ps": ASYNC_PS,
}


def _modes(*names: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("mode", [ALL[n] for n in names], ids=list(names))


# To keep the suite's time: partial's loss and re-form are local SGD's (its own state is
# its steps per step, which the join exercises).
KILLED = _modes("fixed", "adapting", "gossip", "streaming", "async-ps")
CALLER = _modes("fixed", "adapting", "partial", "gossip", "streaming", "async-ps")


def _kill_cluster(cluster: str, rank: int) -> None:
    names = [n for n in ray.util.list_named_actors() if n.endswith(f"-w{rank}")]
    assert names, ray.util.list_named_actors()
    for n in names:
        ray.kill(ray.get_actor(n), no_restart=True)


@KILLED
def test_a_killed_cluster_leaves_and_the_others_go_on(
    tmp_path: Path, mode: dict[str, object]
) -> None:
    clean = training.run(_spec(tmp_path / "clean", **mode))
    seen: list[training.Progress] = []

    def kill_c(p: training.Progress) -> None:
        seen.append(p)
        if len(seen) == 2:
            _kill_cluster("c", 2)

    report = training.run(_spec(tmp_path / "killed", **mode), on_progress=kill_c)
    assert report.restarts == 0  # no cluster restarted, none read a checkpoint
    assert report.resumed_from_step is None
    assert report.steps == 48
    left = [m for m in report.membership if m["change"] == "left"]
    assert [(m["cluster"], m["why"]) for m in left] == [("c", "gone")]
    assert left[0]["step"] >= seen[1].step  # the survivors lost no step they had made
    # the survivors did not wait out the grace window: a peer's sockets closed at once
    assert left[0]["recovery_s"] < 20.0
    assert report.clusters == {"a": 1, "b": 1}
    assert seen[-1].clusters == {"a": 1, "b": 1}
    # under async-ps (and partial) the clusters take local steps by their measured speed
    # (which load on this machine moves), and the lost cluster's extra samples go with it
    tolerance = 0.10 if mode is ASYNC_PS else 0.05
    assert abs(report.final_accuracy - clean.final_accuracy) <= tolerance


def _wait_loaded(name: str) -> None:
    """Until the joining workers named `*name*` have loaded the task: this run is short, and
    a newcomer still loading when it ends never joins. Their `prepare` is idempotent and
    runs one call at a time, so this call returns once the driver's has."""
    actors = [n for n in ray.util.list_named_actors() if name in n]
    assert actors, f"no joining worker named *{name}*"
    ray.get([ray.get_actor(n).prepare.remote() for n in actors], timeout=120)


@CALLER
def test_the_caller_takes_a_cluster_away_and_adds_another(
    tmp_path: Path, mode: dict[str, object]
) -> None:
    wanted = [Membership(0, {"a": 1, "b": 1, "c": 1})]
    steps: list[int] = []
    # the caller's plan on the grown run: d first in its ring, a heavier share for a
    shares = {"a": 0.5, "b": 0.25, "d": 0.25}

    def follow(p: training.Progress) -> None:
        steps.append(p.step)
        if len(steps) == 1:
            wanted[0] = Membership(1, {"a": 1, "b": 1})
        elif len(steps) == 2:
            wanted[0] = Membership(2, {"d": 2, "a": 1, "b": 1}, batch_shares=shares)
        elif len(steps) == 3:  # d's workers start and load while a and b train on
            assert p.clusters == {"a": 1, "b": 1}
            _wait_loaded("-j2-w")

    report = run(_spec(tmp_path, **mode), on_progress=follow, membership=lambda: wanted[0])
    assert report.restarts == 0
    changes = [(m["cluster"], m["change"]) for m in report.membership]
    assert changes[:2] == [("c", "left"), ("d", "joined")], changes
    # a mode that seats a newcomer late (local SGD, partial, streaming) says when it began
    # training; one that waits for the state trains it at once
    late = str(mode.get("sync", "local-sgd")).startswith(("local-sgd", "partial", "streaming"))
    assert changes[2:] == ([("d", "seated")] if late else []), changes
    joined = report.membership[1]
    # the newcomer's workers started and loaded while a and b trained on; it joined at a
    # step the survivors had reached, not from a checkpoint
    assert joined["ready_s"] > 0.0
    assert joined["step"] in steps[1:]
    assert report.clusters == {"a": 1, "b": 1, "d": 2}
    assert list(report.clusters) == ["d", "a", "b"]  # in the caller's ring order
    assert report.batch_shares == pytest.approx(shares, abs=0.05)  # not equal per worker
    assert report.steps == 48
    assert report.wan_setup_bytes > 0  # the newcomer's state crossed from a peer
    # chance is 0.10; a clean run of each mode on these clusters ends at 0.30-0.34 at 48 steps
    assert report.final_accuracy > 0.25


def test_a_newcomer_sits_out_the_round_its_state_crosses_in_and_ends_it_as_the_others(
    tmp_path: Path,
) -> None:
    """a and b train on while c's two workers take b's state (local SGD seats them at the
    round's end: `SyncStrategy.seats_at`); they train nothing and weigh nothing until then,
    take part in its outer step all the same, and hold the model a and b hold from there."""
    wanted = [Membership(0, {"a": 1, "b": 1})]
    seen: list[training.Progress] = []
    digests: list[set[str]] = []
    trained: list[float] = []

    def follow(p: training.Progress) -> None:
        seen.append(p)
        if len(seen) == 1:
            wanted[0] = Membership(1, {"c": 2, "a": 1, "b": 1})
        elif len(seen) == 2:
            _wait_loaded("-j1-w")
        elif "c" in p.clusters:  # every report is at an outer round's end (eval_every 4)
            names = [n for n in ray.util.list_named_actors() if n.startswith("cpn-")]
            digests.append(set(ray.get([ray.get_actor(n).digest.remote() for n in names])))
            trained.append(p.compute_by_cluster["c"])

    spec = _spec(tmp_path, clusters={"a": 1, "b": 1}, eval_every=4, compression="none")
    report = run(spec, on_progress=follow, membership=lambda: wanted[0])
    assert [(m["cluster"], m["change"]) for m in report.membership] == [
        ("c", "joined"),
        ("c", "seated"),
    ]
    joined, seated = report.membership
    # seated at the end of the round it joined in (local SGD's period, 4 steps here)
    assert seated["step"] > joined["step"] and seated["step"] % 4 == 0, report.membership
    assert report.restarts == 0 and report.clusters == {"c": 2, "a": 1, "b": 1}
    assert digests, "c never took part"
    assert len(digests[-1]) == 1, digests  # one model on every rank
    # a rank sitting out holds no model of its own yet; c's did, and trained, before the end
    assert trained[-2] > 0.0, trained
    at = trained.index(next(t for t in trained if t > 0.0))
    assert all(len(d) == 1 for d in digests[at:]), digests
    # the local steps c took: not the steps before it came, nor those it sat out
    taken = report.steps_by_cluster
    assert taken["a"] == taken["b"] == report.steps and 0 < taken["c"] < report.steps, taken
    assert taken["c"] == report.steps - seated["step"], (taken, seated)  # from its seat on
    assert report.final_accuracy > 0.25  # chance is 0.10


def test_after_a_loss_the_callers_new_plan_for_the_survivors_is_what_runs(tmp_path: Path) -> None:
    """The run shrinks itself when c dies; the caller (the controller) then re-plans the
    survivors with other batch shares and ring order: the run re-forms to run that plan."""
    wanted = [Membership(0, {"a": 1, "b": 1, "c": 1})]
    shares = {"a": 0.25, "b": 0.75}
    seen: list[training.Progress] = []

    def follow(p: training.Progress) -> None:
        seen.append(p)
        if len(seen) == 2:
            _kill_cluster("c", 2)
        elif p.clusters == {"a": 1, "b": 1} and wanted[0].version == 0:
            wanted[0] = Membership(1, {"b": 1, "a": 1}, batch_shares=shares)

    report = run(_spec(tmp_path), on_progress=follow, membership=lambda: wanted[0])
    assert report.restarts == 0
    assert [(m["cluster"], m["change"]) for m in report.membership] == [("c", "left")]
    assert list(report.clusters) == ["b", "a"]
    assert report.batch_shares == pytest.approx(shares, abs=0.05)


def test_a_frozen_cluster_is_left_after_a_probe_not_the_grace_window(tmp_path: Path) -> None:
    """A stopped worker (SIGSTOP: alive, its sockets open, answering nothing) is what a cut
    link looks like to its peers: their collective waits on it and gloo ends that wait only
    after the grace window. The driver finds it unreachable by its probe, the others end
    their connections to its group (`training.connections`), and the run goes on without it
    long before the window."""
    grace = 120.0
    seen: list[training.Progress] = []
    frozen: list[tuple[int, float]] = []

    def freeze_c(p: training.Progress) -> None:
        seen.append(p)
        if len(seen) == 2:
            (name,) = [n for n in ray.util.list_named_actors() if n.endswith("-w2")]
            getpid: Any = ray.get_actor(name).__ray_call__  # runs `os.getpid` in the actor
            pid = ray.get(getpid.remote(lambda _self: os.getpid()), timeout=60)
            os.kill(pid, signal.SIGSTOP)
            frozen.append((pid, time.monotonic()))
        elif frozen and len(frozen) == 1:
            frozen.append((0, time.monotonic()))  # the first report after the freeze

    try:
        report = training.run(_spec(tmp_path, fault_grace_s=grace), on_progress=freeze_c)
    finally:
        for pid, _ in frozen[:1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert report.restarts == 0 and report.resumed_from_step is None
    left = [(m["cluster"], m["why"]) for m in report.membership if m["change"] == "left"]
    assert left == [("c", "silent")]
    assert report.clusters == {"a": 1, "b": 1} and report.steps == 48
    # the survivors went on within a probe's time and a re-form, not after the window
    assert frozen[1][1] - frozen[0][1] < grace / 2, frozen


def test_async_ps_goes_on_when_its_servers_host_is_lost(tmp_path: Path) -> None:
    """The parameter server lives with cluster a's leader (rank 0, the first cluster: no
    link table): a's loss takes the server with it; b and c find it gone at their next
    push, re-form and go on on a new server of their own, without a restart."""
    seen: list[training.Progress] = []

    def kill_a(p: training.Progress) -> None:
        seen.append(p)
        if len(seen) == 2:
            _kill_cluster("a", 0)

    spec = _spec(tmp_path, sync="async-ps:4", compression="int8")
    report = training.run(spec, on_progress=kill_a)
    assert report.restarts == 0 and report.resumed_from_step is None
    left = [(m["cluster"], m["why"]) for m in report.membership if m["change"] == "left"]
    assert left == [("a", "gone")]
    assert report.clusters == {"b": 1, "c": 1}
    assert report.steps == 48
    assert report.final_accuracy > 0.25  # chance is 0.10


def test_without_fault_domains_a_kill_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    seen: list[int] = []

    def kill_c(p: training.Progress) -> None:
        seen.append(p.step)
        if len(seen) == 2:
            _kill_cluster("c", 2)

    report = training.run(_spec(tmp_path, fault_domains=False), on_progress=kill_c)
    assert report.restarts == 1 and report.membership == []
    assert report.clusters == {"a": 1, "b": 1, "c": 1}
