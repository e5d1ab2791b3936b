"""`--sync auto --compression auto`: the runtime's side of `grammar.auto`'s policy
(`training.auto`), and one emulated run."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from api.cli import app
from grammar import Sync, SyncKind, parse_compression, parse_sync
from grammar.auto import SURVIVES_LOSS, adaptable, candidates, step_seconds
from grammar.quality import SLACK, quality_cost
from training.auto import (
    AutoPolicy,
    Decision,
    decide,
    exchange_parts,
    runs_auto,
    wan_bound_ratio,
)
from training.wan import Link

MBIT = 1e6
computes = st.floats(min_value=1e-3, max_value=2.0)
params_ = st.integers(min_value=1_000, max_value=50_000_000)
clusters_ = st.integers(min_value=2, max_value=8)
mbps_ = st.floats(min_value=1.0, max_value=10_000.0)


def q(d: Decision) -> float:
    return quality_cost(d.compression, d.sync)


def steps_of(
    compute: float, link: Link, params: int, clusters: int
) -> dict[tuple[str, str], float]:
    """Every switchable candidate's step, as `decide` times it."""
    out = {}
    for level, sync in candidates("auto", "auto", switchable=True):
        latency, transfer = exchange_parts(level, params, clusters, link)
        out[(level, sync)] = step_seconds(parse_sync(sync), compute, latency, transfer)
    return out


@settings(max_examples=80, deadline=None)
@given(computes, params_, clusters_, mbps_)
def test_the_least_lossy_candidate_within_the_slack_of_the_fastest(
    compute: float, params: int, clusters: int, mbps: float
) -> None:
    link = Link(mbps * MBIT, 0.01)
    d = decide(compute, link, params, clusters)
    steps = steps_of(compute, link, params, clusters)
    fastest = min(steps.values())
    assert d.step_s == pytest.approx(steps[(d.compression, str(d.sync))])
    if q(d) <= 0.5:  # an option over MAX_COST only where nothing else is possible
        assert d.step_s <= fastest * (1 + SLACK) + 1e-12
    for (level, sync), t in steps.items():
        if quality_cost(level, sync) < q(d) - 1e-9:
            assert t > fastest * (1 + SLACK), (level, sync)


@settings(max_examples=80, deadline=None)
@given(computes, params_, clusters_, mbps_, st.floats(min_value=1.0, max_value=100.0))
def test_more_bandwidth_never_picks_a_lossier_choice(
    compute: float, params: int, clusters: int, mbps: float, more: float
) -> None:
    """Up to half a point: at the edge of the slack the rule can trade blocking local SGD for
    streaming at the same period and compressor, whose cost is a few tenths of a point more
    (0.3 at most on 20,000 random regimes, found by hypothesis in a full run)."""
    slow = decide(compute, Link(mbps * MBIT, 0.0), params, clusters)
    fast = decide(compute, Link(mbps * more * MBIT, 0.0), params, clusters)
    assert q(fast) <= q(slow) + 0.005


def test_the_regimes_from_fp32_every_step_to_streaming_top_k() -> None:
    """4 M parameters (16 MB of fp32), a ring of 3 clusters, 50 ms of compute a step: the
    slower the link, the lossier the pick, each the least lossy that keeps the step within
    10 % of the fastest candidate's (which hides the WAN whole: streaming)."""
    p, n = 4_000_000, 3

    def pick(mbps: float, compute: float = 0.05) -> tuple[str, str]:
        d = decide(compute, Link(mbps * MBIT, 0.0), p, n)
        return str(d.sync), d.compression

    assert decide(0.05, None, p, n).sync.kind is SyncKind.EVERY_STEP
    assert pick(1e6) == ("every-step", "none")
    # 10 Gbit/s: fp32 (17 ms) is a third of a step, int8 (4 ms) under a tenth
    assert pick(10_000) == ("every-step", "int8")
    assert pick(1_000) == ("local-sgd:8", "int4")
    assert pick(400) == ("local-sgd:32", "int8")
    # from here streaming hides the exchange: near-lossless levels first, int8 before int4
    # and never fp32, which costs the same quality and four times the bytes
    for mbps in (200, 100, 60):
        assert pick(mbps) == ("streaming:32:f4:d7", "int8"), mbps
    assert pick(20) == ("streaming:32:f4:d7", "int4")
    assert pick(2) == ("streaming:32:f4:d7", "topk:0.02:m0:c4096:int2")
    # nothing hides: the fastest candidate
    assert pick(0.1) == ("streaming:64:f4:d15", "topk:0.02:m0:c4096:int2")
    # a slower step gives the exchange more to hide under: at 100 Mbit/s int4 blocks
    # cheaply over 8 steps of 0.5 s
    assert pick(100, compute=0.5) == ("local-sgd:8", "int4")


