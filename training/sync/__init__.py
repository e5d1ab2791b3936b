"""Sync modes, each a class behind one interface (`SyncStrategy`), built by kind.

`make_sync_strategy(sync, ctx)` builds the strategy registered for `sync.kind`; the built-in
ones are every-step, local SGD / DiLoCo, streaming DiLoCo, bounded staleness and adaptive. A
new mode registers its class with `register_sync_strategy` and plugs into `Worker` unchanged.
"""

from grammar import SyncKind
from training.sync.adaptive import AdaptiveSync
from training.sync.base import (
    Scope,
    SyncContext,
    SyncFactory,
    SyncStrategy,
    make_sync_strategy,
    register_sync_strategy,
)
from training.sync.every_step import EveryStepSync
from training.sync.local_sgd import LocalSGDSync
from training.sync.stale import StaleSync
from training.sync.streaming import StreamingSync

register_sync_strategy(SyncKind.EVERY_STEP, EveryStepSync)
register_sync_strategy(SyncKind.LOCAL_SGD, LocalSGDSync)
register_sync_strategy(SyncKind.STALE, StaleSync)
register_sync_strategy(SyncKind.ADAPTIVE, AdaptiveSync)
register_sync_strategy(SyncKind.STREAMING, StreamingSync)

__all__ = [
    "AdaptiveSync",
    "EveryStepSync",
    "LocalSGDSync",
    "Scope",
    "StaleSync",
    "StreamingSync",
    "SyncContext",
    "SyncFactory",
    "SyncStrategy",
    "make_sync_strategy",
    "register_sync_strategy",
]
