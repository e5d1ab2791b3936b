"""Deterministic group-commit batches for the batchers' tests (`api.group_commit`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import anyio

from api.group_commit import GroupCommit

T = TypeVar("T")
R = TypeVar("R")


async def one_batch(batcher: GroupCommit[T, R], items: Sequence[T]) -> list[R | Exception]:
    """Run `items` concurrently, all in one batch: the one writer is held until every item has
    joined (the first leads and waits for it, the rest join its open batch)."""
    out: list[R | Exception] = [RuntimeError("unanswered")] * len(items)

    async def one(i: int) -> None:
        try:
            out[i] = await batcher.run(items[i])
        except Exception as exc:
            out[i] = exc

    await batcher.writers.acquire()
    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
        await anyio.wait_all_tasks_blocked()
        batcher.writers.release()
    return out
