"""The arithmetic of bench.peers (regime, extrapolation, WAN-hidden ratio, the table): no
testbed, no peers installed."""

from __future__ import annotations

import pytest

from bench.peers import (
    extrapolate,
    hidden_ratio,
    hivemind_averaging_timeout,
    hivemind_finished,
    kept_notes,
    regime,
    steps_to,
    table,
    time_to,
)
from bench.wan import ddp_bucket_cap_mb

HISTORY = [
    {"step": 10, "wall_s": 1.0, "accuracy": 0.2},
    {"step": 20, "wall_s": 2.0, "accuracy": 0.4},
    {"step": 30, "wall_s": 3.0, "accuracy": 0.5},
]


def test_regime_is_fp32_exchange_over_compute() -> None:
    # 1 M parameters = 32 Mbit of fp32: 1.28 s at 25 Mbit/s, over 0.1 s of compute
    assert regime(1_000_000, 0.1, 25.0) == pytest.approx(12.8)
    assert regime(1_000_000, 0.1, 100.0) == pytest.approx(3.2)


def test_time_and_steps_to_target() -> None:
    assert time_to(HISTORY, 0.4) == 2.0
    assert steps_to(HISTORY, 0.45) == 30
    assert time_to(HISTORY, 0.9) is None
    assert steps_to(HISTORY, 0.9) is None


def test_extrapolation_scales_the_unshaped_run_by_the_shaped_step_time() -> None:
    probe = {"peer": "(a)", "kind": "ddp", "steps": 5, "wall_s": 50.0, "compute_s": 0.5,
             "uplink_bytes_total": 5_000, "history": []}  # fmt: skip
    unshaped = {"steps": 30, "wall_s": 3.0, "final_accuracy": 0.5, "history": HISTORY}
    r = extrapolate(probe, unshaped, 30, 0.4)
    assert r["extrapolated"] and r["probe_steps"] == 5
    assert r["step_s"] == 10.0
    assert r["ttt"] == 200.0  # 20 steps to target x 10 s
    assert r["wall_s"] == 300.0
    assert r["uplink_bytes_total"] == 30_000
    assert r["final_accuracy"] == 0.5
    assert [h["wall_s"] for h in r["history"]] == [100.0, 200.0, 300.0]
    assert hidden_ratio(unshaped, r) == pytest.approx(0.01)


def test_hidden_ratio_per_step_and_missing() -> None:
    assert hidden_ratio({"wall_s": 9.0, "steps": 30}, {"wall_s": 10.0, "steps": 30}) == 0.9
    assert hidden_ratio(None, {"wall_s": 10.0, "steps": 30}) is None


def test_table_marks_extrapolated_failed_and_dropped_syncs() -> None:
    rows = [
        {"peer": "(a) DDP", "kind": "ddp", "extrapolated": True, "probe_steps": 5, "ttt": 200.0,
         "final_accuracy": 0.5, "wall_s": 300.0, "uplink_bytes_total": 30_000_000,
         "regime": 40.0, "hidden": 0.01, "history": [{"step": 9, "eval_loss": 2.0}]},
        {"peer": "(c) torchft", "kind": "torchft", "ttt": 20.0, "final_accuracy": 0.5,
         "wall_s": 30.0, "uplink_bytes_total": 3_000_000, "regime": 40.0, "hidden": 0.5,
         "outer_syncs": [2, 3]},
        {"peer": "(e) cpn", "kind": "cpn", "ttt": 10.0, "final_accuracy": 0.5, "wall_s": 15.0,
         "uplink_bytes_total": 300_000, "regime": 40.0, "hidden": 0.96,
         "history": [{"step": 5, "eval_loss": 3.0}, {"step": 9, "eval_loss": 2.03}]},
        {"peer": "(d) hivemind", "kind": "hivemind", "error": "boom",
         "final_accuracy": float("nan"),
         "uplink_bytes_total": 0, "wall_s": None},
    ]  # fmt: skip
    md = table(rows, 25.0, 0.4, "the command", "meta.")
    assert md.splitlines()[2] == "`the command`"
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in md.splitlines() if ln.startswith("|")}
    assert "extrapolated (5 shaped steps" in lines["(a) DDP"]
    assert "2/3 (dropped!)" in lines["(c) torchft"]
    cpn = lines["(e) cpn"].split(" | ")
    assert cpn[5] == "2.0300 (+1.5 %)"  # the last evaluation's loss, against (a)'s
    assert lines["(a) DDP"].split(" | ")[5] == "2.0000"
    assert lines["(c) torchft"].split(" | ")[5] == "-"  # measured before losses were kept
    assert cpn[8] == "100.0x"  # bytes vs (a)
    assert cpn[9] == "20.0x"  # time vs (a)
    assert cpn[10] == "2.0x"  # time vs best torchft
    assert "FAILED: boom" in lines["(d) hivemind"]


def test_hivemind_round_wait_is_bounded_by_the_link_not_the_run() -> None:
    # 1 M parameters, 3 peers: each sends 2*2/3 of 32 Mbit = 21.3 Mbit; at 25 Mbit/s 0.853 s
    assert hivemind_averaging_timeout(1_000_000, 25.0, 3, 2.0) == pytest.approx(
        2.0 + 4 * 2 * 2 / 3 * 32 / 25 + 30.0
    )
    # a slower link waits longer; unknown rate: hivemind's own default
    assert hivemind_averaging_timeout(1_000_000, 5.0, 3, 2.0) > hivemind_averaging_timeout(
        1_000_000, 25.0, 3, 2.0
    )
    assert hivemind_averaging_timeout(1_000_000, None, 3, 2.0) == 60.0


def test_hivemind_run_ends_at_the_epoch_of_the_run_not_a_peers_step_count() -> None:
    # 320 steps at H=32: the collaboration's 10th epoch ends every peer's run
    assert not hivemind_finished(9, 32, 320)
    assert hivemind_finished(10, 32, 320)
    assert hivemind_finished(11, 32, 320)


def test_powersgd_gets_one_bucket_other_hooks_ddp_default() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    cap = ddp_bucket_cap_mb("powersgd:4", model)
    assert cap is not None and cap * 2**20 > nbytes  # every gradient fits one bucket
    assert ddp_bucket_cap_mb("none", model) is None
    assert ddp_bucket_cap_mb("fp16", model) is None


def test_merged_replaces_rerun_rows_and_keeps_peers_order() -> None:
    from bench.peers import PEERS, merged

    old = [{"peer": q.name, "wall_s": 1.0} for q in PEERS]
    new = [
        {"peer": "(e) cpn auto", "wall_s": 2.0},
        {"peer": "(a) DDP flat gloo fp32", "wall_s": 3.0},
    ]
    rows = merged(old, new)
    assert [r["peer"] for r in rows] == [q.name for q in PEERS]
    walls = {r["peer"]: r["wall_s"] for r in rows}
    assert walls["(e) cpn auto"] == 2.0 and walls["(a) DDP flat gloo fp32"] == 3.0
    assert walls["(e) cpn DiLoCo int8"] == 1.0


def test_a_rewrite_keeps_the_run_notes_below_the_table() -> None:
    old = "# table\n\n| a | b |\n\n- auto note\n\nRun notes, today:\n- x\n\nRun notes, older\n"
    assert kept_notes(old) == "Run notes, today:\n- x\n\nRun notes, older\n"
    assert kept_notes("# table\n| a |\n- Run notes inside a bullet\n") == ""
