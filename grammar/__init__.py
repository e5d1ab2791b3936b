"""The one grammar of a job's compression and sync values, shared by every layer.

The API schema, the CLI, the planner and the training runtime all parse these values here,
so a value one layer accepts every other accepts too. Pure standard library: `scheduler/`
and `training/` may import it without importing each other.
"""

from grammar.compression import (
    COMPRESSION_HELP,
    DOCUMENTED_COMPRESSIONS,
    Compression,
    CompressionKind,
    canonical_compression,
    parse_compression,
)
from grammar.states import LIVE, ClusterState
from grammar.sync import (
    DOCUMENTED_SYNCS,
    SYNC_HELP,
    Sync,
    SyncKind,
    canonical_sync,
    parse_sync,
)

__all__ = [
    "COMPRESSION_HELP",
    "DOCUMENTED_COMPRESSIONS",
    "DOCUMENTED_SYNCS",
    "LIVE",
    "SYNC_HELP",
    "ClusterState",
    "Compression",
    "CompressionKind",
    "Sync",
    "SyncKind",
    "canonical_compression",
    "canonical_sync",
    "parse_compression",
    "parse_sync",
]
