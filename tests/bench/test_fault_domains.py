"""bench.fault_domains' own arithmetic (the runs themselves are the bench's)."""

from __future__ import annotations

from typing import Any

from bench.fault_domains import _met, _time_to


def test_time_to_target_is_the_first_evaluation_reaching_it() -> None:
    history: list[dict[str, Any]] = [
        {"wall_s": 1.0, "accuracy": None},
        {"wall_s": 2.0, "accuracy": 0.3},
        {"wall_s": 3.0, "accuracy": 0.5},
        {"wall_s": 4.0, "accuracy": 0.6},
    ]
    assert _time_to(history, 0.45) == 3.0
    assert _time_to(history, 0.9) is None
    assert _met(True) == "met" and _met(False) == "not met"
