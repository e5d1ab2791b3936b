"""The arithmetic of bench.linkchange (the change schedule, decision walls, rounds after a
change, link phases, the table): no testbed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.linkchange import (
    EVERY_STEP_OBSERVE,
    AppliedChange,
    Choice,
    LinkSchedule,
    RateChange,
    Run,
    Sample,
    peak_uplink,
    phases,
    plot,
    render,
    responses,
    round_steps,
    running_at,
    schedule,
    segment_rates,
    table,
    tc_rate,
    wall_at,
)

# 8 steps per eval; 1 s per step until step 32, then 4 s per step (the slow link)
HISTORY = [
    {"step": s, "wall_s": float(s if s <= 32 else 32 + 4 * (s - 32)), "loss": 1.0, "accuracy": 0.5}
    for s in range(8, 65, 8)
]
DECISIONS = [
    Choice(4, "local-sgd:16", "none", "first"),
    Choice(48, "local-sgd:16", "int8", "slower link"),
    Choice(64, "local-sgd:16", "none", "link back"),
]


def test_schedule_goes_down_then_back_and_refuses_bad_orders() -> None:
    assert schedule(480, 160, 320, 10.0, 100.0) == [RateChange(160, 10.0), RateChange(320, 100.0)]
    for down, up in ((0, 10), (20, 20), (30, 20)):
        with pytest.raises(ValueError, match="down-at"):
            schedule(100, down, up, 10.0, 100.0)
    with pytest.raises(ValueError, match="past the run"):
        schedule(100, 10, 101, 10.0, 100.0)
    with pytest.raises(ValueError, match="> 0"):
        schedule(100, 10, 20, 0.0, 100.0)


def test_each_change_is_due_once_at_the_first_progress_at_or_past_its_step() -> None:
    plan = LinkSchedule(schedule(96, 30, 60, 10.0, 100.0))
    assert plan.due(24) == []
    assert plan.due(32) == [RateChange(30, 10.0)]  # first eval past step 30
    assert plan.due(40) == []  # not again
    assert plan.due(64) == [RateChange(60, 100.0)]
    assert plan.due(96) == []
    # one segment that passes both: both, in order (the last one is what stays)
    assert LinkSchedule(schedule(96, 30, 60, 10.0, 100.0)).due(96) == [
        RateChange(30, 10.0),
        RateChange(60, 100.0),
    ]
    assert LinkSchedule([]).due(10**6) == []


def test_wall_at_interpolates_the_history_from_the_origin() -> None:
    assert wall_at(HISTORY, 0) == 0.0
    assert wall_at(HISTORY, 4) == pytest.approx(4.0)  # before the first eval: from (0, 0)
    assert wall_at(HISTORY, 32) == pytest.approx(32.0)
    assert wall_at(HISTORY, 36) == pytest.approx(48.0)  # 4 s per step after step 32
    assert wall_at(HISTORY, 68) == pytest.approx(32 + 4 * 36)  # past the end: last pace
    assert wall_at([], 10) is None


def test_round_steps_is_the_period_or_the_every_step_observation_interval() -> None:
    from training.sync.auto import OBSERVE_EVERY

    assert EVERY_STEP_OBSERVE == OBSERVE_EVERY  # kept in step with the runtime
    assert round_steps("local-sgd:64") == 64
    assert round_steps("every-step") == EVERY_STEP_OBSERVE
    assert round_steps("every-step", every_step_observe=5) == 5


def test_running_at_is_the_last_decision_made_by_then() -> None:
    assert running_at(DECISIONS, 3) is None
    assert running_at(DECISIONS, 4) == DECISIONS[0]
    assert running_at(DECISIONS, 47) == DECISIONS[0]
    assert running_at(DECISIONS, 64) == DECISIONS[2]


def test_responses_take_the_first_decision_after_each_change_and_count_rounds() -> None:
    changes = [AppliedChange(32, 32.1, 10.0), AppliedChange(56, 128.0, 100.0)]
    down, back = responses(changes, DECISIONS, HISTORY)
    assert down.running == DECISIONS[0]
    assert down.decision == DECISIONS[1]
    assert down.rounds == pytest.approx((48 - 32) / 16)
    assert down.wall_s == pytest.approx(32 + 4 * 16)
    assert back.running == DECISIONS[1]
    assert back.decision == DECISIONS[2]
    assert back.rounds == pytest.approx((64 - 56) / 16)


def test_a_decision_at_the_change_or_after_the_next_change_is_not_its_answer() -> None:
    # made at the change's own step: measured before the link changed
    at = [Choice(4, "every-step", "none"), Choice(32, "local-sgd:8", "none")]
    (r,) = responses([AppliedChange(32, 32.0, 10.0)], at, HISTORY)
    assert r.decision is None and r.rounds is None and r.wall_s is None
    # the only decision came after the link was back: not the answer to the drop
    late = [Choice(4, "every-step", "none"), Choice(64, "local-sgd:8", "int8")]
    changes = [AppliedChange(16, 16.0, 10.0), AppliedChange(40, 64.0, 100.0)]
    down, back = responses(changes, late, HISTORY)
    assert down.decision is None
    assert back.decision == late[1]
    assert back.rounds == pytest.approx((64 - 40) / EVERY_STEP_OBSERVE)  # every-step ran


def _samples() -> list[Sample]:
    # 1 s and 0.5 s of compute per step until 32, then 4 s per step; counters move 1 MB/eval
    return [
        Sample(s, float(h["wall_s"]), 0.5 * s, 1_000_000 * s // 8, 500_000 * s // 8, 100.0)
        for s, h in ((int(h["step"]), h) for h in HISTORY)
    ]


def test_phases_split_the_run_at_the_changes() -> None:
    ph = phases(_samples(), [32, 48], [100.0, 10.0, 100.0])
    assert [(p.mbit, p.start_step, p.end_step) for p in ph] == [
        (100.0, 0, 32),
        (10.0, 32, 48),
        (100.0, 48, 64),
    ]
    assert ph[0].s_per_step == pytest.approx(1.0)
    assert ph[1].s_per_step == pytest.approx(4.0)
    assert ph[1].compute_per_step == pytest.approx(0.5)
    # a run that ended before the second change has no phase after it
    short = [s for s in _samples() if s.step <= 40]
    assert [p.end_step for p in phases(short, [32, 48], [100.0, 10.0, 100.0])] == [32, 40]
    assert phases([], [32], [100.0, 10.0]) == []
    with pytest.raises(ValueError, match="one rate per phase"):
        phases(_samples(), [32], [100.0])


def test_segment_rates_are_steps_and_uplink_megabits_per_second() -> None:
    rates = segment_rates(_samples())
    assert rates[0].wall_s == 16.0
    assert rates[0].steps_per_s == pytest.approx(1.0)
    assert rates[0].uplink_mbit == pytest.approx(1.0 * 8 / 8)  # 1 MB in 8 s, busier side
    assert rates[-1].steps_per_s == pytest.approx(0.25)
    assert [r.step for r in rates] == list(range(16, 65, 8))
    assert peak_uplink(rates, 0, 32) == pytest.approx(1.0)  # the segments ending at 16..32
    assert peak_uplink(rates, 32, 64) == pytest.approx(0.25)  # 1 MB in 32 s
    assert peak_uplink(rates, 64, 96) is None


def test_tc_rate_reads_what_tc_shows() -> None:
    line = "qdisc tbf 8001: root refcnt 2 rate 10Mbit burst 3200b lat 100ms"
    assert tc_rate(line) == "10Mbit"
    assert tc_rate("qdisc noqueue 0: root refcnt 2") is None


def _rep(changes: list[AppliedChange]) -> dict[str, object]:
    """A driver's JSON (what `_drive` returns)."""
    return {
        "wall_s": 160.0,
        "compute_s": 32.0,
        "final_loss": 1.5,
        "final_accuracy": 0.5,
        "history": HISTORY,
        "auto_decisions": [asdict(c) for c in DECISIONS],
        "changes": [asdict(c) for c in changes],
        "samples": [asdict(s) for s in _samples()],
        "uplink_bytes": {"a": 1_000_000, "b": 2_000_000},
    }


