"""Sync modes behind one interface: the registry builds each mode's class, and a strategy this
test defines runs through the real `Worker` loop (real processes, real gloo groups) without a
change to `training/worker.py`.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from grammar import Sync, SyncKind, parse_sync
from training.collective import Collective, flatten
from training.data import batch_indices, shard
from training.spec import TrainSpec
from training.sync import (
    AdaptiveSync,
    AutoSync,
    EveryStepSync,
    LocalSGDSync,
    PartialSync,
    Scope,
    StaleSync,
    StreamingSync,
    SyncContext,
    SyncStrategy,
    make_sync_strategy,
    register_sync_strategy,
)
from training.sync.streaming import fragment_offsets, fragments_due
from training.tasks import as_tensors, load_task
from training.worker import free_port

MLP = "builtin:mnist1d-mlp"


def _context(spec: TrainSpec) -> SyncContext:
    """One rank, one cluster: enough to build any strategy (no collective is called)."""
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    comm = Collective(
        rank=0,
        ranks_cluster=["a"],
        intra=None,
        leaders=None,
        names=[n for n, _ in model.named_parameters()],
        shapes=[p.shape for p in params],
        device=torch.device("cpu"),
        links=None,
    )
    return SyncContext(spec, comm, model, params, apply=lambda flat: None, cluster_share=1.0)


@pytest.mark.parametrize(
    ("value", "cls", "scope", "exchanges_gradients"),
    [
        ("every-step", EveryStepSync, Scope.GLOBAL, True),
        ("local-sgd:4", LocalSGDSync, Scope.CLUSTER, False),
        ("diloco:4", LocalSGDSync, Scope.CLUSTER, False),
        ("stale:2", StaleSync, Scope.GLOBAL, True),  # one cluster: nothing to be stale about
        ("adaptive", AdaptiveSync, Scope.GLOBAL, True),
        ("streaming:8:f2:d3", StreamingSync, Scope.CLUSTER, False),
        ("auto", AutoSync, Scope.CLUSTER, False),  # its warm-up: local SGD
    ],
)
def test_registry_builds_each_mode(
    value: str, cls: type[SyncStrategy], scope: Scope, exchanges_gradients: bool
) -> None:
    spec = TrainSpec(sync=value, compression="int8")
    strategy = make_sync_strategy(parse_sync(value), _context(spec))
    assert type(strategy) is cls
    assert strategy.scope is scope and strategy.exchanges_gradients is exchanges_gradients
    assert str(strategy.compression) == ("none" if cls is AdaptiveSync else "int8")
    strategy.close()


def test_registry_refuses_double_registration() -> None:
    with pytest.raises(ValueError, match="already has a strategy"):
        register_sync_strategy(SyncKind.EVERY_STEP, EveryStepSync)


def test_local_sgd_is_at_a_sync_point_every_period_and_at_the_end() -> None:
    spec = TrainSpec(sync="local-sgd:4", steps=10)
    strategy = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    assert [s for s in range(1, 11) if strategy.at_sync_point(s)] == [4, 8, 10]


def _same_outer(late: LocalSGDSync | StreamingSync, here: LocalSGDSync | StreamingSync) -> None:
    """Bitwise the same anchors and outer momentum: what a member seated late must hold."""
    for mine, theirs in zip(late.anchor, here.anchor, strict=True):
        assert torch.equal(mine, theirs)
    assert all(
        torch.equal(late.outer.state[a]["momentum_buffer"], here.outer.state[b]["momentum_buffer"])
        for a, b in zip(late.anchor, here.anchor, strict=True)
    )


def test_local_sgd_seats_a_late_member_that_replays_the_rounds_it_sat_out_exactly() -> None:
    """A member that joined late takes each outer step's sum while its state is on its way
    (`defer`), then the state as of its joining, then the kept sums (`replay`): it ends with
    the anchor, parameters and outer momentum of a member that was there all along, bitwise."""
    import copy

    spec = TrainSpec(sync="diloco:4", steps=10)
    here = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    late = make_sync_strategy(parse_sync(spec.sync), _context(spec))  # other random weights
    assert isinstance(here, LocalSGDSync) and isinstance(late, LocalSGDSync)
    assert [here.seats_at(s) for s in (0, 3, 4, 9)] == [4, 4, 8, 10]
    gen = torch.Generator().manual_seed(0)
    sums = [torch.randn(8, generator=gen) for _ in range(3)]  # Linear(3, 2): 6 + 2 values
    here._move_anchor(sums[0], average=False)  # momentum of its own before the join
    joined_with = copy.deepcopy(here.state_dict())
    late.defer()
    for who in (here, late):
        who._move_anchor(sums[1], average=False)
        who._move_anchor(sums[2], average=True)  # the run's last step: the plain average
    with torch.no_grad():  # the peer's model (the Worker loads it before the sync state)
        for p, a in zip(late.ctx.params, joined_with["anchor"], strict=True):
            p.copy_(a)
    late.load_state_dict(joined_with, None)
    late.replay()
    _same_outer(late, here)
    for mine, theirs in zip(late.ctx.params, here.ctx.params, strict=True):
        assert torch.equal(mine, theirs)


def test_partial_seats_a_late_member_on_the_steps_of_the_rounds_it_sat_out() -> None:
    """Partial seats a newcomer at the round's end as local SGD does; the local steps per
    step it trains on then are those the rounds it took part in decided (every leader
    computes the same), not those of the older state it took."""
    spec = TrainSpec(sync="partial:4", steps=10)
    source = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    late = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    fresh = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    assert isinstance(source, PartialSync) and isinstance(late, PartialSync)
    assert isinstance(fresh, PartialSync)
    assert [source.seats_at(s) for s in (0, 3, 4, 9)] == [4, 4, 8, 10]
    source.steps = {"a": 3}
    state = source.state_dict()
    late.defer()
    late.steps = {"a": 2}  # what the round it sat out decided
    late.load_state_dict(state, None)
    late.replay()
    assert late.steps == {"a": 2}
    fresh.load_state_dict(state, None)  # one that waited for the state takes its steps
    assert fresh.steps == {"a": 3}


def test_auto_seats_a_late_member_as_its_running_mode_and_decides_nothing_meanwhile() -> None:
    """A control-plane auto job running local SGD seats a newcomer at the round's end as
    local SGD does (its rounds kept by the running mode), and re-decides nothing while the
    newcomer sits out: a mode switched then would not be the one its kept rounds are of."""
    spec = TrainSpec(sync="local-sgd:4", compression="int8", adapt=("sync", "compression"))
    auto = make_sync_strategy(Sync(SyncKind.AUTO), _context(spec))  # as the worker makes it
    assert isinstance(auto, AutoSync) and isinstance(auto.inner, LocalSGDSync)
    assert [auto.seats_at(s) for s in (0, 3, 4)] == [4, 4, 8]
    assert auto._observe_now(3)  # a round's end: the policy looks at what it measured
    auto.sitting_out(True)
    auto.defer()
    assert auto.inner.kept == []
    assert not auto._observe_now(3) and not auto._observe_now(7)
    auto.sitting_out(False)
    assert auto._observe_now(7)
    streaming = TrainSpec(sync="streaming:8", compression="int8", adapt=("compression",))
    assert make_sync_strategy(Sync(SyncKind.AUTO), _context(streaming)).seats_at(3) == 8
    lockstep = TrainSpec(sync="every-step", compression="int8", adapt=("compression",))
    waits = make_sync_strategy(Sync(SyncKind.AUTO), _context(lockstep))
    assert waits.seats_at(3) is None  # every-step: the members wait for the state


def test_streaming_seats_a_late_member_that_replays_what_the_others_applied_exactly() -> None:
    """A member that joined late at step 4 keeps each fragment's sum applied while its
    state is on its way; at its seat (the period's end, step 8) it takes the state as of its
    joining (with a fragment that was in flight then), applies that fragment and the kept
    sums in the others' order, and holds their anchors and outer momentum bitwise, its
    parameters its anchors; its own fragment in flight lands as theirs does."""
    import copy

    spec = TrainSpec(sync="streaming:4:f2:d1", steps=12)
    here = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    late = make_sync_strategy(parse_sync(spec.sync), _context(spec))  # other random weights
    assert isinstance(here, StreamingSync) and isinstance(late, StreamingSync)
    assert [here.seats_at(s) for s in (0, 4, 7, 9)] == [4, 8, 8, 12]
    gen = torch.Generator().manual_seed(0)

    def train(who: StreamingSync) -> None:
        with torch.no_grad():
            for p in who.ctx.params:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)

    for step in range(4):  # fragment 0 sent after 1, applied after 2; 1 sent after 3
        train(here)
        here.after_step(step)
    assert [(i.fragment, i.apply_at) for i in here.inflight] == [(1, 4)]
    state, cluster = copy.deepcopy(here.state_dict()), copy.deepcopy(here.cluster_state())
    late.defer()
    for step in range(4, 8):  # the others train; late sits out, in the same exchanges
        train(here)
        here.after_step(step)
        late.after_step(step)
        if late.inflight and late.inflight[-1].sent == step:  # the sum is the others'
            late.inflight[-1].result = here.inflight[-1].result.clone()  # type: ignore[union-attr]
    late.load_state_dict(state, cluster)
    late.replay()
    _same_outer(late, here)
    assert torch.equal(flatten([p.detach() for p in late.ctx.params]), torch.cat(late.anchor))
    assert [(i.fragment, i.apply_at) for i in late.inflight] == [(1, 8)]
    here.after_step(8)
    late.after_step(8)
    for mine, theirs in zip(late.anchor, here.anchor, strict=True):
        assert torch.equal(mine, theirs)


def test_streaming_staggers_its_fragments_over_the_period() -> None:
    # fragment p leaves after the steps s with s + 1 = (p + 1) H / F (mod H): F per period
    assert fragment_offsets(8, 4) == [2, 4, 6, 8]
    assert fragment_offsets(5, 2) == [2, 5]
    due = {s: fragments_due(s, 8, 4) for s in range(16)}
    assert {s: f for s, f in due.items() if f} == {
        1: [0],
        3: [1],
        5: [2],
        7: [3],
        9: [0],
        11: [1],
        13: [2],
        15: [3],
    }
    # one fragment is local SGD's schedule
    assert [s for s in range(12) if fragments_due(s, 4, 1)] == [3, 7, 11]


def test_streaming_checkpoints_anywhere_and_splits_the_model_evenly() -> None:
    spec = TrainSpec(sync="streaming:4:f3:d1", steps=10)
    strategy = make_sync_strategy(parse_sync(spec.sync), _context(spec))
    assert isinstance(strategy, StreamingSync)
    assert all(strategy.at_sync_point(s) for s in range(1, 11))
    assert strategy.bounds == [(0, 3), (3, 6), (6, 8)]  # Linear(3, 2): 6 weights + 2 biases
    assert [a.numel() for a in strategy.anchor] == [3, 3, 2]
    strategy.close()


def test_a_delayed_outer_step_drops_the_progress_made_meanwhile_and_the_end_averages() -> None:
    """One cluster, H=4, one fragment, delay 1, outer SGD lr 0.5 with momentum 0.5: the
    pseudo-gradient leaves after step 3 and is applied after step 4, replacing step 4's own
    progress (torchft's default); the last, partial period is averaged, not pushed through the
    outer momentum."""
    spec = TrainSpec(
        sync="streaming:4:f1:d1",
        steps=6,
        outer_lr=0.5,
        outer_momentum=0.5,
        outer_nesterov=False,
    )
    ctx = _context(spec)
    strategy = make_sync_strategy(parse_sync(spec.sync), ctx)
    strategy.load_state_dict(None, None)
    start = [p.detach().clone() for p in ctx.params]

    def inner_step() -> None:  # what a local optimizer step would do: +1 everywhere
        with torch.no_grad():
            for p in ctx.params:
                p.add_(1.0)

    def assert_at(offset: float) -> None:
        for p, s0 in zip(ctx.params, start, strict=True):
            torch.testing.assert_close(p.detach(), s0 + offset)

    for step in range(5):
        inner_step()
        strategy.after_step(step)
    # pseudo-gradient -4, momentum buffer -4: the anchor is start + 2; step 4's +1 is gone
    assert_at(2.0)
    inner_step()
    strategy.after_step(5)
    assert_at(3.0)
    # the final sync: pseudo-gradient -1 averaged, so start + 3 (an outer step would add the
    # momentum's 0.5 x 0.5 x -4 on top: start + 3.5)
    strategy.finish()
    assert_at(3.0)
    strategy.close()


def test_local_sgds_last_partial_period_is_averaged_not_an_outer_step() -> None:
    """One cluster, H=4, 6 steps, outer SGD lr 0.25 with momentum 0.5: a full period moves the
    anchor by the outer step, the last two steps' progress is averaged in as it is."""
    spec = TrainSpec(
        sync="local-sgd:4", steps=6, outer_lr=0.25, outer_momentum=0.5, outer_nesterov=False
    )
    ctx = _context(spec)
    strategy = make_sync_strategy(parse_sync(spec.sync), ctx)
    strategy.load_state_dict(None, None)
    start = [p.detach().clone() for p in ctx.params]
    for step in range(6):
        with torch.no_grad():
            for p in ctx.params:
                p.add_(1.0)
        strategy.after_step(step)
        if step == 3:  # pseudo-gradient -4 at lr 0.25
            for p, s0 in zip(ctx.params, start, strict=True):
                torch.testing.assert_close(p.detach(), s0 + 1.0)
    # + 2 averaged in; an outer step would give start + 1 + 0.25 x (0.5 x 4 + 2) = start + 2
    for p, s0 in zip(ctx.params, start, strict=True):
        torch.testing.assert_close(p.detach(), s0 + 3.0)
    strategy.close()


def test_outer_settings_reach_the_outer_optimizer() -> None:
    for value in ("local-sgd:4", "streaming:4"):
        spec = TrainSpec(sync=value, outer_lr=0.5, outer_momentum=0.8, outer_nesterov=False)
        strategy: Any = make_sync_strategy(parse_sync(value), _context(spec))
        group = strategy.outer.param_groups[0]
        assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.8, False)
        spec = TrainSpec(sync=value, outer_momentum=0.0)  # Nesterov needs a momentum
        strategy = make_sync_strategy(parse_sync(value), _context(spec))
        assert strategy.outer.param_groups[0]["nesterov"] is False
        strategy.close()


class NoExchange(SyncStrategy):
    """A mode cpn does not have: each cluster trains alone, nothing crosses the WAN."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.calls = {"after_backward": 0, "after_step": 0, "finish": 0}

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.calls["after_backward"] += 1
        self.comm.reduce(grad)
        return grad

    def after_step(self, step: int) -> None:
        self.calls["after_step"] += 1

    def finish(self) -> None:
        self.calls["finish"] += 1


def _rank(rank: int, ranks_cluster: list[str], port: int, steps: int, out: str) -> None:
    """One rank in its own process: plug NoExchange in, then the Worker's own loop."""
    from training.worker import Worker

    register_sync_strategy(SyncKind.EVERY_STEP, NoExchange, replace=True)
    spec = TrainSpec(task=MLP, clusters={"a": 1, "b": 1}, steps=steps, sync="every-step")
    worker = Worker(spec, rank, ranks_cluster, "lo")
    worker.setup("127.0.0.1", port, None)
    result = worker.run(steps, evaluate=False)
    strategy: Any = worker.strategy
    found = {
        "strategy": type(strategy).__name__,
        "calls": dict(strategy.calls),
        "step": result.step,
        "rounds": result.wan.rounds,
        "wan_bytes": result.wan.wan_bytes.total,
        "setup_bytes": result.wan.setup_bytes,
        "model": {k: v.clone() for k, v in worker.model.state_dict().items()},
    }
    worker.close()
    torch.save(found, Path(out) / f"rank{rank}.pt")


def _alone(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain training of one rank on its shard of each global batch, no other rank."""
    task = load_task(MLP)
    torch.manual_seed(0)
    model = task.model()
    opt = task.optimizer.build(model.parameters())
    x, y = as_tensors(task.train)
    for step in range(steps):
        mine = shard(batch_indices(len(x), task.batch_size, 0, step), rank, world)
        opt.zero_grad()
        task.loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return model.state_dict()


def test_a_new_strategy_plugs_into_the_real_worker_loop(tmp_path: Path) -> None:
    steps, ranks_cluster, port = 5, ["a", "b"], free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, ranks_cluster, port, steps, str(tmp_path)))
        for r in range(len(ranks_cluster))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"rank process ended with {p.exitcode}"
    found = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, f in enumerate(found):
        assert f["strategy"] == "NoExchange" and f["step"] == steps
        assert f["calls"] == {"after_backward": steps, "after_step": steps, "finish": 1}
        # nothing crossed but the start-up's digests (33 bytes a leader, not the model)
        assert f["rounds"] == 0 and f["wan_bytes"] == f["setup_bytes"] == 2 * 33
        want = _alone(rank, len(ranks_cluster), steps)  # each cluster trained on its own data
        for k, v in want.items():
            torch.testing.assert_close(f["model"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    # and the clusters really went separate ways
    assert not torch.equal(found[0]["model"]["0.weight"], found[1]["model"]["0.weight"])
