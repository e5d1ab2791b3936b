"""What workers print reaches the run's reports (`training.logs`, `Progress.logs`)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from training import Progress, TrainSpec
from training.logs import MAX_KEPT_LINES, MAX_LINE_CHARS, Capture, _Tee
from training.runner import run


def test_a_tee_writes_through_and_keeps_whole_lines() -> None:
    inner = io.StringIO()
    kept = Capture()
    kept.source = "a/0"
    tee = _Tee(inner, "stdout", kept)
    tee.write("one\ntw")
    assert [x.text for x in kept.take()] == ["one"]  # a partial line waits for its end
    tee.write("o\r\nthree\x00\n")
    lines = kept.take()
    assert [x.text for x in lines] == ["two", "three\ufffd"]
    assert {(x.source, x.stream) for x in lines} == {("a/0", "stdout")}
    assert inner.getvalue() == "one\ntwo\r\nthree\x00\n"  # what went through is untouched
    tee.write("x" * (3 * MAX_LINE_CHARS))  # no newline ever: cut, not held forever
    (long,) = kept.take()
    assert len(long.text) < MAX_LINE_CHARS + 40 and long.text.endswith("characters]")


def test_a_capture_keeps_the_newest_lines_and_says_how_many_it_dropped() -> None:
    kept = Capture()
    for i in range(MAX_KEPT_LINES + 5):
        kept.keep("stderr", f"line {i}")
    lines = kept.take()
    assert lines[0].text.startswith("[5 earlier lines dropped")
    assert lines[1].text == "line 5" and lines[-1].text == f"line {MAX_KEPT_LINES + 4}"
    assert kept.take() == ()


@pytest.mark.usefixtures("ray_session")
def test_what_each_worker_prints_comes_with_the_reports() -> None:
    reports: list[Progress] = []
    spec = TrainSpec(
        task="tests.e2e.entry_tasks:chatty", clusters={"a": 1, "b": 1}, steps=4, eval_every=2
    )
    run(spec, on_progress=reports.append)
    lines: list[Any] = [x for p in reports for x in p.logs]
    by = {(x.source, x.stream, x.text.split(" in pid")[0]) for x in lines}
    for worker in ("a/0", "b/1"):  # cluster/rank, the rank across the run
        assert (worker, "stdout", "chatty: loaded") in by, lines
        assert (worker, "stderr", "chatty: a line on stderr") in by, lines
        # each cluster's leader says where training is at every report, evaluation included
        said = [x.text for x in lines if x.source == worker and x.text.startswith("step ")]
        assert said and said[-1].startswith("step 4/4 loss "), lines
    evaluated = [x.text for x in lines if x.source == "a/0" and " accuracy " in x.text]
    assert evaluated, lines  # rank 0 evaluates, and says so
    assert [x.at for x in reports[0].logs] == sorted(x.at for x in reports[0].logs)
