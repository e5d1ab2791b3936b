"""What a job's task costs per step, for the planner: measured, not guessed, for built-ins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from wire.spec import JobSpec


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
    "builtin:char-gpt": TaskWork(params=114528, flops_per_step=1283457024.0, batch_size=64),
    # the WAN-bound regime (training.tasks.wan): millions of parameters, little compute a step
    "builtin:gpt-stdlib": TaskWork(params=5559392, flops_per_step=7304380416.0, batch_size=6),
    "builtin:wide-mlp": TaskWork(params=4300810, flops_per_step=1639448576.0, batch_size=64),
}


BUILTIN_ACTIVATION_BYTES: dict[str, int] = {
    # Measured by `measure_activation_bytes` (tests/controller/test_tasks.py re-measures).
    "builtin:char-gpt": 8192,
    "builtin:char-transformer": 8192,
    "builtin:digits-cnn": 4096,
    "builtin:gpt-stdlib": 65536,
    "builtin:mnist1d-cnn": 5120,
    "builtin:mnist1d-mlp": 512,
    "builtin:wide-mlp": 8192,
}
"""Bytes one sample's activations take crossing a pipeline stage boundary: the largest output
of any piece but the last (wherever the cuts fall, no boundary carries more), for the
pipeline estimate of a stored plan (`controller.values.plan.pipeline_estimate`)."""


BUILTIN_TENSOR_HEADS: dict[str, int] = {"builtin:char-gpt": 4}
"""Built-in tasks whose model splits its layers over GPUs (tensor parallelism), with the
attention heads a split must divide (`tests/controller/test_tasks.py` reads the models)."""

BUILTIN_TENSOR_BLOCKS: dict[str, int] = {"builtin:char-gpt": 2}
"""Their blocks: each costs a tensor-parallel run four all-reduces of its activations a
micro-batch (`scheduler.pipeline_cost.tensor_collective_s`)."""


@dataclass(frozen=True)
class LayerFacts:
    """What the planner knows of a task's layers beyond its parameters and FLOPs (0: not known)."""

    blocks: int
    """Layers a tensor split divides (transformer blocks)."""
    heads: int
    """Their attention heads: a split's width must divide them."""
    activation_bytes: int
    """A sample's largest activations at a layer boundary: what a stage sends on, what a
    split all-reduces."""


def layer_facts(spec: JobSpec) -> LayerFacts:
    """A job's layer facts: what its `work` declares when it declares work (a task of the
    tenant's own, or a built-in standing in for a larger model), else the built-in's own. A
    built-in's heads are always its model's: the runtime splits that model."""
    heads = BUILTIN_TENSOR_HEADS.get(spec.task, 0)
    if spec.work is None:
        blocks = BUILTIN_TENSOR_BLOCKS.get(spec.task, 0)
        return LayerFacts(blocks, heads, BUILTIN_ACTIVATION_BYTES.get(spec.task, 0))
    w = spec.work
    if not spec.task.startswith("builtin:"):
        heads = w.heads or 0
    return LayerFacts(w.blocks or 0, heads, w.activation_bytes or 0)


def measure_activation_bytes(entry: str) -> int:
    """`BUILTIN_ACTIVATION_BYTES` of a task, from its real pieces and one real sample."""
    import torch

    from training.stages import pieces, profile_pieces
    from training.tasks import load_task

    task = load_task(entry)
    torch.manual_seed(0)
    parts = pieces(task.model())
    x, _ = task.train  # type: ignore[misc]
    prof = profile_pieces(parts, x[:1])
    return max((int(p.activation_bytes) for p in prof[:-1]), default=0)


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
    """ValueError naming the fix when the entrypoint is malformed or an unknown builtin.

    Never imports anything: a module named by a tenant is imported by workers only, so its
    import-time code never runs inside the control plane (see `check_allowed`)."""
    kind, sep, name = entry.partition(":")
    if not sep or not kind or not name:
        raise ValueError(f"task {entry!r}: write builtin:NAME or module:function")
    if kind == "builtin":
        if entry not in BUILTIN_WORK:
            raise ValueError(
                f"task {entry!r}: unknown builtin; use one of {', '.join(sorted(BUILTIN_WORK))}"
            )
        return
    if not is_module_path(kind) or not name.isidentifier() or name.startswith("__"):
        raise ValueError(
            f"task {entry!r}: write module.path:function (Python names; no dunder function)"
        )


def is_module_path(name: str) -> bool:
    """A dotted Python module name (`a.b.c`), from its text alone."""
    return all(part.isidentifier() for part in name.split("."))


def parse_task_modules(value: str) -> tuple[str, ...]:
    """The module prefixes of CPN_TASK_MODULES (`mycorp.training, tests.e2e`), in order;
    ValueError naming one that is not a dotted module name."""
    prefixes: list[str] = []
    for part in value.split(","):
        prefix = part.strip()
        if not prefix:
            continue
        if not is_module_path(prefix):
            raise ValueError(
                f"CPN_TASK_MODULES: {prefix!r} is not a module name; give dotted module "
                "prefixes separated by commas, e.g. mycorp.training,tests.e2e"
            )
        if prefix not in prefixes:
            prefixes.append(prefix)
    return tuple(prefixes)


def check_allowed(entry: str, modules: Sequence[str]) -> None:
    """ValueError unless `entry` is a builtin or its module is one of `modules` or inside one
    (`a.b` allows `a.b` and `a.b.c`, not `a.bc`): user code runs only where an admin said."""
    kind, _, _ = entry.partition(":")
    if kind == "builtin":
        return
    if any(kind == prefix or kind.startswith(prefix + ".") for prefix in modules):
        return
    allowed = (
        f"the allowed module prefixes are {', '.join(modules)}"
        if modules
        else "this control plane runs builtin: tasks only"
    )
    raise ValueError(
        f"task {entry!r}: module {kind!r} is not allowed; {allowed} (an admin sets them with "
        "CPN_TASK_MODULES); use a builtin: task or a module under an allowed prefix"
    )
