"""`auto`: which compression and sync a job runs. One policy, for the planner and the runtime.

Three parts, each used by both layers, so the two never keep two policies:

- the menu (`candidates`): every (compression, sync) that `auto` may pick. A mode that
  exchanges gradients every step (every-step, stale) pairs with the gradient compressors; a
  mode of local updates (local SGD, streaming, partial, gossip, async-ps) sends
  pseudo-gradients, which pair with the quantisers and the chunked top-k that need no
  momentum of their own;
- `step_seconds`: one step's seconds under a sync mode, from the step's local part (compute,
  the intra-cluster reduce) and one exchange's latency and transfer. The planner times the menu
  with it over a snapshot (`scheduler.cost`), the runtime over what it measures
  (`training.auto`);
- the rule: of the candidates within `grammar.quality.SLACK` of the fastest, the least lossy
  (`grammar.quality.least_lossy`, by `grammar.quality.quality_cost`); of equal ones, one that
  survives a lost datacenter in place (`resilience`), then the faster, then the lighter.

The runtime can switch at run time only between the kinds in `SWITCHABLE` (at a point where
every cluster holds the same parameters); a plan that picked another mode runs it as planned.
"""

from __future__ import annotations

from grammar.compression import Compression, CompressionKind, parse_compression
from grammar.sync import Sync, SyncKind, parse_sync

GRADIENT_LEVELS: tuple[str, ...] = (
    "none",
    "bf16",
    "int8",
    "powersgd:8",
    "powersgd:2",
    "sign",
    "topk:0.01",
)
"""Compressors of a gradient exchanged every step (in this order, so ties go to the milder)."""

PSEUDO_GRADIENT_LEVELS: tuple[str, ...] = (
    "none",
    "int8",
    "int4",
    "int2",
    "topk:0.02:m0:c4096:int2",
)
"""Compressors of the pseudo-gradient a mode of local updates sends. Top-k without its own
momentum (m0): the pseudo-gradient already is an update; error feedback keeps what was not
sent."""

GRADIENT_SYNCS: tuple[str, ...] = ("every-step", "stale:1")
LOCAL_SYNCS: tuple[str, ...] = (
    "local-sgd:8",
    "local-sgd:32",
    "local-sgd:64",
    "streaming:32:f4:d7",
    "streaming:64:f4:d15",
)
HETERO_SYNCS: tuple[str, ...] = ("partial:16", "async-ps:4")
"""Tried only on cluster sets whose speeds differ enough that a fast cluster fits a second step
into one of the slowest: with equal speeds they only add their quality cost. `partial:H`
diverged when fast clusters ran far ahead until each cluster's pseudo-gradient was normalised
by its steps per tick (training/sync/partial.py; bench/results/modes.md)."""
SPARSE_SYNCS: tuple[str, ...] = ("gossip:8", "gossip:32")
"""Tried only on sets of three or more clusters whose links are uneven."""

SWITCHABLE: frozenset[SyncKind] = frozenset(
    {SyncKind.EVERY_STEP, SyncKind.LOCAL_SGD, SyncKind.STREAMING}
)
"""The modes the runtime's `auto` moves between while a run goes on."""

SURVIVES_LOSS: frozenset[SyncKind] = frozenset(
    {
        SyncKind.EVERY_STEP,
        SyncKind.ADAPTIVE,
        SyncKind.LOCAL_SGD,
        SyncKind.STREAMING,
        SyncKind.PARTIAL,
        SyncKind.GOSSIP,
        SyncKind.ASYNC_PS,
    }
)
"""The modes whose run goes on without a lost datacenter, in place (the runtime's fault
domains: `training.sync.regroups`, which a test holds it to); the others restart from a
checkpoint. Of candidates of equal quality cost within the slack, `auto` takes one of these
first (`resilience`)."""

_GRADIENT_KINDS = frozenset({SyncKind.EVERY_STEP, SyncKind.STALE, SyncKind.ADAPTIVE})


def levels_for(sync: str | Sync) -> tuple[str, ...]:
    """The compressors `auto` pairs with `sync`: gradient compressors under the modes that
    exchange gradients every step, pseudo-gradient ones under the modes of local updates."""
    kind = parse_sync(sync).kind
    return GRADIENT_LEVELS if kind in _GRADIENT_KINDS else PSEUDO_GRADIENT_LEVELS


