"""The built-in task table equals a fresh measurement of the real tasks."""

from __future__ import annotations

import pytest

from controller.values.tasks import (
    BUILTIN_ACTIVATION_BYTES,
    BUILTIN_WORK,
    check_task,
    measure_activation_bytes,
    measure_work,
)


@pytest.mark.parametrize("entry", sorted(BUILTIN_WORK))
def test_builtin_work_table_matches_measurement(entry: str) -> None:
    assert measure_work(entry) == BUILTIN_WORK[entry]


def test_builtin_table_lists_every_runtime_task() -> None:
    from training.tasks import BUILTIN

    assert set(BUILTIN_WORK) == {f"builtin:{name}" for name in BUILTIN}


def test_check_task_names_the_fix() -> None:
    check_task("builtin:mnist1d-mlp")
    check_task("no_such_module_xyz:main")  # text only: whether it imports is the workers' to see
    with pytest.raises(ValueError, match="unknown builtin"):
        check_task("builtin:nope")
    with pytest.raises(ValueError, match=r"module\.path:function"):
        check_task("pkg..mod:main")
    with pytest.raises(ValueError, match="dunder"):
        check_task("pkg.mod:__import__")


@pytest.mark.parametrize("entry", sorted(BUILTIN_ACTIVATION_BYTES))
def test_builtin_activation_table_matches_measurement(entry: str) -> None:
    assert measure_activation_bytes(entry) == BUILTIN_ACTIVATION_BYTES[entry]
    assert set(BUILTIN_ACTIVATION_BYTES) == set(BUILTIN_WORK)


@pytest.mark.parametrize("entry", sorted(BUILTIN_WORK))
def test_builtin_tensor_tables_match_the_models(entry: str) -> None:
    """A built-in task splits its layers exactly when its model says how, with the heads and
    blocks the tables give the planner."""
    import torch

    from controller.values.tasks import BUILTIN_TENSOR_BLOCKS, BUILTIN_TENSOR_HEADS
    from training.tasks import load_task

    torch.manual_seed(0)
    model = load_task(entry).model()
    blocks = [m for m in model.modules() if getattr(m, "tensor_plan", None)]
    if entry not in BUILTIN_TENSOR_HEADS:
        assert not blocks and entry not in BUILTIN_TENSOR_BLOCKS
        return
    assert len(blocks) == BUILTIN_TENSOR_BLOCKS[entry]
    assert {getattr(b, "heads", None) for b in blocks} == {BUILTIN_TENSOR_HEADS[entry]}
