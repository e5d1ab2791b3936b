"""`--sync auto --compression auto`: the pure policy (`training.auto`) and one emulated run."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from api.cli import app
from grammar import Sync, SyncKind, parse_compression, parse_sync
from training.auto import (
    LADDER,
    PERIODS,
    AutoPolicy,
    Decision,
    decide,
    exchange_time,
    lossiness,
    periodic_groups,
    runs_auto,
    streaming_form,
    streaming_hides,
    wan_bound_ratio,
)
from training.wan import Link

MBIT = 1e6
computes = st.floats(min_value=1e-3, max_value=2.0)
params_ = st.integers(min_value=1_000, max_value=50_000_000)
clusters_ = st.integers(min_value=2, max_value=8)
mbps_ = st.floats(min_value=1.0, max_value=10_000.0)


def quality_rank(d: Decision) -> tuple[int, ...]:
    """Where `d` stands in the policy's order (lower: less quality cost): every-step, then
    each group of `periodic_groups`, period by period: blocking, then streaming; last, the
    lightest exchange where nothing hides."""
    if d.sync.kind is SyncKind.EVERY_STEP:
        return (0,)
    if d.why.startswith("nothing hides"):  # the lightest level, blocking, last of all
        return (2,)
    groups = periodic_groups(LADDER, fixed=False)
    g = next(i for i, group in enumerate(groups) if d.compression in group)
    streams = d.sync.kind is SyncKind.STREAMING
    return (1, g, PERIODS.index(d.sync.period), int(streams), groups[g].index(d.compression))


@settings(max_examples=80, deadline=None)
@given(computes, params_, clusters_, mbps_, st.floats(min_value=1.0, max_value=100.0))
def test_more_bandwidth_never_picks_a_costlier_choice(
    compute: float, params: int, clusters: int, mbps: float, more: float
) -> None:
    slow = decide(compute, Link(mbps * MBIT, 0.01), params, clusters)
    fast = decide(compute, Link(mbps * more * MBIT, 0.01), params, clusters)
    assert quality_rank(fast) <= quality_rank(slow)


@settings(max_examples=80, deadline=None)
@given(computes, params_, clusters_, mbps_)
def test_the_exchange_hides_under_compute_whenever_anything_can(
    compute: float, params: int, clusters: int, mbps: float
) -> None:
    link = Link(mbps * MBIT, 0.01)
    d = decide(compute, link, params, clusters)
    lightest = exchange_time(LADDER[-1], params, clusters, link)
    if lightest <= 64 * compute:  # something hides: the decision does
        assert d.hides
        assert d.exchange_s <= d.sync.period * compute
    else:  # nothing does: the lightest exchange at the longest period
        assert (d.compression, d.sync.period) == (LADDER[-1], 64)
    if d.sync.kind is SyncKind.EVERY_STEP:
        assert d.exchange_s <= 0.1 * compute


def test_the_ladder_fp32_every_step_then_near_lossless_periods_then_lossy() -> None:
    p, n = 4_000_000, 3  # 16 MB of fp32 a step, a ring of 3 clusters
    assert decide(0.05, None, p, n).sync.kind is SyncKind.EVERY_STEP
    assert decide(0.05, Link(1e12, 0.0), p, n).compression == "none"
    # 100 Mbit/s: int8 (0.43 s) and int4 (0.22 s) are not cheap blocking over 32 steps
    # (0.16 s); int4 would be over 64 (0.32 s), but the period costs more quality than
    # streaming does: streaming at 32, int8's fragments (0.11 s) under their 7 steps (0.35 s)
    d = decide(0.05, Link(100 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("streaming:32:f4:d7", "int8")
    assert 0.1 * 32 * 0.05 < exchange_time("int4", p, n, Link(100 * MBIT, 0.0)) < 0.1 * 64 * 0.05
    # blocking at 64 where streaming at 32 does not hide: only under a looser overhead (at
    # 0.1, what blocks cheaply over 64 steps streams within its delays over 32); at 10 Mbit/s
    # int4 (2.2 s) outlasts 32 steps (1.6 s), not 64
    d = decide(0.05, Link(10 * MBIT, 0.0), p, n, overhead=1.0)
    assert (str(d.sync), d.compression) == ("local-sgd:64", "int4")
    # 60 Mbit/s: int4 (0.37 s) blocks cheaply at no period; int8's fragments (0.18 s) fit
    # their 7 steps: streaming at the near-lossless level before any lighter one
    d = decide(0.05, Link(60 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("streaming:32:f4:d7", "int8")
    d = decide(0.05, Link(20 * MBIT, 0.0), p, n)  # 5x less: int8's fragments no longer fit
    assert (str(d.sync), d.compression) == ("streaming:32:f4:d7", "int4") and d.hides
    d = decide(0.05, Link(2 * MBIT, 0.0), p, n)  # int4 hides at no period, int2 neither
    assert d.compression.startswith("topk") and d.hides
    assert "streaming" in d.why and "fragment exchange" in d.why
    # fp32 is never sent every H steps: int8 bought the same quality (NEAR_LOSSLESS)
    for mbps in (10_000, 1_000, 100, 20, 2):
        assert decide(0.05, Link(mbps * MBIT, 0.0), p, n).compression != "none"


def test_cheap_blocking_runs_exact_local_sgd_costly_blocking_streams() -> None:
    p, n = 4_000_000, 3
    # 10 Gbit/s: fp32 takes 17 ms, over 0.1 x a step: no every-step; int8 over 32 steps is
    # cheap blocking
    d = decide(0.05, Link(10_000 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("local-sgd:32", "int8") and d.hides
    assert "blocking exchange" in d.why
    # 400 Mbit/s: int8 takes 107 ms, under 0.1 x 32 steps (160 ms): still blocking
    d = decide(0.05, Link(400 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("local-sgd:32", "int8")
    # 200 Mbit/s: int8 takes 213 ms, int4 110 ms: blocking at int4 before streaming int8
    d = decide(0.05, Link(200 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("local-sgd:32", "int4")
    assert d.why.startswith("local-sgd:32 int4: blocking exchange 0.11s")
    # a slower step gives a longer blocking budget: at 100 Mbit/s int4 blocks cheaply under
    # 0.1 s steps (0.32 s a period), int8 under 0.15 s ones (0.48 s)
    d = decide(0.1, Link(100 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("local-sgd:32", "int4")
    d = decide(0.15, Link(100 * MBIT, 0.0), p, n)
    assert (str(d.sync), d.compression) == ("local-sgd:32", "int8")


def test_streaming_forms_are_the_grammars_defaults() -> None:
    for h in (*range(1, 17), 32, 64):
        s = streaming_form(h)
        assert s == parse_sync(f"streaming:{h}") == parse_sync(str(s)), h
    assert (streaming_form(2).fragments, streaming_form(2).delay) == (2, 0)
    # fragments outlasting their delay by more than 0.1 of the period's compute (F waits a
    # period) do not hide; within it they do; a link that cannot carry F of them a period
    # does not either
    assert not streaming_hides(4.0, 1.0, streaming_form(4), 1.0)
    s32 = streaming_form(32)  # 4 fragments, delay 7: each may come 0.8 s late (3.2 s a period)
    assert streaming_hides(30.0, 7.7, s32, 1.0) and not streaming_hides(31.0, 7.9, s32, 1.0)
    odd = Sync(SyncKind.STREAMING, period=8, fragments=2, delay=7)
    assert not streaming_hides(9.0, 4.5, odd, 1.0) and streaming_hides(8.0, 4.0, odd, 1.0)
    # a fragment pays the ring's whole latency: 3 clusters over 100 ms RTT, 0.2 s each
    # (periods up to 32: int4's 0.22 s would block cheaply over 64 steps)
    p, n, far = 4_000_000, 3, Link(1_000 * MBIT, 0.1)
    d = decide(0.05, far, p, n, max_period=32)
    assert d.sync.kind is SyncKind.STREAMING and d.hides
    whole, part = exchange_time(d.compression, p, n, far), d.fragment_s
    assert part > whole / d.sync.fragments and part == pytest.approx(
        exchange_time(d.compression, p // 4, n, far)
    )
    assert part <= d.sync.delay * 0.05


def test_a_fixed_local_sgd_stays_blocking_a_fixed_compression_may_stream() -> None:
    link = Link(1_000 * MBIT, 0.0)
    fixed = Sync(SyncKind.LOCAL_SGD, period=8)
    d = decide(0.05, link, 4_000_000, 3, fixed_sync=fixed)
    assert (d.sync, d.compression) == (fixed, "none") and d.hides  # 3.4 steps <= 8
    slower = Link(100 * MBIT, 0.0)  # int4 takes 4.4 steps: blocking H=8 is not cheap
    d = decide(0.05, Link(50 * MBIT, 0.0), 4_000_000, 3, fixed_compression="int4")
    assert d.sync.kind is SyncKind.STREAMING and d.compression == "int4" and d.hides
    d = decide(0.05, slower, 4_000_000, 3, fixed_sync=fixed)
    assert d.sync == fixed and d.compression == "int4"  # fp32 (34 steps), int8 (8.6) do not fit
    # nothing hides: the lightest exchange, blocking, at the longest period (as before)
    d = decide(0.05, Link(0.1 * MBIT, 0.0), 4_000_000, 3)
    assert (str(d.sync), d.compression) == ("local-sgd:64", LADDER[-1]) and not d.hides
    assert d.why.startswith("nothing hides")


@settings(max_examples=80, deadline=None)
@given(computes, params_, clusters_, mbps_)
def test_blocking_runs_only_where_it_is_cheap_else_streaming_hides(
    compute: float, params: int, clusters: int, mbps: float
) -> None:
    d = decide(compute, Link(mbps * MBIT, 0.01), params, clusters)
    h = d.sync.period
    if d.sync.kind is SyncKind.STREAMING:
        assert d.hides and d.exchange_s > 0.1 * h * compute
        assert d.exchange_s / d.sync.fragments <= d.fragment_s
        late = max(0.0, d.fragment_s - d.sync.delay * compute) * d.sync.fragments
        assert late <= 0.1 * h * compute + 1e-12
        assert d.sync == streaming_form(h)
    elif d.sync.kind is SyncKind.LOCAL_SGD and not d.why.startswith("nothing hides"):
        assert d.exchange_s <= 0.1 * h * compute


def test_fixed_values_are_kept() -> None:
    link = Link(10 * MBIT, 0.0)
    d = decide(0.05, link, 4_000_000, 3, fixed_compression="int4")
    assert d.compression == "int4" and d.sync.kind is SyncKind.STREAMING
    d = decide(0.05, link, 4_000_000, 3, fixed_sync=Sync(SyncKind.LOCAL_SGD, period=8))
    assert d.sync.period == 8 and lossiness(d.compression) > 0
    d = decide(0.05, link, 4_000_000, 3, fixed_sync=Sync(SyncKind.EVERY_STEP))
    assert d.sync.kind is SyncKind.EVERY_STEP and d.compression == LADDER[-1]

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
