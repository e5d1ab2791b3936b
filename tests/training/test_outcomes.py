"""How the driver waits on a segment under fault domains (`training.ray_actors.outcomes`): once a
call fails, a busy actor that answers `ping` is slow and is waited for; one that does not is
unreachable and is not waited for (on a local Ray, an actor whose ping thread is held stands in
for one behind a cut link: it is alive but cannot answer)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray

from training.ray_actors import PROBE_GROUP, PROBE_S, outcomes

pytestmark = pytest.mark.usefixtures("ray_session")


class Member:
    """A worker stand-in: `run` fails, ends late, or hangs; `ping` answers or is held."""

    def __init__(self, run: str, answers: bool) -> None:
        self.how = run
        self.answers = answers
        self.release = threading.Event()

    def run(self) -> str:
        if self.how == "fail":
            raise RuntimeError("group broken")
        if self.how == "slow":
            time.sleep(PROBE_S + 3.0)
            return "done"
        self.release.wait(120)  # silent: never ends on its own
        if self.how == "fail":
            raise RuntimeError("connection closed by peer")
        return "late"

    def ping(self) -> bool:
        if not self.answers:
            self.release.wait(120)
        return True

    def sever(self) -> None:
        """On the probe thread: a blocked `run` fails now (as `Worker.sever` ends its wait)."""
        self.how = "fail"
        self.release.set()


def _members(*kinds: tuple[str, bool]) -> list[Any]:
    """The actors, the answering ones up (a loaded machine may take longer than a short
    probe to start an actor's process: a worker's is up long before its segments)."""
    make: Any = ray.remote  # its stubs lack `concurrency_groups`
    remote: Any = make(concurrency_groups=PROBE_GROUP)(Member)
    actors = [remote.options(num_cpus=0).remote(how, answers) for how, answers in kinds]
    up = [a.ping.remote() for a, (_, answers) in zip(actors, kinds, strict=True) if answers]
    ray.get(up, timeout=120)
    return actors


def test_an_unreachable_member_is_not_waited_for_a_slow_one_is() -> None:
    actors = _members(("fail", True), ("slow", True), ("silent", False))
    try:
        began = time.monotonic()
        done, failed_at = outcomes([a.run.remote() for a in actors], 60.0, actors)
        took = time.monotonic() - began
        assert failed_at is not None
        assert [o.done for o in done] == [True, True, False]
        assert done[1].value == "done"  # the slow one was waited for
        assert took < 30.0  # not the 60 s window: the silent one was given up after its probe
    finally:
        for a in actors:
            ray.kill(a)


def test_without_probes_a_silent_member_costs_the_whole_window() -> None:
    actors = _members(("fail", True), ("silent", False))
    try:
        began = time.monotonic()
        done, _ = outcomes([a.run.remote() for a in actors], 6.0)
        assert [o.done for o in done] == [True, False]
        assert time.monotonic() - began >= 6.0
    finally:
        for a in actors:
            ray.kill(a)


def test_a_member_unreachable_before_any_failure_ends_its_peers_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody failed yet: the two answering members wait on the third, which answers no
    probe. After `PROBE_S` the driver asks them to end their waits (`on_silent`), counts
    that as the failure and does not wait for the silent one."""
    monkeypatch.setattr("training.ray_actors.PROBE_S", 1.5)  # the driver's side: a shorter test
    actors = _members(("blocked", True), ("blocked", True), ("silent", False))
    told: list[set[int]] = []

    def end_waits(silent: set[int]) -> bool:
        told.append(silent)
        for i, a in enumerate(actors):
            if i not in silent:
                a.sever.options(concurrency_group="probe").remote()
        return True

    try:
        began = time.monotonic()
        done, failed_at = outcomes([a.run.remote() for a in actors], 60.0, actors, end_waits)
        assert told == [{2}]
        assert failed_at is not None and failed_at - began >= 1.5
        assert [o.done for o in done] == [True, True, False]
        assert all(isinstance(o.error, ray.exceptions.RayTaskError) for o in done[:2])
    finally:
        for a in actors:
            ray.kill(a)


def test_after_a_failure_a_member_still_waiting_on_a_silent_one_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One member failed (its sockets closed), another still waits on the silent third: its
    wait is ended too, not left to the window."""
    monkeypatch.setattr("training.ray_actors.PROBE_S", 1.5)
    actors = _members(("fail", True), ("blocked", True), ("silent", False))
    told: list[set[int]] = []

    def end_waits(silent: set[int]) -> bool:
        told.append(silent)
        actors[1].sever.options(concurrency_group="probe").remote()
        return True

    try:
        done, _ = outcomes([a.run.remote() for a in actors], 60.0, actors, end_waits)
        assert told == [{2}]
        assert [o.done for o in done] == [True, True, False]  # not the 60 s window
        assert isinstance(done[1].error, ray.exceptions.RayTaskError)
    finally:
        for a in actors:
            ray.kill(a)


def test_nobody_is_cut_off_while_no_member_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every busy member silent at once is the driver's trouble (its host, its link), not
    theirs: nobody's wait is ended; the segment's own time limit stands."""
    monkeypatch.setattr("training.ray_actors.PROBE_S", 1.5)
    monkeypatch.setattr("training.ray_actors.SEGMENT_TIMEOUT_S", 5.0)  # probes come up empty
    actors = _members(("silent", False), ("silent", False))
    told: list[set[int]] = []

    def end_waits(silent: set[int]) -> bool:
        told.append(silent)
        return True

    try:
        with pytest.raises(TimeoutError):
            outcomes([a.run.remote() for a in actors], 5.0, actors, end_waits)
    finally:
        for a in actors:
            ray.kill(a)
    assert told == []
