"""What a job's task costs per step, for the planner: measured, not guessed, for built-ins."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class TaskWork:
    params: int
    flops_per_step: float
    batch_size: int


BUILTIN_WORK: dict[str, TaskWork] = {
    # Measured by `measure_work` (tests/controller/test_tasks.py re-measures and compares), so
    # quoting never waits for a data set to be generated.
    "builtin:mnist1d-mlp": TaskWork(params=23050, flops_per_step=16187392.0, batch_size=128),
    "builtin:mnist1d-cnn": TaskWork(params=9610, flops_per_step=76513280.0, batch_size=128),
    "builtin:digits-cnn": TaskWork(params=6090, flops_per_step=31162368.0, batch_size=64),
    "builtin:char-transformer": TaskWork(params=114400, flops_per_step=1283457024.0, batch_size=64),
}


def builtin_work(entry: str) -> TaskWork:
    """The work of a built-in task (measured once, kept in BUILTIN_WORK)."""
    work = BUILTIN_WORK.get(entry)
    return work if work is not None else measure_work(entry)


@lru_cache(maxsize=16)
def measure_work(entry: str) -> TaskWork:
    """Parameters and FLOPs of one training step (forward + backward of one global batch).

    Counted by torch's FlopCounterMode on the real model and a real batch, once per process.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from training.tasks import as_tensors, load_task

    task = load_task(entry)
    model = task.model()
    x, y = as_tensors(task.train)
    xb, yb = x[: task.batch_size], y[: task.batch_size]
    counter = FlopCounterMode(display=False)
    with counter:
        loss = task.loss(model(xb), yb)
        loss.backward()
    params = sum(p.numel() for p in model.parameters())
    flops = float(counter.get_total_flops()) or 6.0 * params * task.batch_size
    return TaskWork(params=params, flops_per_step=flops, batch_size=task.batch_size)


def check_task(entry: str) -> None:
    """ValueError naming the fix when the entrypoint cannot be used (never imports torch)."""
    import importlib.util

    kind, sep, name = entry.partition(":")
    if not sep or not kind or not name:
        raise ValueError(f"task {entry!r}: write builtin:NAME or module:function")
    if kind == "builtin":
        if entry not in BUILTIN_WORK:
            raise ValueError(
                f"task {entry!r}: unknown builtin; use one of {', '.join(sorted(BUILTIN_WORK))}"
            )
        return
    try:
        found = importlib.util.find_spec(kind)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"task {entry!r}: module {kind!r} is not importable on the control plane")
