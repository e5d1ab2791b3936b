"""Placement search: which clusters, how many GPUs each, which compression and sync mode.

Search space: a subset S of eligible, pairwise-linked clusters (|S| <= max_clusters), GPUs per
cluster (each member >= 1, within free GPUs, total within the job's range), a compressor and a
sync mode. For a fixed S the estimate depends on the GPU split only through the aggregate
throughput R, the slowest intra-cluster all-reduce tau and the hourly price P. So:

- time objective, no budget: for each candidate tau (an intra all-reduce time that some cluster
  reaches at some size) cap each cluster at the most GPUs within tau and fill fastest GPUs
  first; this maximises R for that tau, and the step time falls with R and rises with tau, so
  the best of these points is the exact optimum for S.
- cost objectives or a budget: a dynamic programme over the members of S keeps every
  allocation not dominated in (R up, P down, tau down), which is exact for any objective that
  is monotone in those three.

Small instances (<= EXACT_MAX_CLUSTERS eligible clusters) search every S in full. Larger ones
pick a pool of promising clusters (best alone, most capacity, best links to those), grow
subsets greedily from the best seeds (a set still short of GPUs ranks by how fast it would run
the job on what it has, so growth follows good links), improve them by add / drop / swap moves
— all screened with cluster sizes on a doubling grid — and search the FULL_EVALS best screened
subsets in full. Every tie is broken by names, so the same input gives the same plan.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import replace

from grammar.auto import candidates, resilience
from grammar.graph import tree_levels
from grammar.quality import MAX_COST, SLACK, SPEED_BOUND, least_lossy
from grammar.states import ClusterState
from scheduler.compression import splits_by_rate
from scheduler.cost import CostModel, RankIndex
from scheduler.rules import (
    BANDWIDTH_BOUND,
    Release,
    bandwidth_victims,
    exclusions,
    is_clique,
    preemption_candidates,
    preemption_cost,
    quota_left,
)
from scheduler.rules import (
    release as release_gpus,
)
from scheduler.types import (
    OBJECTIVES,
    Assignment,
    Cluster,
    Estimate,
    Infeasible,
    JobRequest,
    Objective,
    Placement,
    Plan,
    PlanResult,
    RunningJob,
    Snapshot,
)

EXACT_MAX_CLUSTERS = 8
DP_MAX_GPUS = 24  # above this many GPUs per subset the cost DP gives way to greedy fills
ALL_SIZES_UP_TO = 8  # tau candidates: every cluster size up to this, then doubling sizes
POOL_SEEDS = 4
FULL_EVALS = 6  # subsets searched in full after screening
MAX_VICTIM_SETS = 2000
ALTERNATIVES = 3  # runner-up cluster sets a plan's explanation names

_INF = float("inf")
_NONE: frozenset[str] = frozenset()


# Plain classes, not dataclasses, for the search's own records (nothing mutates one after it
# is built): the search builds an _Alloc per GPU split and a _Choice per winning comparison,
# and a dataclass's `__init__` is generated Python that a compiled build (`scheduler.native`)
# still calls through the interpreter; a frozen one sets each field through object.__setattr__.
class _Alloc:
    __slots__ = ("gpus", "intra", "names", "price", "rate")

    def __init__(
        self,
        names: tuple[str, ...],
        gpus: tuple[int, ...],
        rate: float,
        intra: float,
        price: float,
    ) -> None:
        self.names = names
        self.gpus = gpus
        self.rate = rate
        self.intra = intra
        self.price = price


class _Choice:
    __slots__ = ("alloc", "compression", "cost", "sync", "time")

    def __init__(
        self, alloc: _Alloc, compression: str, sync: str, time: float, cost: float
    ) -> None:
        self.alloc = alloc
        self.compression = compression
        self.sync = sync
        self.time = time
        self.cost = cost


class _Search:
    """One planning problem: the model, the rules in force and the best choices seen."""

    prune = True  # skip sets that cannot change the plan (`_subset_unless_beaten`; off: tests)

    def __init__(
        self,
        model: CostModel,
        job: JobRequest,
        objective: Objective,
        gmin: int,
        gmax: int,
    ) -> None:
        self.model = model
        self.snapshot = model.snapshot
        self.job = job
        self.objective = objective
        self.gmin = gmin
        self.gmax = gmax
        self.deadline = job.qos.deadline_s
        self.budget = job.qos.max_cost
        self.max_clusters = job.qos.max_clusters or 1_000_000
        # local data: every cluster holding a share of it runs (no share left untrained)
        self.required = frozenset(job.data_clusters or ())
        self.use_dp = objective != "time" or self.budget is not None
        self.best: _Choice | None = None
        self.fastest: _Choice | None = None
        self.cheapest_in_time: _Choice | None = None
        self.runner_up: dict[tuple[str, ...], _Choice] = {}
        self._subset_cache: dict[tuple[str, ...], _Choice | None] = {}
        self._quick_cache: dict[tuple[str, ...], _Choice | None] = {}
        self._screen_top: list[float] = []
        """The objective of the FULL_EVALS best feasible screened sets, negated (a heap):
        `_finish` scores in full only sets that rank among them."""
        self._partial_cache: dict[tuple[str, ...], float] = {}
        # `grammar.auto`'s menu, the runtime's auto's too
        c, s, local = job.compression, job.sync, job.data_clusters is not None
        self.multi = candidates(c, s, local_data=local)
        base = set(self.multi)
        self.hetero = [p for p in candidates(c, s, hetero=True, local_data=local) if p not in base]
        self.sparse = [p for p in candidates(c, s, sparse=True, local_data=local) if p not in base]
        self.single = [
            (
                "none" if job.compression == "auto" else job.compression,
                "every-step" if job.sync == "auto" else job.sync,
            )
        ]

    def combos(self, names: tuple[str, ...]) -> list[tuple[str, str]]:
        """(compression, sync) candidates for S: `sync: auto` adds the modes that let fast
        clusters run ahead where speeds differ, and gossip where links are uneven."""
        if len(names) == 1:
            return self.single
        out = self.multi
        if self.hetero and self.model.speeds_differ(names):
            out = out + self.hetero
        if self.sparse and self.model.uneven(names):
            out = out + self.sparse
        return out

    # --- ranking ---------------------------------------------------------------------------

    def key(self, ch: _Choice) -> tuple[float, float, int, tuple[str, ...], tuple[int, ...]]:
        """Objective first, the other measure second, then fewer clusters, then names."""
        a = ch.alloc
        if self.objective == "time":
            return (ch.time, ch.cost, len(a.names), a.names, a.gpus)
        return (ch.cost, ch.time, len(a.names), a.names, a.gpus)

    def ok(self, ch: _Choice) -> bool:
        return (self.deadline is None or ch.time <= self.deadline) and (
            self.budget is None or ch.cost <= self.budget
        )

    def rank(
        self, ch: _Choice | None
    ) -> tuple[int, tuple[float, float, int, tuple[str, ...], tuple[int, ...]] | tuple[()]]:
        """Feasible choices before infeasible ones, then by objective."""
        if ch is None:
            return (2, ())
        return (0 if self.ok(ch) else 1, self.key(ch))

    # --- evaluating one subset -------------------------------------------------------------

    def allocs(self, names: tuple[str, ...], quick: bool = False) -> list[_Alloc]:
        """Allocations of S that can be optimal (see the module docstring); `quick` keeps
        only the fills without a cap on cluster size (a screening estimate)."""
        snap = self.snapshot
        k = len(names)
        if self.required and not self.required.issubset(names):
            return []
        caps = [min(snap.by_name[n].gpus_free, self.gmax - (k - 1)) for n in names]
        if any(c < 1 for c in caps) or sum(caps) < self.gmin or k > self.gmax:
            return []
        if self.use_dp and sum(caps) <= DP_MAX_GPUS and not quick:
            return self._dp_allocs(names, caps)
        return self._greedy_allocs(names, caps, quick)

    def _greedy_allocs(
        self, names: tuple[str, ...], caps: list[int], quick: bool = False
    ) -> list[_Alloc]:
        m = self.model
        # rows read up to each cap: a member's row may be longer (`CostModel.intra_row`)
        intra = [m.intra_row(n, c) for n, c in zip(names, caps, strict=True)]
        orders = [
            sorted(
                range(len(names)), key=lambda i: (-m.rate[names[i]], m.price[names[i]], names[i])
            )
        ]
        targets = [min(self.gmax, sum(caps))]
        if self.use_dp:
            # cost-aware variants: cheapest FLOPs first, and the smallest gang
            orders.append(
                sorted(
                    range(len(names)),
                    key=lambda i: (m.price[names[i]] / m.rate[names[i]], names[i]),
                )
            )
            targets.append(max(self.gmin, len(names)))
        sizes = [_sizes(c, 1 if quick else ALL_SIZES_UP_TO) for c in caps]
        taus = sorted({row[p - 1] for row, ps in zip(intra, sizes, strict=True) for p in ps})
        out: list[_Alloc] = []
        seen: set[tuple[int, ...]] = set()
        capped: set[tuple[int, ...]] = set()  # the fills depend on tau only through these
        for tau in taus:
            tcaps = tuple(
                [bisect.bisect_right(row, tau, 0, c) for row, c in zip(intra, caps, strict=True)]
            )
            total = sum(tcaps)
            if total < self.gmin or tcaps in capped:
                continue
            capped.add(tcaps)
            for order in orders:
                for target in targets:
                    left = min(target, total) - len(names)
                    if left < 0:
                        continue
                    g = [1] * len(names)
                    for i in order:
                        add = min(left, tcaps[i] - 1)
                        g[i] += add
                        left -= add
                    if sum(g) < self.gmin:
                        continue
                    tg = tuple(g)
                    if tg in seen:
                        continue
                    seen.add(tg)
                    tau_g = intra[0][tg[0] - 1]  # max over the members, the first of equals
                    for row, x in zip(intra, tg, strict=True):
                        if row[x - 1] > tau_g:
                            tau_g = row[x - 1]
                    out.append(self._alloc(names, tg, tau_g))
        return out

    def _dp_allocs(self, names: tuple[str, ...], caps: list[int]) -> list[_Alloc]:
        m = self.model
        # state: gpus so far -> list of (rate, price, tau, gpus tuple), pairwise non-dominated;
        # with the GPU count fixed by the key, the step time falls with the throughput (the
        # modes split by throughput; those split equally depend on the GPU count alone)
        states: dict[int, list[_Point]] = {0: [(0.0, 0.0, 0.0, ())]}
        for n, cap in zip(names, caps, strict=True):
            nxt: dict[int, list[_Point]] = {}
            r, pr = m.rate[n], m.price[n]
            row = m.intra_row(n, cap)
            for used, pts in states.items():
                for g in range(1, cap + 1):
                    tot = used + g
                    if tot > self.gmax:
                        break
                    t = row[g - 1]
                    bucket = nxt.setdefault(tot, [])
                    for rate, price, tau, gs in pts:
                        bucket.append((rate + g * r, price + g * pr, max(tau, t), (*gs, g)))
            states = {tot: _pareto(pts) for tot, pts in nxt.items()}
        final = [p for tot, pts in sorted(states.items()) if tot >= self.gmin for p in pts]
        return [self._alloc(names, p[3]) for p in final]

    def _alloc(
        self, names: tuple[str, ...], gpus: tuple[int, ...], intra: float | None = None
    ) -> _Alloc:
        """`intra`: the slowest member's all-reduce, when the caller has it already."""
        m = self.model
        if intra is None:
            intra = max(m.intra(n, g) for n, g in zip(names, gpus, strict=True))
        return _Alloc(
            names,
            gpus,
            sum(g * m.rate[n] for n, g in zip(names, gpus, strict=True)),
            intra,
            sum(g * m.price[n] for n, g in zip(names, gpus, strict=True)),
        )

    def subset(self, names: tuple[str, ...], quick: bool = False) -> _Choice | None:
        """Best choice within S (by rank), recording global bests as a side effect."""
        cache = self._quick_cache if quick else self._subset_cache
        if names in cache:
            return cache[names]
        if quick and names in self._subset_cache:
            return self._subset_cache[names]
        allocs = self.allocs(names, quick)
        best = self._score(names, allocs) if allocs else None
        if best is not None:
            if not quick:
                self.runner_up[names] = best
            if self.rank(best) < self.rank(self.best):
                self.best = best
        cache[names] = best
        if quick and best is not None and self.ok(best):
            worth = -self.key(best)[0]
            if len(self._screen_top) >= FULL_EVALS:
                heapq.heappushpop(self._screen_top, worth)
            else:
                heapq.heappush(self._screen_top, worth)
        return best

    def _score(self, names: tuple[str, ...], allocs: list[_Alloc]) -> _Choice | None:
        """Score every (allocation, compressor, sync) of S; the best by `rank`, keeping the
        fastest and the cheapest in time as `_track` does.

        The search's hot loop (thousands of choices a plan): it compares the floats first
        and builds a `_Choice` only for one that wins a comparison, with the same outcome as
        `_track` and `rank` on every choice: within one S only the GPUs differ after the
        two measures, and a tie on both is broken by the full keys, as they do.
        """
        choices = self.combos(names)
        times, costs = self.model.score_set(
            names, choices, [(a.rate, a.intra, a.price, sum(a.gpus)) for a in allocs]
        )
        by_time = self.objective == "time"
        dl, budget = self.deadline, self.budget
        fastest, cheapest = self.fastest, self.cheapest_in_time
        best: _Choice | None = None
        # best's (feasible 0 / not 1, objective, other measure); 2 sorts after any choice
        b_flag, b_p, b_s = 2, 0.0, 0.0
        b_gpus: tuple[int, ...] = ()
        k = 0
        for alloc in allocs:
            gpus = alloc.gpus
            for comp, sync in choices:
                t, c = times[k], costs[k]
                k += 1
                ch: _Choice | None = None
                if fastest is None or t < fastest.time:
                    ch = fastest = _Choice(alloc, comp, sync, t, c)
                elif t == fastest.time:
                    ch = _Choice(alloc, comp, sync, t, c)
                    if _time_key(ch) < _time_key(fastest):
                        fastest = ch
                in_time = dl is None or t <= dl
                if in_time and (cheapest is None or c <= cheapest.cost):
                    if ch is None:
                        ch = _Choice(alloc, comp, sync, t, c)
                    # c <= cheapest's: c < it, or a tie that the full key breaks
                    if cheapest is None or c < cheapest.cost or _cost_key(ch) < _cost_key(cheapest):
                        cheapest = ch
                flag = 0 if in_time and (budget is None or c <= budget) else 1
                if by_time:
                    p, q = t, c
                else:
                    p, q = c, t
                if flag < b_flag or (
                    flag == b_flag
                    and (p < b_p or (p == b_p and (q < b_s or (q == b_s and gpus < b_gpus))))
                ):
                    best = ch if ch is not None else _Choice(alloc, comp, sync, t, c)
                    b_flag, b_p, b_s, b_gpus = flag, p, q, gpus
        self.fastest, self.cheapest_in_time = fastest, cheapest
        return best

    def _record(self, ch: _Choice) -> None:
        """Consider one choice made outside `subset` (used by `evaluate`)."""
        self._track(ch)
        if self.rank(ch) < self.rank(self.best):
            self.best = ch

    def _track(self, ch: _Choice) -> None:
        """Keep the fastest choice and the cheapest within the deadline, for diagnosis."""
        f = self.fastest
        if f is None or ch.time < f.time or (ch.time == f.time and _time_key(ch) < _time_key(f)):
            self.fastest = ch
        if self.deadline is None or ch.time <= self.deadline:
            c = self.cheapest_in_time
            if (
                c is None
                or ch.cost < c.cost
                or (ch.cost == c.cost and _cost_key(ch) < _cost_key(c))
            ):
                self.cheapest_in_time = ch

    # --- searching subsets -----------------------------------------------------------------

    def run(self, cands: Sequence[str]) -> None:
        if len(cands) <= EXACT_MAX_CLUSTERS:
            self._exhaustive(cands, quick=False)
        else:
            self._heuristic(cands)
            self._finish()
            if self.best is None:  # no set the seeds grew had room: look past the seeds
                self._reach(cands)
                self._finish()

    def _exhaustive(self, cands: Sequence[str], quick: bool) -> None:
        names = sorted(cands)
        free = {n: self.snapshot.by_name[n].gpus_free for n in names}
        top: list[float] = []
        for k in range(1, min(len(names), self.max_clusters, self.gmax) + 1):
            for sub in itertools.combinations(names, k):
                if sum(free[n] for n in sub) >= self.gmin and is_clique(self.snapshot, sub):
                    if quick or not self.prune:
                        self.subset(sub, quick)
                    else:
                        self._subset_unless_beaten(sub, top)

    def _subset_unless_beaten(self, names: tuple[str, ...], top: list[float]) -> None:
        """`subset(names)` in full, unless the set cannot change the plan.

        What a plan shows of the sets scored in full is the best one and the next
        ALTERNATIVES (`_explain`); the fastest and cheapest choices are read only to say why
        a plan is infeasible. Once 1 + ALTERNATIVES sets have a feasible best, the plan is
        feasible, and a set whose every choice is worse in the objective (`_floors`) than
        theirs, or misses the deadline, ranks after all of them: it is skipped. `top`: the
        objective of the best feasible sets scored in full so far, negated (a heap), which
        this keeps up to date.
        """
        if names in self._subset_cache:
            return  # scored already, and counted in `top`
        by_time = self.objective == "time"
        if len(top) > ALTERNATIVES:
            t_floor, c_floor = self._floors(names)
            if (t_floor if by_time else c_floor) > -top[0] or (
                self.deadline is not None and t_floor > self.deadline
            ):
                return
        ch = self.subset(names)
        if ch is not None and self.ok(ch):
            worth = -(ch.time if by_time else ch.cost)
            if len(top) > ALTERNATIVES:
                heapq.heappushpop(top, worth)
            else:
                heapq.heappush(top, worth)

    def _floors(self, names: tuple[str, ...]) -> tuple[float, float]:
        """Lower bounds on the total time and on the cost of every choice on `names`, less a
        margin for rounding and for `pace`'s tolerance; (0, 0) where the set has no allocation.

        Time: the job's steps, each as long as its
        compute alone with the most throughput the set can give the job (a step is never
        shorter than its compute, and running ahead gains at most the fast GPUs' throughput,
        `CostModel.ahead_rate`). Cost: GPU-hours alone, the same steps at the least price per
        FLOP/s of any member (an allocation's price over its throughput is no lower)."""
        m, snap = self.model, self.snapshot
        k = len(names)
        caps = [min(snap.by_name[n].gpus_free, self.gmax - (k - 1)) for n in names]
        if any(c < 1 for c in caps) or sum(caps) < self.gmin or k > self.gmax:
            return 0.0, 0.0
        # fastest GPUs first, one each at least, within the job's GPUs: the most throughput
        left, rate = self.gmax - k, 0.0
        for r, cap in sorted(zip((m.rate[n] for n in names), caps, strict=True), reverse=True):
            add = min(left, cap - 1)
            left -= add
            rate += (1 + add) * r
        margin = 1 - 1e-6
        work = self.job.steps * m.work
        per_flop = min(m.price[n] / m.rate[n] for n in names)
        return work / rate * margin, work * per_flop / 3600.0 * margin

    def _finish(self) -> None:
        """Screening used uncapped fills only; search the best subsets it found in full."""
        ranked = sorted(
            (sub for sub, ch in self._quick_cache.items() if ch is not None),
            key=lambda sub: self.rank(self._quick_cache[sub]),
        )
        if not self.prune:
            for sub in ranked[:FULL_EVALS]:
                self.subset(sub)
            return
        by_time = self.objective == "time"
        # the sets scored in full so far: the singles of `_heuristic`
        top = sorted(
            -(ch.time if by_time else ch.cost) for ch in self.runner_up.values() if self.ok(ch)
        )
        top = top[-(1 + ALTERNATIVES) :]
        heapq.heapify(top)
        for sub in ranked[:FULL_EVALS]:
            self._subset_unless_beaten(sub, top)

    def _surrogate(self, names: tuple[str, ...]) -> tuple[int, tuple[object, ...]]:
        """Screening rank of a subset; subsets short of GPUs rank by how much they have."""
        ch = self.subset(names, quick=True)
        if ch is not None:
            r = self.rank(ch)
            return (r[0], tuple(r[1]))
        return (3, (self._partial_time(names), names))

    def _partial_time(self, names: tuple[str, ...]) -> float:
        """Fastest time for the job on all free GPUs of a set too small for it: a guide for
        growing sets (a badly linked member slows it, a well linked one speeds it up)."""
        hit = self._partial_cache.get(names)
        if hit is not None:
            return hit
        m, snap = self.model, self.snapshot
        gpus = [snap.by_name[n].gpus_free for n in names]
        rate = sum(g * m.rate[n] for n, g in zip(names, gpus, strict=True))
        intra = max(m.intra(n, g) for n, g in zip(names, gpus, strict=True))
        best = min(m.score_set(names, self.combos(names), [(rate, intra, 0.0, sum(gpus))])[0])
        self._partial_cache[names] = best
        return best

    def _heuristic(self, cands: Sequence[str]) -> None:
        snap, m = self.snapshot, self.model
        eligible = set(cands)
        by_name, gmax = snap.by_name, self.gmax
        alone, by_power, by_value = self._rankings(eligible)
        # singles: every cluster that can hold the gang alone is evaluated (cheap, exact)
        for n in alone:
            self.subset((n,))
        seeds: list[str] = []
        for n in [*alone[:POOL_SEEDS], *by_power[:POOL_SEEDS], *by_value[:POOL_SEEDS]]:
            if n not in seeds:
                seeds.append(n)
        pool = list(seeds)
        for s in seeds[:POOL_SEEDS]:

            def closeness(n: str, s: str = s) -> tuple[float, float, str]:
                cap = min(by_name[n].gpus_free, gmax)
                return (_link_time(snap, s, n, m.nbytes), -cap * m.rate[n], n)

            linked = snap.neighbours.get(s, frozenset())
            near = heapq.nsmallest(POOL_SEEDS, (n for n in linked if n in eligible), key=closeness)
            for n in near:
                if n not in pool:
                    pool.append(n)
        pool.sort()
        limit = min(self.max_clusters, self.gmax)
        adjacent = snap.neighbours  # linked both ways (`Snapshot.directed_links`)
        for seed in seeds[:POOL_SEEDS]:
            cur: tuple[str, ...] = (seed,)
            cur_rank = self._surrogate(cur)
            while len(cur) < limit:
                best_next, best_rank = None, cur_rank
                for n in pool:
                    if n in cur or not all(c in adjacent.get(n, _NONE) for c in cur):
                        continue
                    nxt = tuple(sorted((*cur, n)))
                    if self._cannot_beat(nxt, best_rank):
                        continue
                    r = self._surrogate(nxt)
                    if r < best_rank:
                        best_next, best_rank = nxt, r
                if best_next is None:
                    break
                cur, cur_rank = best_next, best_rank
            self._local_search(cur, pool, limit)

    def _cannot_beat(self, names: tuple[str, ...], rank: tuple[int, tuple[object, ...]]) -> bool:
        """Whether no choice on `names` can rank before `rank` (a feasible set's screening
        rank) nor rank among the FULL_EVALS best screened so far (those `_finish` scores in
        full): its floor in the objective is above both, or its floors miss the deadline or
        the budget. Growth and local search move only to a set that ranks before the current
        one, and `_finish` reads only the best screened, so screening such a set changes
        nothing (most of a plan at 100 clusters: a gang that fits one cluster tried every pair
        around each seed)."""
        if not self.prune or rank[0] != 0 or names in self._quick_cache:
            return False
        if len(self._screen_top) < FULL_EVALS:
            return False  # it could still rank among the sets `_finish` scores in full
        t_floor, c_floor = self._floors(names)
        if (self.deadline is not None and t_floor > self.deadline) or (
            self.budget is not None and c_floor > self.budget
        ):
            return True  # infeasible: after every feasible set
        floor = t_floor if self.objective == "time" else c_floor
        best = rank[1][0]
        assert isinstance(best, float)
        # not a move (it cannot rank before `rank`), nor among the FULL_EVALS best screened
        return floor > best and floor > -self._screen_top[0]

    def _reach(self, cands: Sequence[str]) -> None:
        """Screen one pairwise-linked set with room for the gang, when `_heuristic` found none.

        Its seeds are the clusters with the most power or value alone; a gang larger than any
        cluster also needs linked neighbours with room, and the seeds' can all be full (a
        region used up but for one cluster each: 47 gangs of 48 GPUs on 1,000 clusters of 32
        made every later gang "infeasible" with 29,744 GPUs free). So grow a clique from each
        candidate, most free GPUs first, along its neighbours with the most free GPUs, and
        screen the first that reaches `gmin` (then improve it as `_heuristic` does). Greedy, not
        exhaustive; it runs only when the plan would otherwise be refused."""
        snap = self.snapshot
        by_name = snap.by_name
        eligible = {n for n in cands if by_name[n].gpus_free > 0}
        if sum(by_name[n].gpus_free for n in eligible) < self.gmin:
            return
        limit = min(self.max_clusters, self.gmax)

        def most_free(n: str) -> tuple[int, str]:
            return (-by_name[n].gpus_free, n)

        for seed in sorted(eligible, key=most_free):
            near = sorted(
                (n for n in snap.neighbours.get(seed, ()) if n in eligible), key=most_free
            )
            if by_name[seed].gpus_free + sum(by_name[n].gpus_free for n in near) < self.gmin:
                continue
            cur, room = [seed], by_name[seed].gpus_free
            for n in near:
                if room >= self.gmin or len(cur) >= limit:
                    break
                if all(snap.link(n, c) is not None for c in cur):
                    cur.append(n)
                    room += by_name[n].gpus_free
            if room >= self.gmin:
                self._local_search(tuple(sorted(cur)), sorted([seed, *near]), limit)
                return

    def _rankings(self, eligible: Set[str]) -> tuple[list[str], list[str], list[str]]:
        """The seed rankings of `_heuristic`: the 4 x POOL_SEEDS best clusters that fit the
        gang alone (by power for the time objective, by value otherwise), and the POOL_SEEDS
        best by power and by value. Power: most GPUs the job may take times their rate;
        value: price per FLOP/s, then the GPUs; ties by name.

        Read off the snapshot's `RankIndex` when the model has one (`CostModel.rank_index`):
        scoring every cluster for these was most of a plan at 10,000 clusters, and the index
        finds the same lists looking at the few best (`_top_power`, `_top_value`)."""
        ix = self.model.rank_index()
        if ix is None:
            return self._rankings_scan(eligible)
        by_name, gmax, gmin = self.snapshot.by_name, self.gmax, self.gmin

        def free(n: str) -> int:
            return by_name[n].gpus_free

        def fits(n: str) -> bool:
            return n in eligible and by_name[n].gpus_free >= gmin

        k = 4 * POOL_SEEDS
        top = _top_power if self.objective == "time" else _top_value
        return (
            top(ix, k, fits, free, gmax),
            _top_power(ix, POOL_SEEDS, eligible.__contains__, free, gmax),
            _top_value(ix, POOL_SEEDS, eligible.__contains__, free, gmax),
        )

    def _rankings_scan(self, cands: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
        """`_rankings` by scoring every candidate (a model with calibrated factors)."""
        m = self.model
        names = sorted(cands)
        by_name, rate, gmax = self.snapshot.by_name, m.rate, self.gmax
        free = [by_name[n].gpus_free for n in names]
        fits = [n for n, f in zip(names, free, strict=True) if f >= self.gmin]
        cap = {n: min(f, gmax) for n, f in zip(names, free, strict=True)}
        # each cluster's key once (two rankings use it; thousands of clusters a plan)
        power = {n: (-cap[n] * rate[n], n) for n in names}.__getitem__

        def value(n: str) -> tuple[float, float, str]:
            return (m.price[n] / m.rate[n], -cap[n], n)

        # nsmallest(k, xs, key) is sorted(xs, key=key)[:k], without sorting thousands
        alone = heapq.nsmallest(
            4 * POOL_SEEDS, fits, key=power if self.objective == "time" else value
        )
        by_power = heapq.nsmallest(POOL_SEEDS, names, key=power)
        by_value = heapq.nsmallest(POOL_SEEDS, names, key=value)
        return alone, by_power, by_value

    def _local_search(self, cur: tuple[str, ...], pool: list[str], limit: int) -> None:
        snap = self.snapshot
        cur_rank = self._surrogate(cur)
        for _ in range(20):
            moves: list[tuple[str, ...]] = []
            for n in pool:
                if n not in cur and len(cur) < limit:
                    moves.append(tuple(sorted((*cur, n))))
            if len(cur) > 1:
                moves.extend(tuple(x for x in cur if x != d) for d in cur)
                for d in cur:
                    for n in pool:
                        if n not in cur:
                            moves.append(tuple(sorted((*(x for x in cur if x != d), n))))
            improved = False
            for mv in moves:
                if not is_clique(snap, mv) or self._cannot_beat(mv, cur_rank):
                    continue
                r = self._surrogate(mv)
                if r < cur_rank:
                    cur, cur_rank, improved = mv, r, True
            if not improved:
                break


def _top_power(
    ix: RankIndex, k: int, ok: Callable[[str], bool], free: Callable[[str], int], gmax: int
) -> list[str]:
    """The k clusters passing `ok` with the least (-min(free, gmax) x rate, name), in order.

    Rate groups fastest first; in a group the key falls with min(free, gmax), so its best
    are the first members by name with gmax free (a short walk), else all are scored. A
    group whose best possible key, -gmax x rate, is above the k-th found ends the search:
    every later group's is higher still."""
    found: list[tuple[float, str]] = []
    for r, members in ix.by_rate:
        if len(found) >= k and -gmax * r > heapq.nsmallest(k, found)[-1][0]:
            break
        full: list[str] = []
        for n in members:
            if ok(n) and free(n) >= gmax:
                full.append(n)
                if len(full) == k:
                    break
        if len(full) == k:
            found.extend((-gmax * r, n) for n in full)
        else:
            found.extend((-min(free(n), gmax) * r, n) for n in members if ok(n))
    return [n for _, n in heapq.nsmallest(k, found)]


def _top_value(
    ix: RankIndex, k: int, ok: Callable[[str], bool], free: Callable[[str], int], gmax: int
) -> list[str]:
    """The k clusters passing `ok` with the least (price / rate, -min(free, gmax), name), in
    order: read by price per FLOP/s up to the end of the group of equal ratio in which the
    k-th is found (later clusters have a higher ratio)."""
    found: list[tuple[float, int, str]] = []
    last = -1.0
    for q, n in ix.by_value:
        if q != last:
            if len(found) >= k:
                break
            last = q
        if ok(n):
            found.append((q, -min(free(n), gmax), n))
    return [n for _, _, n in heapq.nsmallest(k, found)]


@functools.cache  # a pure function of two small ints, asked for every member of every set
def _sizes(cap: int, all_up_to: int = ALL_SIZES_UP_TO) -> tuple[int, ...]:
    """Cluster sizes whose intra all-reduce time is a tau candidate: all up to `all_up_to`
    (exact there), then doubling, and the cap (the ring time flattens at 2n/B as p grows)."""
    out = list(range(1, min(cap, all_up_to) + 1))
    p = all_up_to * 2
    while p < cap:
        out.append(p)
        p *= 2
    if cap not in out:
        out.append(cap)
    return tuple(out)


def _time_key(ch: _Choice) -> tuple[float, float, int, tuple[str, ...], tuple[int, ...]]:
    return (ch.time, ch.cost, len(ch.alloc.names), ch.alloc.names, ch.alloc.gpus)


def _cost_key(ch: _Choice) -> tuple[float, float, int, tuple[str, ...], tuple[int, ...]]:
    return (ch.cost, ch.time, len(ch.alloc.names), ch.alloc.names, ch.alloc.gpus)


_Point = tuple[float, float, float, tuple[int, ...]]
"""A partial allocation of `_dp_allocs`: rate, price, tau, GPUs per member."""


def _pareto(pts: list[_Point]) -> list[_Point]:
    """Points not dominated in (rate up, price down, tau down); duplicates keep the first."""
    pts = sorted(pts, key=lambda p: (-p[0], p[1], p[2], p[3]))
    out: list[_Point] = []
    for p in pts:
        if not any(q[0] >= p[0] and q[1] <= p[1] and q[2] <= p[2] for q in out):
            out.append(p)
    return out


def _link_time(snap: Snapshot, a: str, b: str, nbytes: float) -> float:
    lk = snap.link(a, b)
    if lk is None:
        return _INF
    return lk.rtt_ms / 2000.0 + nbytes / (lk.bandwidth_gbps * 1e9 / 8)


# --- public entry points ---------------------------------------------------------------------


def plan(
    snapshot: Snapshot,
    job: JobRequest,
    objective: Objective = "time",
    efficiency: Mapping[str, float] | None = None,
    preempt: bool = True,
    steps_factors: Mapping[str, float] | None = None,
    slack: float = SLACK,
    release: Release = release_gpus,
) -> PlanResult:
    """Best placement, compression and sync for `job` on `snapshot`, or why there is none.

    Objectives: "time" (fastest), "cost" (cheapest), "cost-within-deadline" (cheapest that
    meets qos.deadline_s, which it requires). Deadline and budget are hard limits under every
    objective. An ordered `job.preference` is tried prefix by prefix (first cluster alone, the
    first two, ...) before all eligible clusters. When the job does not fit for lack of GPUs
    and outranks preemptible running jobs, the fewest, then cheapest, victims are named; when
    it does not fit for lack of bandwidth (no path, or none fast enough for its deadline),
    the same of the jobs holding WAN rates (`bandwidth_victims`). `release` gives the world
    as it would be without the victims: the caller's, where it knows the datacenters' ports.
    `steps_factors`: sync modes' statistical efficiency fitted from observed runs (`CostModel`).
    `slack`: of the choices within this fraction of the best by the objective, the least lossy
    is taken (`grammar.quality`; 0: the best by the objective, ties to the least lossy).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if objective == "cost-within-deadline" and job.qos.deadline_s is None:
        raise ValueError("qos.deadline_s: objective cost-within-deadline needs a deadline")
    model = CostModel(snapshot, job, efficiency, steps_factors)
    result = _plan_free(model, job, objective, slack)
    if isinstance(result, Plan) or not preempt:
        return result
    if result.constraint == "capacity":
        cands = preemption_candidates(snapshot, job)
    elif result.constraint in BANDWIDTH_BOUND:
        cands = bandwidth_victims(snapshot, job)
    else:
        return result
    victims_plan = _plan_with_preemption(
        snapshot, job, objective, efficiency, steps_factors, slack, cands, release
    )
    return victims_plan if victims_plan is not None else result


def _plan_free(
    model: CostModel, job: JobRequest, objective: Objective, slack: float = SLACK
) -> PlanResult:
    snapshot = model.snapshot
    gmin, gmax = job.min_gpus, job.max_gpus
    left = quota_left(snapshot, job.tenant)
    if left is not None and left < gmax:
        if left < gmin:
            return Infeasible(
                "quota",
                f"tenant {job.tenant!r} has {left} GPUs left of its quota "
                f"{snapshot.quota(job.tenant)}; the job needs at least {gmin}",
            )
        gmax = left
    excluded = exclusions(snapshot, job)
    if job.qos.regions is None and job.data_clusters is None:
        eligible = list(snapshot.open_clusters)  # the same names, kept up to date per copy
    else:
        eligible = [c.name for c in snapshot.clusters if c.name not in excluded]
    notes = _exclusion_notes(excluded)
    if job.data_clusters is not None:
        missing = _data_missing(snapshot, job, excluded, gmax)
        if missing is not None:
            return missing

    attempts: list[list[str]] = []
    pref = [n for n in job.preference if n in snapshot.by_name]
    if pref:
        ok = [n for n in pref if n not in excluded]
        for k in range(1, len(ok) + 1):
            attempts.append(ok[:k])
    attempts.append(eligible)

    last: _Search | None = None
    for cands in attempts:
        search = _Search(model, job, objective, gmin, gmax)
        search.run(cands)
        last = search
        if search.best is not None and search.ok(search.best):
            extra: tuple[str, ...] = ()
            if pref and cands is not eligible:
                extra = (f"preference: used the first {len(cands)} preferred cluster(s)",)
            elif pref:
                extra = ("preference: the preferred clusters alone could not take the job",)
            chosen, why = _least_lossy(model, search, search.best, slack)
            return _to_plan(model, search, chosen, notes + extra + why)
    assert last is not None
    return _diagnose(model, job, last, eligible, excluded, notes, gmin, gmax)


def _data_missing(
    snapshot: Snapshot, job: JobRequest, excluded: Mapping[str, str], gmax: int
) -> Infeasible | None:
    """Local data is trained where it lives: every cluster holding a share must take part;
    why one cannot (unknown, DOWN, cordoned, full), or too few GPUs to cover them all."""
    held = job.data_clusters or ()
    for name in held:
        if name not in snapshot.by_name:
            return Infeasible(
                "data", f"data.clusters: {name!r} holds a share of the data but is no cluster"
            )
        if name in excluded:
            return Infeasible(
                "data",
                f"data.clusters: {name!r} holds a share of the data and is {excluded[name]}; "
                "the job waits for it (each share trains where it lives)",
            )
    if gmax < len(held):
        return Infeasible(
            "data",
            f"data.clusters: {len(held)} clusters hold the data, the job may use {gmax} GPUs; "
            "ask for at least one GPU a cluster",
        )
    return None


def _exclusion_notes(excluded: dict[str, str], limit: int = 10) -> tuple[str, ...]:
    """One line per excluded cluster, or one per reason (with a count) when there are many."""
    if len(excluded) <= limit:
        return tuple(f"excluded {n}: {why}" for n, why in sorted(excluded.items()))
    by_why: dict[str, list[str]] = {}
    for n, why in sorted(excluded.items()):
        by_why.setdefault(why, []).append(n)
    return tuple(
        f"excluded {len(ns)} cluster(s), {why}: {', '.join(ns[:5])}{', ...' if len(ns) > 5 else ''}"
        for why, ns in sorted(by_why.items())
    )


def _diagnose(
    model: CostModel,
    job: JobRequest,
    search: _Search,
    eligible: list[str],
    excluded: dict[str, str],
    notes: tuple[str, ...],
    gmin: int,
    gmax: int,
) -> Infeasible:
    snap = model.snapshot
    if search.best is not None:
        dl = job.qos.deadline_s
        if dl is not None and search.fastest is not None and search.fastest.time > dl:
            return Infeasible(
                "deadline",
                f"the fastest plan takes {search.fastest.time:.0f} s, over qos.deadline_s={dl:g}",
                _to_plan(model, search, search.fastest, notes),
                notes,
            )
        c = search.cheapest_in_time
        cost = f"{c.cost:.2f}" if c is not None else "?"
        return Infeasible(
            "budget",
            f"the cheapest plan{' within the deadline' if dl else ''} costs {cost}, "
            f"over qos.max_cost={job.qos.max_cost:g}",
            _to_plan(model, search, c, notes) if c is not None else None,
            notes,
        )
    free_ok = sum(snap.by_name[n].gpus_free for n in eligible)
    if free_ok < gmin:
        state_free = sum(
            c.gpus_free for c in snap.clusters if excluded.get(c.name) not in ("DOWN", "cordoned")
        )
        region_free = sum(c.gpus_free for c in snap.clusters if c.schedulable)
        if job.qos.regions is not None and region_free >= gmin > free_ok:
            return Infeasible(
                "regions",
                f"only {free_ok} free GPUs in regions {', '.join(job.qos.regions)}; "
                f"the job needs {gmin}",
                None,
                notes,
            )
        if state_free < gmin <= sum(c.gpus_free for c in snap.clusters):
            return Infeasible(
                "capacity",
                f"{free_ok} free GPUs on READY uncordoned clusters; the job needs {gmin} "
                "(the rest are on DOWN or cordoned clusters)",
                None,
                notes,
            )
        return Infeasible(
            "capacity", f"{free_ok} free GPUs where the job may run; it needs {gmin}", None, notes
        )
    if job.qos.max_clusters is not None:
        relaxed = _Search(model, _replace_qos(job, max_clusters=None), "time", gmin, gmax)
        relaxed.run(eligible)
        if relaxed.best is not None:
            return Infeasible(
                "max_clusters",
                f"the job needs more than qos.max_clusters={job.qos.max_clusters} clusters "
                f"to get {gmin} GPUs",
                None,
                notes,
            )
    full = sorted(
        f"{way}link of {port.cluster}"
        for port in snap.ports
        if port.cluster in eligible
        for way, gbps in (("up", port.up_gbps), ("down", port.down_gbps))
        if gbps is not None and gbps <= 0
    )
    if full:  # its paths are left out of the snapshot (`Snapshot.ports`): nothing free
        return Infeasible(
            "links",
            f"no set of pairwise-linked clusters has {gmin} free GPUs: the "
            f"{', '.join(full)} {'has' if len(full) == 1 else 'have'} no bandwidth left",
            None,
            notes,
        )
    return Infeasible(
        "links",
        f"no set of pairwise-linked clusters has {gmin} free GPUs; add links between clusters",
        None,
        notes,
    )


def _replace_qos(job: JobRequest, **changes: object) -> JobRequest:
    return replace(job, qos=replace(job.qos, **changes))  # type: ignore[arg-type]


def _plan_with_preemption(
    snapshot: Snapshot,
    job: JobRequest,
    objective: Objective,
    efficiency: Mapping[str, float] | None,
    steps_factors: Mapping[str, float] | None,
    slack: float,
    cands: list[RunningJob],
    release: Release,
) -> Plan | None:
    """Fewest victims first; among equally many, the cheapest set to stop."""
    tried = 0
    for k in range(1, len(cands) + 1):
        sets = sorted(
            itertools.combinations(cands, k),
            key=lambda vs: (sum(preemption_cost(snapshot, v) for v in vs), [v.id for v in vs]),
        )
        for vs in sets:
            tried += 1
            if tried > MAX_VICTIM_SETS:
                return None
            freed = release(snapshot, vs)
            model = CostModel(freed, job, efficiency, steps_factors)
            result = _plan_free(model, job, objective, slack)
            if isinstance(result, Plan):
                ids = tuple(v.id for v in vs)
                why = (
                    f"preempts {', '.join(ids)} (priority < {job.qos.priority}, preemptible; "
                    f"{k} job(s), stop cost {sum(preemption_cost(snapshot, v) for v in vs):.2f})",
                )
                return replace(result, victims=ids, explanation=result.explanation + why)
    return None


def _quality(model: CostModel, ch: _Choice) -> float:
    return model.quality(ch.compression, ch.sync)


def _least_lossy(
    model: CostModel, search: _Search, best: _Choice, slack: float = SLACK
) -> tuple[_Choice, tuple[str, ...]]:
    """Quality is part of the objective: of every (compression, sync) on the best allocation
    of each cluster set searched, within the rules and within `SLACK` of the best by the
    objective, the least lossy (`grammar.quality`); and the line saying what it cost."""
    by_time = search.objective == "time"

    def measure(ch: _Choice) -> float:
        return ch.time if by_time else ch.cost

    # where the best is itself too lossy to count (`MAX_COST`), every set may hold the pick
    limit = measure(best) * (1.0 + slack) if _quality(model, best) <= MAX_COST else _INF
    options = [best]
    for names, top in search.runner_up.items():
        if measure(top) > limit:
            continue  # its best is already outside the slack: so are its other choices
        a = top.alloc
        combos = search.combos(names)
        times, costs = model.score_set(names, combos, [(a.rate, a.intra, a.price, sum(a.gpus))])
        for (comp, sync), t, c in zip(combos, times, costs, strict=True):
            ch = _Choice(a, comp, sync, t, c)
            if search.ok(ch):
                options.append(ch)

    def rank(ch: _Choice) -> tuple[object, ...]:  # of equals: resilient, then lighter
        key = search.key(ch)
        return (resilience(ch.sync), *key[:2], model.compressor(ch.compression).ratio, *key[2:])

    chosen = least_lossy(options, measure, lambda ch: _quality(model, ch), slack, rank)
    q, qb = _quality(model, chosen), _quality(model, best)
    unit = "s" if by_time else "$"
    if (chosen.compression, chosen.sync) == (best.compression, best.sync):
        if q <= 0:
            return chosen, ("quality: lossless (quality cost 0 %)",)
        return chosen, (
            f"quality: {best.compression} / {best.sync} costs {q:.0%} in quality (about "
            f"{1 + q:.2f}x the steps to match lossless every-step); no less lossy option is "
            f"within {slack:.0%} of it",
        )
    why = (
        f"within the {slack:.0%} slack"
        if limit < _INF
        else f"that one too lossy to count (over {MAX_COST:.0%})"
    )
    return chosen, (
        f"quality: {chosen.compression} / {chosen.sync} (quality cost {q:.0%}) over the "
        f"{'fastest' if by_time else 'cheapest'} {best.compression} / {best.sync} on "
        f"{'+'.join(best.alloc.names)} (quality cost {qb:.0%}): {measure(chosen):.4g} {unit} "
        f"against {measure(best):.4g} {unit}, {why}",
    )


def _to_plan(model: CostModel, search: _Search, ch: _Choice, notes: tuple[str, ...]) -> Plan:
    placement = tuple(Assignment(n, g) for n, g in zip(ch.alloc.names, ch.alloc.gpus, strict=True))
    est = model.estimate(placement, ch.compression, ch.sync)
    return Plan(
        placement=placement,
        compression=ch.compression,
        sync=ch.sync,
        estimate=est,
        objective=search.objective,
        explanation=_explain(model, search, ch, est) + notes,
    )


def _fmt_gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def _explain(model: CostModel, search: _Search, ch: _Choice, est: Estimate) -> tuple[str, ...]:
    snap = model.snapshot
    lines = [
        f"{len(ch.alloc.names)} cluster(s), {sum(ch.alloc.gpus)} GPUs: "
        + ", ".join(f"{n} x{g}" for n, g in zip(ch.alloc.names, ch.alloc.gpus, strict=True))
        + f"; objective {search.objective}",
        f"step {est.step_time_s:.4g} s = compute {est.compute_s:.4g} s, intra all-reduce "
        f"{est.intra_s:.4g} s, WAN {est.wan_s:.4g} s, compression {est.overhead_s:.4g} s "
        f"(the exchange after the backward pass, as the runtime runs it)"
        + (
            "; per global batch of samples: the fast clusters' extra steps divide it"
            if len(ch.alloc.names) > 1
            and model.sync(ch.sync).runs_ahead
            and model.speeds_differ(ch.alloc.names)
            else ""
        ),
    ]
    if est.bottleneck is not None:
        a, b = est.bottleneck
        lk = snap.link(a, b)
        assert lk is not None
        cm = model.compressor(ch.compression)
        if est.tree:
            parents = dict(est.tree)
            root = next(p for p in parents.values() if p not in parents)
            depth = len(tree_levels(parents))
            n = len(ch.alloc.names)
            kind = "hub" if depth == 1 and n > 3 else "tree"
            shape = (
                f"WAN {kind} all-reduce from {root} ("
                + ", ".join(f"{c} under {p}" for c, p in est.tree)
                + f"): {2 * depth} hops an exchange against the ring's {2 * (n - 1)}, "
                + (
                    "faster here (latency outweighs sending whole copies)"
                    if kind == "tree"
                    else "faster here (no link between two spokes is used)"
                )
            )
        else:
            shape = f"WAN ring {' -> '.join(est.ring)}"
        lines.append(
            f"{shape}; slowest link {a}->{b} "
            f"{lk.bandwidth_gbps:g} Gb/s, {lk.rtt_ms:g} ms RTT; {ch.compression} sends "
            f"{cm.ratio:.3g} of {_fmt_gb(model.nbytes)} per exchange; sync {ch.sync}"
        )
    lines.extend(_explain_sync(model, search, ch, est))
    alts = sorted(
        (c for n, c in search.runner_up.items() if n != ch.alloc.names),
        key=search.rank,
    )[:ALTERNATIVES]
    for alt in alts:
        word = (
            "as fast"
            if abs(alt.time - ch.time) <= 1e-9 * ch.time
            else ("slower" if alt.time > ch.time else "faster")
        )
        lines.append(
            "alternative "
            + "+".join(alt.alloc.names)
            + f" ({alt.compression}, {alt.sync}): {alt.time:.4g} s total "
            f"({alt.time / ch.time:.2f}x, {word}), cost {alt.cost:.4g}"
            + ("" if search.ok(alt) else " — breaks deadline or budget")
        )
    return tuple(lines)


def _explain_sync(model: CostModel, search: _Search, ch: _Choice, est: Estimate) -> tuple[str, ...]:
    """Why this sync mode: the pace the slowest cluster sets, whether running ahead or gossip
    paid for its quality penalty, against the best choice with the plain modes."""
    names = ch.alloc.names
    if len(names) < 2:
        return ()
    slow, ticks = model.pace(names)
    slowest = min(names, key=lambda n: (model.rate[n], n))
    fastest = max(names, key=lambda n: (model.rate[n], n))
    ratio = model.rate[fastest] / slow
    sm = model.sync(ch.sync)
    lines: list[str] = []
    if ratio > 1.0 + 1e-9:
        lines.append(
            f"speeds differ: a GPU of {fastest} is {ratio:.2g}x one of {slowest}; "
            + (
                f"under {ch.sync} the batch is split equally per worker and the faster "
                f"clusters take up to "
                f"{max(ticks.values())} steps per step of {slowest} "
                f"(bound {SPEED_BOUND}; {', '.join(f'{n} x{ticks[n]}' for n in names)}), "
                f"{model.ahead_rate(names, ch.alloc.gpus) / (sum(ch.alloc.gpus) * slow):.2f}x "
                "the samples per second"
                if sm.runs_ahead
                else (
                    "the batch is split by throughput ("
                    + ", ".join(f"{n} {v:.0%}" for n, v in est.batch_shares)
                    + "), so no cluster waits on another"
                )
                if splits_by_rate(sm)
                else f"under {ch.sync} the batch is split equally per worker (a split would "
                f"change what each cluster's local steps learn from), so {slowest} sets the "
                "pace of every step"
            )
        )
    if sm.neighbours:
        graph = model.gossip_graph(names)  # the graph `CostModel.gossip_wan` priced
        lines.append(
            ("links uneven: " if model.uneven(names) else "")
            + f"{ch.sync} exchanges only with its neighbours in the gossip graph (degree "
            + ", ".join(f"{n} {len(graph[n])}" for n in names)
            + f"; the bandwidth-ordered ring {' -> '.join(est.ring)} plus the chords at least "
            "half as fast as its slowest edge), one round of the graph's slowest edge "
            "instead of a ring all-reduce's 2(D-1)"
        )
    if search.job.sync != "auto":
        return tuple(lines)
    plain = [
        (c, s)
        for c, s in search.multi
        if not (model.sync(s).runs_ahead or model.sync(s).neighbours)
    ]
    if sm.runs_ahead or sm.neighbours:
        g = sum(ch.alloc.gpus)
        best_plain = min(
            (
                model.score(names, ch.alloc.rate, ch.alloc.intra, ch.alloc.price, c, s, g)[
                    0 if search.objective == "time" else 1
                ],
                c,
                s,
            )
            for c, s in plain
        )
        mine = ch.time if search.objective == "time" else ch.cost
        what = "time" if search.objective == "time" else "cost"
        lines.append(
            f"sync auto chose {ch.sync} (quality penalty x{sm.steps_factor:.3g} steps): its "
            f"{what} is {mine / best_plain[0]:.2f}x that of the best plain mode here "
            f"({best_plain[2]} with {best_plain[1]})"
        )
    elif model.speeds_differ(names) or model.uneven(names):
        lines.append(
            f"sync auto kept {ch.sync}: partial/async-ps"
            + ("/gossip" if model.uneven(names) else "")
            + " did not pay for their quality penalty here"
        )
    return tuple(lines)


def evaluate(
    snapshot: Snapshot,
    job: JobRequest,
    placement: Iterable[Assignment],
    objective: Objective = "time",
    efficiency: Mapping[str, float] | None = None,
    steps_factors: Mapping[str, float] | None = None,
    slack: float = SLACK,
) -> PlanResult:
    """The plan for a given placement: the compression and sync the planner would pick for it
    (the least lossy within `slack` of its best), its estimate, or Infeasible naming the
    first rule it breaks."""
    pl = tuple(placement)
    bad = check_placement(snapshot, job, pl)
    if bad is not None:
        return bad
    model = CostModel(snapshot, job, efficiency, steps_factors)
    search = _Search(model, job, objective, sum(a.gpus for a in pl), sum(a.gpus for a in pl))
    order = sorted(pl, key=lambda a: a.cluster)
    names = tuple(a.cluster for a in order)
    alloc = search._alloc(names, tuple(a.gpus for a in order))
    for comp, sync in search.combos(names):
        est = model.estimate_parts(
            names, alloc.rate, alloc.intra, alloc.price, comp, sync, sum(alloc.gpus)
        )
        search._record(_Choice(alloc, comp, sync, est.total_time_s, est.cost))
    best = search.best
    assert best is not None
    why: tuple[str, ...] = ()
    if search.ok(best):
        search.runner_up[names] = best
        best, why = _least_lossy(model, search, best, slack)
    result = _to_plan(model, search, best, why)
    if not search.ok(best):
        dl, mc = job.qos.deadline_s, job.qos.max_cost
        if (
            dl is not None
            and best.time > dl
            and (search.fastest is not None and search.fastest.time > dl)
        ):
            return Infeasible(
                "deadline", f"takes {best.time:.0f} s, over qos.deadline_s={dl:g}", result
            )
        return Infeasible("budget", f"costs {best.cost:.2f}, over qos.max_cost={mc:g}", result)
    return result


def _share_rule(job: JobRequest, c: Cluster, a: Assignment) -> Infeasible | None:
    """The first rule one share of a given placement breaks, or None."""
    if a.gpus < 1:
        return Infeasible("placement", f"cluster {a.cluster!r}: gpus must be >= 1")
    if c.state == ClusterState.DOWN:
        return Infeasible("cluster_state", f"cluster {a.cluster!r} is DOWN")
    if c.cordoned:
        return Infeasible("cluster_state", f"cluster {a.cluster!r} is cordoned")
    if job.qos.regions is not None and c.region not in job.qos.regions:
        return Infeasible("regions", f"cluster {a.cluster!r} is in {c.region}, not in qos.regions")
    if job.data_clusters is not None and a.cluster not in job.data_clusters:
        return Infeasible(
            "data",
            f"cluster {a.cluster!r} does not hold the job's data (data: local, in "
            f"{', '.join(job.data_clusters)}); place it only there",
        )
    if a.gpus > c.gpus_free:
        return Infeasible(
            "capacity", f"cluster {a.cluster!r} has {c.gpus_free} free GPUs, not {a.gpus}"
        )
    return None


def check_placement(snapshot: Snapshot, job: JobRequest, pl: Placement) -> Infeasible | None:
    """The first rule a given placement breaks, or None."""
    if not pl:
        return Infeasible("placement", "the placement is empty; list at least one cluster")
    seen: set[str] = set()
    for a in pl:
        c = snapshot.by_name.get(a.cluster)
        if c is None:
            return Infeasible("placement", f"cluster {a.cluster!r} is not in the snapshot")
        if a.cluster in seen:
            return Infeasible("placement", f"cluster {a.cluster!r} is listed twice")
        seen.add(a.cluster)
        broken = _share_rule(job, c, a)
        if broken is not None:
            return broken
    lacking = sorted(set(job.data_clusters or ()) - seen)
    if lacking:
        return Infeasible(
            "data",
            f"data.clusters: {', '.join(lacking)} hold(s) a share of the job's data (data: "
            "local) and must take part",
        )
    total = sum(a.gpus for a in pl)
    if not job.min_gpus <= total <= job.max_gpus:
        want = (
            str(job.min_gpus) if job.min_gpus == job.max_gpus else f"{job.min_gpus}..{job.max_gpus}"
        )
        return Infeasible("gpus", f"the placement has {total} GPUs; the job needs {want} (gang)")
    if job.qos.max_clusters is not None and len(pl) > job.qos.max_clusters:
        return Infeasible(
            "max_clusters", f"{len(pl)} clusters, over qos.max_clusters={job.qos.max_clusters}"
        )
    names = [a.cluster for a in pl]
    if not is_clique(snapshot, names):
        return Infeasible("links", "some clusters in the placement have no link between them")
    left = quota_left(snapshot, job.tenant)
    if left is not None and total > left:
        return Infeasible(
            "quota", f"tenant {job.tenant!r} has {left} GPUs left of its quota, not {total}"
        )
    return None
