"""SCAFFOLD's drift correction (`training.sync.drift`) on the problem it is built for: clients
whose local optima differ pull a plain local-SGD average off the global optimum; with the
correction, the average converges to it. Pure arithmetic, no processes."""

from __future__ import annotations

import torch

from training.sync.drift import DriftCorrection, move

CURVATURES = (1.0, 4.0, 0.5)
OPTIMA = (1.0, -2.0, 3.0)
OPTIMUM = sum(h * a for h, a in zip(CURVATURES, OPTIMA, strict=True)) / sum(CURVATURES)


def _local_sgd(corrected: bool, rounds: int = 300, period: int = 10, lr: float = 0.1) -> float:
    """Three clients, f_i(w) = h_i (w - a_i)^2 / 2, `period` exact gradient steps a round,
    then the plain average of the pseudo-gradients (equal shares)."""
    anchor = torch.zeros(1)
    drifts = [DriftCorrection(1) for _ in CURVATURES]
    for _ in range(rounds):
        own = []
        for h, a, drift in zip(CURVATURES, OPTIMA, drifts, strict=True):
            w = anchor.clone()
            for _ in range(period):
                w -= lr * h * (w - a)
                if corrected:
                    move([w], drift.correction)
                    drift.step()
            own.append(anchor - w)
        total = sum(own, torch.zeros(1)) / len(own)
        if corrected:
            for drift, mine in zip(drifts, own, strict=True):
                drift.round(mine, total, drift.steps)
                drift.steps = 0
        anchor = anchor - total
    return float(anchor)


def test_the_correction_takes_local_sgd_to_the_global_optimum() -> None:
    plain, corrected = _local_sgd(False), _local_sgd(True)
    assert abs(plain - OPTIMUM) > 0.5  # plain local SGD settles elsewhere
    assert abs(corrected - OPTIMUM) < 1e-4


def test_the_corrections_sum_to_zero_so_the_average_update_is_unchanged() -> None:
    gen = torch.Generator().manual_seed(0)
    drifts = [DriftCorrection(5) for _ in range(3)]
    shares = (0.5, 0.3, 0.2)
    own = [torch.randn(5, generator=gen) for _ in drifts]
    total = sum((s * d for s, d in zip(shares, own, strict=True)), torch.zeros(5))
    for drift, mine in zip(drifts, own, strict=True):
        drift.round(mine, total, 4)
    weighted = sum((s * d.correction for s, d in zip(shares, drifts, strict=True)), torch.zeros(5))
    torch.testing.assert_close(weighted, torch.zeros(5))


def test_a_member_seated_late_corrects_nothing_until_its_first_round() -> None:
    drift = DriftCorrection(3)
    drift.seat(torch.ones(3), 4)
    torch.testing.assert_close(drift.consensus, torch.full((3,), 0.25))
    assert not drift.correction.any()
    state = drift.state()
    other = DriftCorrection(3)
    other.load(state, own=False)
    assert not other.correction.any() and other.steps == 0