def test_streaming_waits_for_what_its_fragments_outlast() -> None:
    s32 = parse_sync("streaming:32")  # 4 fragments, delay 7
    # each fragment (the latency, a quarter of the transfer) has 7 steps of 1 s to arrive
    assert step_seconds(s32, 1.0, 0.0, 28.0) == 1.0
    assert step_seconds(s32, 1.0, 0.0, 32.0) == pytest.approx(1.0 + 4 * 1.0 / 32)
    assert step_seconds(s32, 1.0, 0.0, 64.0) == pytest.approx(1.0 + 4 * 9.0 / 32)
    # a link that cannot carry the period's fragments in its compute sets the pace (where
    # the delays are long enough to hide each one alone)
    late = parse_sync("streaming:8:f2:d7")
    assert step_seconds(late, 1.0, 0.0, 8.0) == 1.0
    assert step_seconds(late, 1.0, 0.0, 12.0 * 2) == pytest.approx(3.0)
    # a fragment pays the ring's whole latency
    assert step_seconds(s32, 1.0, 7.5, 0.0) == pytest.approx(1.0 + 4 * 0.5 / 32)
    assert step_seconds(parse_sync("local-sgd:8"), 1.0, 1.0, 7.0) == 2.0
    assert step_seconds(parse_sync("every-step"), 1.0, 1.0, 7.0) == 9.0
    # stale: a step hides one whole exchange (one in flight at a time), whatever its staleness
    assert step_seconds(parse_sync("stale:1"), 1.0, 1.0, 7.0) == 8.0
    assert step_seconds(parse_sync("stale:4"), 1.0, 1.0, 7.0) == 8.0
    assert step_seconds(parse_sync("stale:1"), 9.0, 1.0, 7.0) == 9.0


def test_fixed_values_are_kept() -> None:
    link = Link(10 * MBIT, 0.0)
    d = decide(0.05, link, 4_000_000, 3, fixed_compression="int4")
    assert d.compression == "int4" and d.sync.kind is SyncKind.STREAMING
    fixed = Sync(SyncKind.LOCAL_SGD, period=8)
    d = decide(0.05, link, 4_000_000, 3, fixed_sync=fixed)
    assert d.sync == fixed and d.compression != "none"
    d = decide(0.05, Link(2_000 * MBIT, 0.0), 4_000_000, 3, fixed_sync=fixed)
    assert (d.sync, d.compression) == (fixed, "int8")  # as lossless as fp32, lighter
    d = decide(0.05, link, 4_000_000, 3, fixed_sync=Sync(SyncKind.EVERY_STEP))
    assert d.sync.kind is SyncKind.EVERY_STEP and d.compression not in ("none", "bf16")
    # a compressor with a momentum correction is not switched to mid-run
    assert parse_compression(d.compression).kind.value != "topk" or (
        parse_compression(d.compression).momentum == 0.0
    )

    def auto(sync: str, compression: str) -> Sync | None:
        return runs_auto(parse_sync(sync), parse_compression(compression))

    assert auto("auto", "none") == Sync(SyncKind.AUTO)
    assert auto("local-sgd:8", "auto") == Sync(SyncKind.AUTO)
    assert auto("adaptive", "auto") is None and auto("every-step", "int8") is None


def test_policy_redecides_only_after_a_lasting_change() -> None:
    policy = AutoPolicy(params=4_000_000, clusters=3, factor=2.0, patience=2)
    first = policy.observe(4, 0.05, Link(100 * MBIT, 0.0))
    assert first is not None and (str(first.sync), first.compression) == (
        "streaming:32:f4:d7",
        "int8",
    )
    for step, mbps in ((8, 70.0), (12, 140.0), (16, 9.0), (20, 100.0)):  # noise, one blip
        assert policy.observe(step, 0.05, Link(mbps * MBIT, 0.0)) is None
    assert policy.observe(24, 0.05, Link(20 * MBIT, 0.0)) is None  # 1st round out of band
    new = policy.observe(28, 0.05, Link(20 * MBIT, 0.0))  # 2nd: re-decided
    assert new is not None and new.sync.kind is SyncKind.STREAMING and new.compression == "int4"
    assert [s for s, _ in policy.history] == [4, 28]


def test_a_planned_start_runs_the_plan_until_its_link_moves() -> None:
    """A control-plane run starts on its plan's pair and re-decides only when the link leaves
    the plan's for `patience` rounds; a change of compute alone does not re-decide (the link
    is what the plan may not have known; its compute is the calibration's)."""
    policy = AutoPolicy(params=4_000_000, clusters=3, watch_compute=False, kinds=SURVIVES_LOSS)
    policy.start(parse_sync("local-sgd:8"), "int8", Link(100 * MBIT, 0.0))
    assert policy.current is not None and policy.history == []
    for step, compute in ((8, 0.05), (16, 0.5), (24, 0.5), (32, 0.01)):
        assert policy.observe(step, compute, Link(100 * MBIT, 0.0)) is None
    assert policy.observe(40, 0.05, Link(2 * MBIT, 0.0)) is None  # 1st round out of band
    new = policy.observe(48, 0.05, Link(2 * MBIT, 0.0))
    assert new is not None and (str(new.sync), new.compression) != ("local-sgd:8", "int8")
    assert new.sync.kind in SURVIVES_LOSS  # a run that shrinks in place keeps doing so
    assert policy.history == [(48, new)]
    assert "2 Mbit/s" in new.why


