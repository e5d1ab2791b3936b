"""The hierarchical collective of one rank: exact inside its cluster, compressed between leaders.

Ranks are grouped by cluster; the first rank of each cluster is its leader. A full exchange is
an all-reduce inside the cluster (gloo, or NCCL on GPUs), a compressed ring (or, where the
plan chose it, tree) all-reduce (or, for compressors that cannot run in a ring, an
all-gather) between leaders over the (possibly
emulated) WAN (`training.exchange`), and a broadcast inside the cluster. Sync strategies
(`training.sync`) compose these pieces; they decide what is exchanged and when, this module
only how.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grammar import Compression
from training.compression import Compressor, make_compressor
from training.exchange import Exchanged, LeaderExchange, model_digest, param_pieces
from training.results import ExchangeCounters
from training.wan import LinkTable, Pacer, ring_edges


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of `tensors` in order (a model's parameters or gradients)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def split(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` with `shapes`, the inverse of `flatten`."""
    out, pos = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[pos : pos + n].view(shape))
        pos += n
    return out


class Collective:
    """Collectives of one rank; all ranks (or all leaders) call them in the same order.

    It also keeps what every leader tells the others with each exchange: the exponential
    mean of its compute time per step (`observe_compute`) and how long its previous exchange
    took; adaptive sync reads them from the exchange's `infos`.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks_cluster: list[str],
        intra: Any,
        leaders: Any,
        names: list[str],
        shapes: list[torch.Size],
        device: torch.device,
        links: LinkTable | None,
        link_schedule: Sequence[tuple[int, float, float]] = (),
        reserved_kbps: int | None = None,
        paced: bool = False,
        tree: dict[str, str] | None = None,
    ) -> None:
        self.clusters = list(dict.fromkeys(ranks_cluster))
        self.cluster = ranks_cluster[rank]
        self.cluster_ranks = [r for r, c in enumerate(ranks_cluster) if c == self.cluster]
        self.is_leader = rank == self.cluster_ranks[0]
        self.intra = intra
        self.names = names
        self.shapes = shapes
        self.device = device
        self.links = links
        self.link_schedule = list(link_schedule)
        spans = tree and set(tree) | set(tree.values()) == set(self.clusters)
        self.tree = dict(tree) if spans and tree else {}
        """The plan's reduction tree (child: parent) when it spans this run's clusters."""
        self.exchanger = (
            LeaderExchange(self.clusters, self.cluster, leaders) if self.is_leader else None
        )
        if self.exchanger is not None:
            self.exchanger.sliced = paced  # the job's, so every leader cuts its sends alike
            if reserved_kbps:
                self.exchanger.pacer = Pacer(reserved_kbps * 1000.0)
        # one compressor per compression level used so far (their state is checkpointed)
        self.compressors: dict[str, Compressor] = {}
        self.compute_ema = 0.0
        self.last_exchange_s = 0.0
        self.intra_s = 0.0
        """Seconds in this rank's intra-cluster gradient all-reduces so far: not WAN time, so
        part of the step a WAN exchange can hide under (`AutoSync` counts it)."""

    @property
    def counters(self) -> ExchangeCounters:
        """This run's exchange totals (zero on ranks that are not leaders)."""
        return self.exchanger.counters if self.exchanger is not None else ExchangeCounters()

    def compressor(self, level: Compression) -> Compressor:
        """The compressor of compression level `level`, made on first use (kept under the
        level's wire name, which a received message's header gives)."""
        name = str(level)
        if name not in self.compressors:
            self.compressors[name] = make_compressor(level)
        return self.compressors[name]

    def observe_compute(self, seconds: float) -> None:
        """Fold one step's compute time into the mean the next exchanges announce."""
        ema = self.compute_ema
        self.compute_ema = seconds if ema == 0 else 0.8 * ema + 0.2 * seconds

    def reduce(self, flat: torch.Tensor) -> None:
        """Sum `flat` over the ranks of this cluster, in place."""
        if len(self.cluster_ranks) > 1:
            start = time.perf_counter()
            dist.all_reduce(flat, group=self.intra)
            self.intra_s += time.perf_counter() - start

    def broadcast(self, flat: torch.Tensor) -> None:
        """The leader's `flat` to every rank of its cluster, in place."""
        if len(self.cluster_ranks) > 1:
            dist.broadcast(flat, src=self.cluster_ranks[0], group=self.intra)

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s elementwise max over every rank of the run, in place: inside each cluster,
        between the leaders, then back inside each cluster. It goes through the run's own
        groups (never the world group), as every other collective here does."""
        moved = t.to(self.device)
        if len(self.cluster_ranks) > 1:
            dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.intra)
        if self.exchanger is not None and len(self.clusters) > 1:
            leaders = moved.cpu()
            dist.all_reduce(leaders, op=dist.ReduceOp.MAX, group=self.exchanger.group)
            moved.copy_(leaders.to(self.device))
        self.broadcast(moved)
        t.copy_(moved.to(t.device))
        return t

    def links_now(self, step: int) -> LinkTable | None:
        """The link table in force at `step` (`link_schedule` reshapes every link)."""
        links = self.links
        for from_step, mbps, rtt in self.link_schedule:
            if step >= from_step:
                links = LinkTable.build([], mbps, rtt)
        return links

    def uses_ring(self, level: Compression) -> bool:
        """Whether exchanges at `level` all-reduce through the ring or the tree (else
        all-gather)."""
        return self.compressor(level).ring

    @property
    def collective(self) -> str:
        """How leaders all-reduce what a ring can carry: "tree" or "ring" (reported)."""
        return "tree" if self.tree else "ring"

    def wan_exchange(
        self, flat: torch.Tensor, step: int, level: Compression, offset: int = 0
    ) -> Exchanged:
        """Leader only: sum this cluster's `flat` with every other cluster's, compressed with
        `level`. `flat` holds the flat parameter positions [offset, offset + len) (a fragment
        of the model, or all of it): that names the pieces the compressor keeps state for.
        The total comes back on this rank's device, the same bits on every leader."""
        assert self.exchanger is not None, "only cluster leaders exchange over the WAN"
        cpu = flat.detach().to("cpu", torch.float32, copy=True).reshape(-1)
        pieces = param_pieces(self.names, self.shapes, offset, cpu.numel())
        info = {"compute": self.compute_ema, "xs": self.last_exchange_s}
        compressor = self.compressor(level)
        links = self.links_now(step)
        start = time.perf_counter()
        if compressor.ring and self.tree:
            done = self.exchanger.tree(
                level, compressor, self.compressors, cpu, pieces, info, links, self.tree
            )
        else:
            how = self.exchanger.ring if compressor.ring else self.exchanger.gather
            done = how(level, compressor, self.compressors, cpu, pieces, info, links)
        self.last_exchange_s = time.perf_counter() - start
        done.total = done.total.to(self.device, flat.dtype).view(flat.shape)
        return done

    def wan_sum(
        self, flat: torch.Tensor, step: int, level: Compression, offset: int = 0
    ) -> torch.Tensor:
        """Leader only: this cluster's `flat` summed with every other cluster's."""
        return self.wan_exchange(flat, step, level, offset).total

    def align_start(self, model: nn.Module) -> bool:
        """Make every rank start from rank 0's model, without sending it when it is already so.

        Workers build the model from the same seed, so their weights normally agree: each
        compares a SHA-256 of its model state inside its cluster, the leaders compare theirs
        over the WAN (33 bytes each), and only when some differ does rank 0's model cross (to
        the leaders, then inside each cluster). Returns True when it had to send the model.
        Every rank calls it once, in the same order as the other collectives.
        """
        mine = torch.frombuffer(bytearray(model_digest(model)), dtype=torch.uint8)
        same = True
        if len(self.cluster_ranks) > 1:
            got = [torch.zeros_like(mine).to(self.device) for _ in self.cluster_ranks]
            dist.all_gather(got, mine.to(self.device), group=self.intra)
            same = all(torch.equal(g.cpu(), mine) for g in got)
        many = len(self.clusters) > 1
        if self.exchanger is not None and many:
            flagged = torch.cat([mine, torch.tensor([int(same)], dtype=torch.uint8)])
            got = [torch.zeros_like(flagged) for _ in self.clusters]
            dist.all_gather(got, flagged, group=self.exchanger.group)
            same = all(torch.equal(g[:-1], mine) and int(g[-1]) == 1 for g in got)
            rounds = len(self.clusters) - 1  # gloo's ring all-gather, as for messages
            self.exchanger.count_setup(
                {edge: rounds * flagged.numel() for edge in ring_edges(self.clusters)}
            )
        verdict = torch.tensor([int(same)], dtype=torch.uint8, device=self.device)
        self.broadcast(verdict)
        if int(verdict.item()) == 1:
            return False
        state = list(model.state_dict().values())
        if self.exchanger is not None and many:
            for t in state:
                dist.broadcast(t, group=self.exchanger.group, group_src=0)
            size = sum(t.numel() * t.element_size() for t in state)
            first = self.clusters[0]
            self.exchanger.count_setup({(first, c): size for c in self.clusters[1:]})
        for t in state:
            moved = t.to(self.device)
            self.broadcast(moved)
            with torch.no_grad():
                t.copy_(moved.to(t.device))
        return True
