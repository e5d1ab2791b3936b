"""The WAN-bound built-ins: a few million parameters each, one forward/backward as a smoke
test (their training runs belong to the benchmarks, not the suite)."""

from __future__ import annotations

import pytest
import torch

from controller.values.tasks import BUILTIN_WORK
from training.tasks import as_tensors, load_task
from training.tasks.wan import wan_regime


@pytest.mark.parametrize("entry", ["builtin:gpt-stdlib", "builtin:wide-mlp"])
def test_a_few_million_parameters_and_one_step(entry: str) -> None:
    task = load_task(entry)
    torch.manual_seed(0)
    model = task.model()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 4_000_000 <= params <= 6_000_000
    assert BUILTIN_WORK[entry].params == params
    x, y = as_tensors(task.train)
    loss = task.loss(model(x[:2]), y[:2])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    # the regime from a given compute time: fp32 bytes at the link rate over compute
    assert wan_regime(task, 100.0, compute_s=0.01) == pytest.approx(params * 32 / 1e8 / 0.01)
