"""A worker loads a `module:function` task and refuses anything but a function returning a
`Task`, with an error that says what to return (the job then fails without retries)."""

from __future__ import annotations

import pytest

from training.tasks import Task, load_task


def test_a_builtin_loads() -> None:
    assert isinstance(load_task("builtin:digits-cnn"), Task)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("tests.e2e.entry_tasks:not_a_task", "returned int, not training.tasks.Task"),
        ("tests.e2e.entry_tasks:NOT_A_FUNCTION", "is not a function \\(it is int\\)"),
        ("tests.e2e.entry_tasks:missing", "cannot be loaded"),
        ("tests.e2e.no_such_module:main", "cannot be loaded: No module named"),
    ],
)
def test_anything_but_a_task_fails_with_what_to_return(entry: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        load_task(entry)
