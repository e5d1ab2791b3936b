"""Shared helpers: a single-process full-batch reference (its state, or its losses and
parameters), and reading final parameters."""

from __future__ import annotations

from typing import Any

import torch

from training.checkpoint import open_store
from training.data import batch_indices
from training.tasks import as_tensors, load_task


def _train(task_name: str, steps: int, seed: int, batch: int | None) -> tuple[Any, list[float]]:
    """Plain single-process training on each step's whole global batch: the model, the
    losses."""
    task = load_task(task_name)
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer.build(model.parameters())
    x, y = as_tensors(task.train)
    b = batch or task.batch_size
    losses = []
    for step in range(steps):
        idx = batch_indices(len(x), b, seed, step)
        opt.zero_grad()
        loss = task.loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def full_batch_reference(
    task_name: str, steps: int, seed: int = 0, batch: int | None = None
) -> dict[str, torch.Tensor]:
    """Plain single-process training on each step's whole global batch: its state."""
    model, _ = _train(task_name, steps, seed, batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_run(
    task_name: str, steps: int, batch: int, seed: int = 0
) -> tuple[list[float], list[torch.Tensor]]:
    """The same training's losses, step by step, and its parameters in model order."""
    model, losses = _train(task_name, steps, seed, batch)
    return losses, [q.detach().clone() for q in model.parameters()]


def final_params(checkpoint_dir: str) -> tuple[int, dict[str, torch.Tensor]]:
    found = open_store(checkpoint_dir).latest()
    assert found is not None, "the run wrote no checkpoint"
    step, state = found
    return step, state["model"]