def _run(label: str, changes: list[AppliedChange]) -> Run:
    return Run.from_json(label, json.loads(json.dumps(_rep(changes))))  # as a driver's comes back


def test_the_table_shows_changes_answers_phases_and_quality() -> None:
    changes = [
        AppliedChange(32, 32.1, 10.0, "qdisc tbf 8001: root rate 10Mbit burst 3200b"),
        AppliedChange(56, 128.0, 100.0, "qdisc tbf 8001: root rate 100Mbit burst 12500b"),
    ]
    run = _run("changed", changes)
    assert run.changes == changes and run.decisions == DECISIONS
    md = table(run, _run("reference", []), "b", 100.0, 1_000_000, "CMD", "META")
    assert md.splitlines()[2] == "`CMD`"
    assert "| 32 | 32.1 | 10 | 10Mbit | local-sgd:16 / none | 48 | 96.0 | 1 |" in md
    assert "| 56 | 128.0 | 100 | 100Mbit | local-sgd:16 / int8 | 64 |" in md
    assert "| 32-56 | 10 | 4.000 |" in md
    assert "| changed | 1.5000 | 50.00 % | 160.0 | 3.0 |" in md
    assert "final accuracy +0.00 points" in md
    late = [AppliedChange(24, 24.0, 10.0), AppliedChange(40, 64.0, 100.0)]
    first_late = table(_run("x", late), None, "b", 100.0, 1, "C", "M")
    assert (
        "| 24 | 24.0 | 10 | - | local-sgd:16 / none | none before the next change |" in first_late
    )
    at_end = table(_run("x", [AppliedChange(64, 160.0, 10.0)]), None, "b", 100.0, 1, "C", "M")
    assert "none by the end" in at_end


def test_the_plot_is_written(tmp_path: Path) -> None:
    changes = [AppliedChange(32, 32.1, 10.0), AppliedChange(56, 128.0, 100.0)]
    path = tmp_path / "lc.png"
    plot(_run("changed", changes), _run("reference", []), "b", 100.0, "CMD", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_writes_the_report_and_plot_from_the_json(tmp_path: Path) -> None:
    changes = [AppliedChange(32, 32.1, 10.0, "rate 10Mbit"), AppliedChange(56, 128.0, 100.0)]
    doc = {
        "command": "CMD",
        "task": "builtin:gpt-stdlib",
        "params": 1_000_000,
        "steps": 64,
        "eval_every": 8,
        "seed": 0,
        "dc": "b",
        "mbit": 100.0,
        "low": 10.0,
        "down_at": 32,
        "up_at": 56,
        "runs": {"changed": _rep(changes), "reference": _rep([])},
    }
    md = render(json.loads(json.dumps(doc)), tmp_path / "lc")
    assert (tmp_path / "lc.md").read_text() == md
    assert md.splitlines()[2] == "`CMD`"
    assert "| b 100->10->100 Mbit/s |" in md and "| reference (no change) |" in md
    assert (tmp_path / "lc.png").stat().st_size > 0