def test_a_planned_start_without_a_link_table_anchors_on_its_first_measurement() -> None:
    policy = AutoPolicy(params=4_000_000, clusters=2, watch_compute=False)
    policy.start(parse_sync("every-step"), "none", None)
    assert policy.observe(8, 0.05, Link(3 * MBIT, 0.0)) is None  # the anchor, whatever it is
    assert policy.observe(16, 0.05, Link(2 * MBIT, 0.0)) is None  # within the factor
    assert policy.observe(24, 0.05, Link(1 * MBIT, 0.0)) is None
    assert policy.observe(32, 0.05, Link(1 * MBIT, 0.0)) is not None


@pytest.mark.parametrize(
    ("compression", "sync", "planned", "left"),
    [
        ("auto", "auto", ("int8", "local-sgd:8"), ("sync", "compression")),
        ("int8", "auto", ("int8", "local-sgd:8"), ("sync",)),
        ("auto", "local-sgd:8", ("int4", "local-sgd:8"), ("compression",)),
        ("auto", "auto", ("none", "every-step"), ("sync", "compression")),
        ("auto", "auto", ("int8", "partial:16"), ()),  # the runtime cannot leave partial
        ("auto", "auto", ("topk:0.01", "every-step"), ()),  # nor a momentum correction
        ("none", "every-step", ("none", "every-step"), ()),  # nothing left to auto
    ],
)
def test_what_a_plan_leaves_the_runtime_to_re_decide(
    compression: str, sync: str, planned: tuple[str, str], left: tuple[str, ...]
) -> None:
    assert adaptable(compression, sync, *planned) == left


def test_adapt_is_refused_from_a_mode_the_runtime_cannot_leave() -> None:
    from training import TrainSpec

    with pytest.raises(ValueError, match="adapt: the runtime cannot re-decide from sync"):
        TrainSpec(sync="partial:16", compression="int8", adapt=("sync",)).validate()
    with pytest.raises(ValueError, match="adapt: \\['ring'\\]"):
        TrainSpec(sync="local-sgd:8", compression="int8", adapt=("ring",)).validate()
    TrainSpec(sync="local-sgd:8", compression="int8", adapt=("sync", "compression")).validate()


def test_regime_is_fp32_exchange_over_compute() -> None:
    # 4 M parameters = 128 Mbit of fp32; 1.28 s at 100 Mbit/s over 0.1 s of compute
    assert wan_bound_ratio(4_000_000, 0.1, 100.0) == pytest.approx(12.8)


def _train(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["train", *args])
    return result.exit_code, result.stdout, result.stderr


def test_compression_auto_needs_a_sync_it_can_pick_under() -> None:
    code, _, err = _train("--sync", "stale:1", "--compression", "auto")
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--compression" in lines[0], err


@pytest.mark.usefixtures("ray_session")
def test_cpn_train_auto_on_the_emulated_wan_reports_its_decision() -> None:
    code, out, err = _train(
        "--clusters",
        "a:1,b:1",
        "--sync",
        "auto",
        "--compression",
        "auto",
        "--steps",
        "12",
        "--link-mbps",
        "0.2",
        "--rtt-ms",
        "1",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["sync"] == "auto" and report["compression"] == "auto"
    first = report["auto_decisions"][0]
    assert first["step"] == 4 and first["why"]
    # 23 K parameters = 0.74 Mbit of fp32: 3.7 s at 0.2 Mbit/s, more than 64 steps of this
    # model's compute (under 58 ms a step on any machine this runs on), so neither every-step
    # nor fp32; whether streaming or blocking runs depends on the measured compute
    kind = parse_sync(first["sync"]).kind
    assert kind in (SyncKind.STREAMING, SyncKind.LOCAL_SGD) and first["compression"] != "none"
    assert report["final_accuracy"] == report["final_accuracy"]  # a number, not NaN
    assert report["wan_bytes_total"] > 0


def test_cpn_train_shows_what_streaming_did_not_hide() -> None:
    """No delay: every fragment is applied at the step it left, so each one is waited for
    (2 fragments every 4 steps, 8 steps: 4 late), and the table says so."""
    code, out, err = _train(
        *("--clusters", "a:1,b:1", "--sync", "streaming:4:f2:d0", "--compression", "int8"),
        *("--steps", "8", "--link-mbps", "1", "--rtt-ms", "1"),
    )
    assert code == 0, err
    rows = {
        cells[0]: cells[1]
        for line in out.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 2
    }
    assert rows["sync: late_fragments"] == "4", out
    assert float(rows["sync: late_wait_s"]) > 0 and float(rows["sync: drain_s"]) > 0, out