def candidates(
    compression: str | Compression,
    sync: str | Sync,
    *,
    hetero: bool = False,
    sparse: bool = False,
    switchable: bool = False,
    local_data: bool = False,
) -> list[tuple[str, str]]:
    """(compression, sync) pairs `auto` chooses among, in menu order, for a job whose
    `compression` and `sync` may each be auto or fixed: a fixed value stays, an auto one takes
    the menu's. `hetero` / `sparse` add the modes for uneven speeds / uneven links;
    `switchable` keeps only what the runtime can switch to mid-run (its modes, and no
    compressor with a momentum correction); on `local_data` the menu's streaming sends the
    whole model as one fragment (`parse_sync`'s default there). A fixed pair is the one
    candidate."""
    c, s = parse_compression(compression), parse_sync(sync)
    if s.is_auto:
        syncs = [*GRADIENT_SYNCS, *LOCAL_SYNCS]
        if hetero:
            syncs += HETERO_SYNCS
        if sparse:
            syncs += SPARSE_SYNCS
        if local_data:
            syncs = [_one_fragment(v) for v in syncs]
    else:
        syncs = [str(s)]
    if switchable:
        syncs = [v for v in syncs if parse_sync(v).kind in SWITCHABLE]
    pairs = (
        [(level, v) for v in syncs for level in levels_for(v)]
        if c.is_auto
        else [(str(c), v) for v in syncs]
    )
    if switchable:  # a momentum correction replaces the optimizer's, set once a run
        pairs = [(lv, v) for lv, v in pairs if not _corrects_momentum(lv)]
    return pairs


def _one_fragment(value: str) -> str:
    """A streaming menu entry as one fragment of its period and delay; others as they are."""
    s = parse_sync(value)
    if s.kind is not SyncKind.STREAMING:
        return value
    return str(Sync(SyncKind.STREAMING, period=s.period, fragments=1, delay=s.delay))


def adaptable(
    compression: str | Compression,
    sync: str | Sync,
    planned_compression: str | Compression,
    planned_sync: str | Sync,
    *,
    local_data: bool = False,
) -> tuple[str, ...]:
    """What of a job's `compression` and `sync` the runtime may re-decide mid-run, starting
    from the plan's concrete pair: the parts the job left to `auto` ("compression", "sync"),
    where the planned pair is one the runtime can switch from (`candidates(switchable=True)`,
    on `local_data` its menu there); () where nothing was left to `auto` or the plan picked a
    mode the runtime cannot leave."""
    c, s = parse_compression(compression), parse_sync(sync)
    parts = tuple(p for p, auto in (("sync", s.is_auto), ("compression", c.is_auto)) if auto)
    planned = (str(parse_compression(planned_compression)), str(parse_sync(planned_sync)))
    menu = candidates(c, s, switchable=True, local_data=local_data)
    return parts if parts and planned in menu else ()


def _corrects_momentum(level: str) -> bool:
    c = parse_compression(level)
    return c.kind is CompressionKind.TOPK and c.momentum > 0.0


def step_seconds(sync: Sync, local_s: float, latency_s: float, transfer_s: float) -> float:
    """Seconds of one step under `sync` whose local part (compute, the intra-cluster reduce)
    takes `local_s` and whose WAN exchange of the model takes `latency_s` of round trips plus
    `transfer_s` of bytes on the busiest link (and their coding). Nothing overlaps the
    backward pass (the runtime exchanges after it):

    - every-step (adaptive): local + the exchange;
    - local SGD, partial and gossip (their own exchange's terms): local + the exchange / H;
    - stale:s (s >= 1): max(local, the exchange): the leaders' exchanges go one at a time, each
      beside the next step's compute, so a step hides its exchange but no exchange hides
      another's latency (s only bounds how far a late exchange may fall behind);
    - async-ps: local + the push and pull a leader waits for (its own server's; the exchange
      between regions' servers flies apart and is not waited for);
    - streaming:H:fF:dD: each of the F fragments (the latency, 1/F of the transfer) has D
      steps of compute to arrive; what outlasts them is waited for, F times a period; and the
      link must carry the F fragments in the period's compute.
    """
    kind = sync.kind
    if kind in (SyncKind.LOCAL_SGD, SyncKind.PARTIAL, SyncKind.GOSSIP):
        return local_s + (latency_s + transfer_s) / sync.period
    if kind is SyncKind.STREAMING:
        f = sync.fragments
        fragment = latency_s + transfer_s / f
        late = fragment - sync.delay * local_s
        waited = local_s + f * late / sync.period if late > 0.0 else local_s
        busy = (f * latency_s + transfer_s) / sync.period
        return busy if busy > waited else waited
    if kind is SyncKind.STALE and sync.staleness >= 1:
        exchange = latency_s + transfer_s
        return exchange if exchange > local_s else local_s
    return local_s + (latency_s + transfer_s)


def resilience(sync: str | Sync) -> int:
    """0 for a mode that survives a lost datacenter in place (`SURVIVES_LOSS`), 1 for one
    that restarts: the first key among candidates of equal quality cost."""
    return 0 if parse_sync(sync).kind in SURVIVES_LOSS else 1
