"""Shared helpers: a single-process full-batch reference, and reading final parameters."""

from __future__ import annotations

import torch

from training.checkpoint import open_store
from training.data import batch_indices
from training.tasks import as_tensors, load_task


def full_batch_reference(
    task_name: str, steps: int, seed: int = 0, batch: int | None = None
) -> dict[str, torch.Tensor]:
    """Plain single-process training on each step's whole global batch."""
    task = load_task(task_name)
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer.build(model.parameters())
    x, y = as_tensors(task.train)
    b = batch or task.batch_size
    for step in range(steps):
        idx = batch_indices(len(x), b, seed, step)
        opt.zero_grad()
        task.loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_params(checkpoint_dir: str) -> tuple[int, dict[str, torch.Tensor]]:
    found = open_store(checkpoint_dir).latest()
    assert found is not None, "the run wrote no checkpoint"
    step, state = found
    return step, state["model"]
