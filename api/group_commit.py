"""Group commit: writes that arrive together share one transaction and its commit.

A write's commit (an fsync on SQLite, a round trip and a WAL flush on PostgreSQL) and the
reads every write of its kind repeats (the network's offered GPUs, a tenant's grant) were
most of its price. The first request to find no open batch opens one and leads it: it waits
for a writer (`workers` at a time: one on SQLite, whose writes serialize anyway, a few on
PostgreSQL), then `window_s` more, and every request that arrives meanwhile joins. The leader
closes the batch and writes it on a worker thread in one transaction; every request in it is
answered only after that commit, so a caller still gets its answer once its write is durable.

`write` answers each item of a batch, in order: its result, or the `CpnError` it alone was
refused with (it wrote nothing). Any exception out of `write` fails the whole batch: every
request in it is answered 503 with Retry-After, never 500, since nothing was committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

from controller.values.errors import CpnError

log = logging.getLogger("cpn.api")

T = TypeVar("T")
R = TypeVar("R")


class BatchFailed(CpnError):
    """The transaction of a batch failed: nothing in it was stored; retry."""

    status, slug, title = 503, "unavailable", "Service unavailable"
    retry_after_s = 1


@dataclass
class _Batch(Generic[T, R]):
    items: list[T]
    done: anyio.Event = field(default_factory=anyio.Event)
    outcomes: Sequence[R | CpnError] = ()
    error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    """Coalesces concurrent writes into group commits (see the module's docstring).

    `what` names an item in the 503's detail. `window_s`: how long a leader that got a
    writer still waits for more items (0: none; the wait for a busy writer batches anyway).
    `max_batch`: a batch that reaches it closes at once and the next item opens another."""

    def __init__(
        self,
        write: Callable[[list[T]], Sequence[R | CpnError]],
        *,
        what: str,
        workers: int,
        window_s: float = 0.0,
        max_batch: int = 500,
    ) -> None:
        self.write = write
        self.what = what
        self.window_s = window_s
        self.max_batch = max_batch
        self.writers = anyio.CapacityLimiter(workers)
        self._open: _Batch[T, R] | None = None
        self.batches = 0
        self.items = 0

    async def run(self, item: T) -> R:
        """Write `item` with whatever arrives with it; return its result once durable."""
        batch = self._open
        if batch is not None:
            index = len(batch.items)
            batch.items.append(item)
            if len(batch.items) >= self.max_batch:
                self._open = None
            await batch.done.wait()
        else:
            index = 0
            batch = self._open = _Batch([item])
            # Shielded: the items that joined wait on this batch, so neither a cancelled
            # leader (its client gone) nor anything else may leave it unwritten.
            with anyio.CancelScope(shield=True):
                await self._lead(batch)
        if batch.error is not None:
            raise BatchFailed(
                f"the database could not store this {self.what} (its batch was rolled back); "
                "retry shortly"
            ) from batch.error
        outcome = batch.outcomes[index]
        if isinstance(outcome, CpnError):
            raise outcome
        return outcome

    async def _lead(self, batch: _Batch[T, R]) -> None:
        try:
            async with self.writers:
                if self.window_s > 0 and self._open is batch:
                    await anyio.sleep(self.window_s)
                if self._open is batch:
                    self._open = None
                items = list(batch.items)
                outcomes = await anyio.to_thread.run_sync(self.write, items)
                if len(outcomes) != len(items):
                    raise RuntimeError(f"{len(items)} {self.what}s got {len(outcomes)} answers")
                batch.outcomes = outcomes
                self.batches += 1
                self.items += len(items)
        except Exception as exc:
            log.error("a batch of %d %ss failed: %s", len(batch.items), self.what, exc)
            batch.error = exc
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
