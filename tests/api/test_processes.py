"""`wait_until`, the one way the demo, benchmarks and tests wait on real processes."""

from __future__ import annotations

import itertools

import pytest

from api.processes import wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "ready", 5, "the third call", every=0) == "ready"
    assert next(calls) == 4  # polled until it held, not once more


def test_wait_until_names_what_it_waited_for_and_the_last_value() -> None:
    with pytest.raises(TimeoutError, match=r"waiting for the moon \(last: \[\]\)"):
        wait_until(lambda: [], 0.05, "the moon", every=0.01)
