"""int8 quantization: stochastic rounding is unbiased (a statistical test with a control that
it rejects biased rounding); min-max spans the range with 256 levels."""

from __future__ import annotations

import math

import torch

from training.compression import make_compressor
from training.compression.int8 import StochasticInt8

TRIALS, SIZE, BINS = 400, 2000, 10
# Each bin's statistic is N(0, 1) under "unbiased" (CLT over ~80k independent Bernoulli
# draws). |z| < 4.5 per bin, Bonferroni over 10 bins: false alarm probability < 1e-4.
Z_LIMIT = 4.5


def _bin_z_scores(x: torch.Tensor, scale: float, round_ups: torch.Tensor) -> list[float]:
    """z-score per bin of fractional part: observed round-ups vs TRIALS * frac expected."""
    levels = x / scale
    frac = (levels - torch.floor(levels)).double()
    scores = []
    for b in range(BINS):
        members = (frac >= b / BINS) & (frac < (b + 1) / BINS)
        p = frac[members]
        expected = TRIALS * p.sum()
        variance = TRIALS * (p * (1 - p)).sum()
        scores.append(float((round_ups[members].sum() - expected) / math.sqrt(variance)))
    return scores


def _draw(x: torch.Tensor) -> tuple[float, torch.Tensor]:
    compressor = StochasticInt8(seed=2024, error_feedback=False)
    scale = 0.0
    round_ups = torch.zeros(SIZE, dtype=torch.float64)
    for trial in range(TRIALS):
        packet = compressor.compress(f"t{trial}", x)
        scale = float(packet.tensors["s"])
        floor = torch.floor(x / packet.tensors["s"])
        ups = packet.tensors["q"].double() - floor.double()
        assert ((ups == 0) | (ups == 1)).all()  # rounds to one of the two nearest levels
        round_ups += ups
    return scale, round_ups


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.randn(SIZE, generator=torch.Generator().manual_seed(11))
    scale, round_ups = _draw(x)
    scores = _bin_z_scores(x, scale, round_ups)
    assert max(abs(z) for z in scores) < Z_LIMIT, scores
    # and the decoded mean is within 5 standard errors of x overall
    compressor = StochasticInt8(seed=5, error_feedback=False)
    mean = torch.zeros(SIZE)
    for i in range(TRIALS):
        mean += compressor.decompress(compressor.compress(f"k{i}", x)) / TRIALS
    levels = x / scale
    frac = levels - torch.floor(levels)
    standard_error = math.sqrt(float((frac * (1 - frac)).sum()) * scale**2 / TRIALS)
    assert abs(float((mean - x).sum())) < 5 * standard_error


def test_the_statistic_rejects_round_to_nearest() -> None:
    """Control: deterministic rounding (biased per element) fails the same test."""
    x = torch.randn(SIZE, generator=torch.Generator().manual_seed(11))
    scale = float(x.abs().max() / 127)
    levels = x / scale
    round_ups = (torch.round(levels) - torch.floor(levels)).double() * TRIALS
    assert max(abs(z) for z in _bin_z_scores(x, scale, round_ups)) > Z_LIMIT


def test_stochastic_int8_uses_the_full_symmetric_range() -> None:
    x = torch.tensor([-3.0, 0.0, 1.5, 3.0])
    packet = make_compressor("int8").compress("w", x)
    assert packet.tensors["q"].dtype == torch.int8
    assert packet.tensors["q"][0] == -127 and packet.tensors["q"][3] == 127


def test_minmax_maps_min_and_max_exactly_and_errs_by_at_most_half_a_step() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 4 + 1
    compressor = make_compressor("int8:minmax")
    packet = compressor.compress("w", x)
    assert packet.tensors["q"].dtype == torch.uint8
    assert int(packet.tensors["q"].min()) == 0 and int(packet.tensors["q"].max()) == 255
    step = float(x.max() - x.min()) / 255
    assert float((compressor.decompress(packet) - x).abs().max()) <= step / 2 + 1e-5


def test_constant_and_zero_tensors() -> None:
    for spec in ("int8", "int8:minmax"):
        compressor = make_compressor(spec)
        for value in (0.0, 2.5):
            x = torch.full((10,), value)
            torch.testing.assert_close(
                compressor.decompress(compressor.compress(spec, x))
                + compressor.state_dict()["residuals"][spec],
                x,
            )
            compressor.load_state_dict({})
