"""The memory model and the pipeline planner (pure functions)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grammar.parallel import Parallelism
from scheduler.memory import (
    SPLIT_KEPT,
    USABLE,
    Layer,
    ModelProfile,
    memory,
    plan_parallelism,
)
from scheduler.pipeline_cost import micro_batch_candidates
from scheduler.types import Cluster, Link

GB = 1e9


def _cluster(name: str, gpus: int = 1, model: str = "H100") -> Cluster:
    return Cluster(name, "r", model, gpus, 100.0, 1.0)


def _layer(name: str, params: float, act: float = 1e3, flops: float = 1e9) -> Layer:
    return Layer(name, int(params), flops, act, act)


def test_memory_counts_params_grads_optimizer_and_in_flight_activations() -> None:
    profile = ModelProfile((_layer("a", 1000, act=10), _layer("b", 500, act=20)), "adam")
    m = memory(profile, 0, 2, micro_batch=4, in_flight=3)
    assert (m.params, m.grads, m.optimizer) == (6000, 6000, 12000)
    assert m.activations == (10 + 20) * 4 * 3
    second = memory(profile, 1, 2, micro_batch=4, in_flight=1)  # keeps its received input
    assert second.activations == (20 + 10) * 4
    sgd = memory(ModelProfile(profile.layers, "sgd"), 0, 2, 1, 1)
    assert sgd.optimizer == 0 and sgd.total == 12000 + 30


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 64), st.integers(1, 8))
def test_activation_memory_is_linear_in_micro_batch_and_in_flight(
    mb: int, fl: int, mb2: int, fl2: int
) -> None:
    profile = ModelProfile.transformer(blocks=2, dim=64, seq=16, vocab=96)
    a = memory(profile, 1, 3, mb, fl).activations
    b = memory(profile, 1, 3, mb2, fl2).activations
    assert a * mb2 * fl2 == pytest.approx(b * mb * fl)


def test_unknown_optimizer_and_empty_model_are_refused() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        ModelProfile((_layer("a", 1),), "lion")
    with pytest.raises(ValueError, match="layer"):
        ModelProfile(())


def test_a_model_that_fits_one_gpu_stays_data_parallel() -> None:
    profile = ModelProfile.transformer(blocks=2, dim=256, seq=128, vocab=1000)
    plan = plan_parallelism(profile, [_cluster("a"), _cluster("b", model="T4")], [], batch=32)
    assert plan.parallelism is Parallelism.DATA
    assert plan.fits == ("a", "b") and "fits a, b" in plan.reason


def test_a_model_too_big_for_any_gpu_gets_the_fewest_stages_that_fit() -> None:
    # 4 layers of 1 G params: 16 GB each with Adam; GPUs of 40 GB usable hold two
    profile = ModelProfile(tuple(_layer(f"l{i}", 1e9) for i in range(4)))
    mem = {"a": 40 / USABLE, "b": 40 / USABLE}
    plan = plan_parallelism(
        profile, [_cluster("a", 4), _cluster("b", 4)], [Link("a", "b", 1.0, 10)], 16, mem
    )
    assert plan.parallelism is Parallelism.PIPELINE
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4)]
    assert [s.cluster for s in plan.stages] == ["a", "a"], "one cluster: no WAN hop"
    assert all(s.memory.total <= s.gpu_bytes for s in plan.stages)
    assert plan.bubble == pytest.approx(1 / (plan.micro_batches + 1))
    assert "fits" not in plan.reason.split(";")[0] and "2 stages" in plan.reason


def test_the_heaviest_activations_take_the_fattest_link() -> None:
    # three layers, one GPU each; the first cut carries 1000x what the second does
    profile = ModelProfile(
        (_layer("l0", 1e9, act=1e8), _layer("l1", 1e9, act=1e5), _layer("l2", 1e9))
    )
    clusters = [_cluster("z"), _cluster("y"), _cluster("x")]
    links = [Link("x", "y", 100.0, 1), Link("y", "z", 0.1, 1), Link("x", "z", 0.1, 1)]
    mem = {c.name: 20 / USABLE for c in clusters}
    plan = plan_parallelism(profile, clusters, links, 8, mem)
    assert len(plan.stages) == 3
    assert {plan.stages[0].cluster, plan.stages[1].cluster} == {"x", "y"}
    assert plan.stages[0].send_s < plan.stages[1].send_s * 100


def test_micro_batches_trade_the_bubble_against_their_fixed_cost() -> None:
    profile = ModelProfile(tuple(_layer(f"l{i}", 1e9, flops=1e12) for i in range(4)))
    clusters = [_cluster("a", 2)]
    mem = {"a": 40 / USABLE}
    cheap = plan_parallelism(profile, clusters, [], 64, mem, micro_overhead_s=0.0)
    dear = plan_parallelism(profile, clusters, [], 64, mem, micro_overhead_s=100.0)
    assert cheap.micro_batches == max(micro_batch_candidates(64, 2))
    assert dear.micro_batches == 1
    assert cheap.bubble < dear.bubble
    mid = plan_parallelism(profile, clusters, [], 64, mem, micro_overhead_s=0.05)
    assert 1 < mid.micro_batches < cheap.micro_batches


def test_nothing_fits_says_why() -> None:
    profile = ModelProfile((_layer("huge", 1e10),))
    with pytest.raises(ValueError, match="fits no pipeline"):
        plan_parallelism(profile, [_cluster("a", 8)], [], 8)
    with pytest.raises(ValueError, match="memory"):
        plan_parallelism(profile, [Cluster("a", "r", "X1", 1, 1.0, 1.0, gpu_tflops=1.0)], [], 8)
    with pytest.raises(ValueError, match="schedulable"):
        plan_parallelism(profile, [_cluster("a", 0)], [], 8)


def test_a_built_in_task_profiled_from_its_pieces_is_planned_into_stages() -> None:
    from training.stages import pieces, profile_pieces
    from training.tasks import as_tensors, load_task

    task = load_task("builtin:char-transformer")
    parts = pieces(task.model())
    x, _ = as_tensors(task.train)
    measured = profile_pieces(parts, x[:1])
    profile = ModelProfile(
        tuple(
            Layer(f"p{i}", m.params, m.flops, m.activation_bytes, m.stored_bytes)
            for i, m in enumerate(measured)
        )
    )
    assert profile.params == sum(q.numel() for q in task.model().parameters())
    whole = memory(profile, 0, len(parts), 1, 1).total
    mem = {"a": 0.7 * whole / GB / USABLE}  # no GPU holds the whole model
    plan = plan_parallelism(profile, [_cluster("a", 4)], [], 64, mem)
    assert plan.parallelism is Parallelism.PIPELINE and len(plan.stages) >= 2
    assert all(s.memory.total <= s.gpu_bytes for s in plan.stages)
    bounds = [s.layers for s in plan.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == len(parts)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def _blocks(n: int, params: float, heads: int, flops: float = 1e12) -> ModelProfile:
    """`n` splitting blocks of `params` each, between an embedding and a head that stay whole."""
    return ModelProfile(
        (
            _layer("embed", 1e6),
            *(Layer(f"b{i}", int(params), flops, 1e6, 1e6, heads) for i in range(n)),
            _layer("head", 1e6),
        )
    )


def test_a_split_holds_a_share_of_what_splits_and_all_of_what_does_not() -> None:
    profile = _blocks(2, 1e9, heads=8)
    half = profile.split(2)
    assert [x.params for x in half.layers] == [int(1e6), int(5e8), int(5e8), int(1e6)]
    assert half.layers[1].flops == pytest.approx(5e11)
    kept = half.layers[1].stored_bytes / profile.layers[1].stored_bytes
    assert kept == pytest.approx(SPLIT_KEPT + (1 - SPLIT_KEPT) / 2)
    assert half.layers[0] == profile.layers[0] and profile.split(1) is profile
    assert profile.splits(2) and profile.splits(8) and not profile.splits(3)
    assert not ModelProfile((_layer("a", 1),)).splits(2)  # nothing says how it splits


def test_a_model_too_big_for_a_gpu_splits_inside_one_cluster_before_crossing_the_wan() -> None:
    """4 blocks of 2 G parameters (128 GB with Adam) on 40 GB GPUs: a pipeline needs its
    activations over the slow WAN or a bubble; a 4-way split inside the 8-GPU cluster holds
    32 GB a GPU, pays its all-reduces on the fast links inside, and is planned, the others
    weighed and named."""
    profile = _blocks(4, 2e9, heads=8)
    clusters = [_cluster("a", 8), _cluster("b", 8)]
    mem = {"a": 40 / USABLE, "b": 40 / USABLE}
    plan = plan_parallelism(profile, clusters, [Link("a", "b", 0.1, 50)], 64, mem)
    assert plan.parallelism is Parallelism.TENSOR and plan.tensor >= 4
    assert len(plan.stages) == 1 and plan.stages[0].send_s == 0
    assert plan.stages[0].memory.total <= plan.stages[0].gpu_bytes
    assert "tensor parallel keeps it in one cluster" in plan.reason
    assert "weighed: " in plan.reason and "pipeline of" in plan.reason
    # a split divides the heads: 9 heads over 8 GPUs a cluster split 3 ways at most, which
    # holds no whole model on one cluster's groups of 3 (43 GB a GPU): stages of them (3D)
    odd = plan_parallelism(_blocks(4, 2e9, heads=9), clusters, [Link("a", "b", 0.1, 50)], 64, mem)
    assert odd.tensor in (1, 3) and len(odd.stages) > 1


def test_slow_links_inside_a_cluster_make_a_split_cost_more_than_it_saves() -> None:
    """The split's all-reduces are on every micro-batch: over a cluster whose own links are
    slow the planner keeps the layers whole (a pipeline inside the cluster)."""
    profile = _blocks(4, 2e9, heads=8, flops=1e9)
    slow = Cluster("a", "r", "H100", 8, 0.001, 1.0)
    plan = plan_parallelism(profile, [slow], [], 64, {"a": 40 / USABLE})
    assert plan.tensor == 1 and plan.parallelism is Parallelism.PIPELINE
