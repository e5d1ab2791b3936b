"""Sync modes, each a class behind one interface (`SyncStrategy`), built by kind.

`make_sync_strategy(sync, ctx)` builds the strategy registered for `sync.kind`; the built-in
ones are every-step, local SGD / DiLoCo, streaming DiLoCo, bounded staleness, adaptive,
heterogeneity-aware partial sync, the asynchronous parameter server and gossip. A
new mode registers its class with `register_sync_strategy` and plugs into `Worker` unchanged.
"""

from grammar import SyncKind
from training.sync.adaptive import AdaptiveSync
from training.sync.async_ps import AsyncPSSync
from training.sync.auto import AutoSync
from training.sync.base import (
    Scope,
    SyncContext,
    SyncFactory,
    SyncStrategy,
    make_sync_strategy,
    register_sync_strategy,
    regroups,
)
from training.sync.every_step import EveryStepSync
from training.sync.gossip import GossipSync
from training.sync.local_sgd import LocalSGDSync
from training.sync.partial import PartialSync
from training.sync.stale import StaleSync
from training.sync.streaming import StreamingSync

register_sync_strategy(SyncKind.EVERY_STEP, EveryStepSync)
register_sync_strategy(SyncKind.LOCAL_SGD, LocalSGDSync)
register_sync_strategy(SyncKind.STALE, StaleSync)
register_sync_strategy(SyncKind.ADAPTIVE, AdaptiveSync)
register_sync_strategy(SyncKind.STREAMING, StreamingSync)
register_sync_strategy(SyncKind.PARTIAL, PartialSync)
register_sync_strategy(SyncKind.ASYNC_PS, AsyncPSSync)
register_sync_strategy(SyncKind.GOSSIP, GossipSync)
register_sync_strategy(SyncKind.AUTO, AutoSync)

__all__ = [
    "AdaptiveSync",
    "AsyncPSSync",
    "AutoSync",
    "EveryStepSync",
    "GossipSync",
    "LocalSGDSync",
    "PartialSync",
    "Scope",
    "StaleSync",
    "StreamingSync",
    "SyncContext",
    "SyncFactory",
    "SyncStrategy",
    "make_sync_strategy",
    "register_sync_strategy",
    "regroups",
]
