"""Pipeline and hybrid parallelism: pure parts (split, schedule, codec, grammar) and real Ray
runs that must equal single-process training of the same model on the same batches."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grammar.parallel import Parallelism, StageSplit, parse_parallelism, parse_stages
from tests.training.helpers import reference_run
from training.pipeline.codec import Codec, Header, decode, encode
from training.pipeline.driver import StagePool
from training.pipeline.schedule import Schedule, bubble_fraction, max_in_flight, stage_ops
from training.pipeline.spec import PipelineReport
from training.pipeline.split import Placement, balance, place
from training.stages import group, piece_costs, pieces, profile_pieces
from training.tasks import CharTransformer, load_task

# ---------------------------------------------------------------- pure parts


def test_char_transformer_pieces_compute_the_model_exactly() -> None:
    torch.manual_seed(0)
    model = CharTransformer(96, 16)
    x = torch.randint(0, 96, (3, 16))
    staged = torch.nn.Sequential(*group(pieces(model), (1, 2)))
    assert torch.equal(staged(x), model(x))
    ours = {id(q) for q in staged.parameters()}
    assert ours == {id(q) for q in model.parameters()}, "stages share the model's parameters"


def test_unsplittable_model_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match="pipeline_pieces"):
        pieces(torch.nn.Linear(2, 2))


def test_mlp_pieces_are_its_layers_and_embeddings_cost_nothing() -> None:
    mlp = load_task("builtin:mnist1d-mlp").model()
    assert len(pieces(mlp)) == 5
    costs = piece_costs(pieces(CharTransformer(96, 8)))
    assert costs[0] == 1.0 and costs[1] > 1000
    x = torch.randn(1, 40)
    measured = profile_pieces(pieces(mlp), x)
    assert [m.flops for m in measured] == [2 * 40 * 128, 0, 2 * 128 * 128, 0, 2 * 128 * 10]
    assert [m.activation_bytes for m in measured] == [512, 512, 512, 512, 40]
    assert measured[0].params == 40 * 128 + 128 and measured[1].stored_bytes > 0


@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=12), st.integers(1, 12))
def test_balance_is_optimal_contiguous_split(costs: list[float], stages: int) -> None:
    if stages > len(costs):
        with pytest.raises(ValueError, match="stages"):
            balance(costs, stages)
        return
    cuts = balance(costs, stages)
    assert len(cuts) == stages - 1 and list(cuts) == sorted(set(cuts))
    bounds = [0, *cuts, len(costs)]
    worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert worst >= max(costs) - 1e-9 and worst >= sum(costs) / stages - 1e-9
    if stages == 2:  # brute force agrees
        best = min(max(sum(costs[:i]), sum(costs[i:])) for i in range(1, len(costs)))
        assert math.isclose(worst, best, rel_tol=1e-9)


@given(st.sampled_from(list(Schedule)), st.integers(1, 6), st.integers(1, 10))
def test_schedules_run_every_micro_batch_once_forward_before_backward(
    schedule: Schedule, stages: int, micro: int
) -> None:
    for s in range(stages):
        ops = stage_ops(schedule, s, stages, micro)
        assert sorted((op.micro, not op.forward) for op in ops) == [
            (m, b) for m in range(micro) for b in (False, True)
        ]
        seen = set()
        for op in ops:
            assert op.forward or op.micro in seen
            seen.add(op.micro)
        limit = micro if schedule is Schedule.GPIPE else min(micro, stages - s)
        assert max_in_flight(ops) == limit


def test_bubble_fraction() -> None:
    assert bubble_fraction(1, 4) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


def test_place_pipeline_and_hybrid() -> None:
    assert place({"a": 1, "b": 2}, None, False) == Placement(("a", "b", "b"))
    hy = place({"a": 2, "b": 2}, None, True)
    assert hy == Placement(("a", "b"), 2) and hy.world == 4 and hy.cluster_of(3) == "b"
    assert place({"a": 4, "b": 2}, 3, True) == Placement(("a", "a", "b"), 2)
    with pytest.raises(ValueError, match="one worker per stage"):
        place({"a": 1, "b": 1}, 3, False)
    with pytest.raises(ValueError, match="multiple"):
        place({"a": 3, "b": 2}, 2, True)


def test_place_whole_pipeline_replicas_on_clusters_of_their_own() -> None:
    """Whole pipelines: consecutive workers make a replica; a stage's replicas are on
    different clusters, and the layout says so."""
    got = place({"a": 1, "b": 1, "c": 1, "d": 1}, 2, True, whole=True)
    assert got == Placement(("a", "b"), 2, pipelines=(("a", "b"), ("c", "d")))
    assert [got.cluster_of(r) for r in range(4)] == ["a", "c", "b", "d"]
    assert got.replica_clusters(0) == ("a", "c") and got.replica_clusters(1) == ("b", "d")
    assert got.workers() == {"a": 1, "c": 1, "b": 1, "d": 1}
    # two workers a cluster: each cluster holds a whole pipeline, data parallel across them
    two = place({"a": 2, "b": 2}, 2, True, whole=True)
    assert two.pipelines == (("a", "a"), ("b", "b")) and two.replica_clusters(1) == ("a", "b")
    assert place({"a": 2}, 2, True, whole=True) == Placement(("a", "a"))  # one replica
    with pytest.raises(ValueError, match="--stages that divides them"):
        place({"a": 1, "b": 2}, 2, True, whole=True)
    with pytest.raises(ValueError, match="pipelines: give each of the replicas"):
        Placement(("a", "b"), 2, pipelines=(("a", "b"), ("c",)))
    with pytest.raises(ValueError, match="pipelines: give each of the replicas"):
        Placement(("a", "b"), 2, pipelines=(("c", "d"), ("a", "b")))


def test_replicas_crossing_one_link_share_it() -> None:
    """Replicas of two stages on two clusters all cross the one link between them (the
    emulated link divides its bandwidth among them); whole pipelines cross links of their own."""
    inside = Placement(("a", "b"), 2)
    assert inside.sharing(0, 1, ("a", "b")) == 2 and inside.sharing(1, 0, ("b", "a")) == 2
    assert inside.sharing(0, 1, ("b", "a")) == 0
    whole = Placement(("a", "b"), 2, pipelines=(("a", "b"), ("c", "d")))
    assert whole.sharing(0, 1, ("a", "b")) == 1 and whole.sharing(0, 1, ("c", "d")) == 1
    assert Placement(("a", "b", "b")).sharing(1, 2, ("b", "b")) == 1


def test_codec_roundtrip_and_wire_bytes() -> None:
    x = torch.randn(4, 8, 16)
    for codec, tol, ratio in [
        (Codec.NONE, 0.0, 1.0),
        (Codec.FP16, 1e-2, 2.0),
        (Codec.INT8, 0.05, 4.0),
    ]:
        msg = encode(x, codec, 1.5)
        head = Header.read(msg.header)
        assert head.shape == (4, 8, 16) and head.sent_at == 1.5
        buf = head.payload_buffer()
        buf.copy_(msg.payload)
        back = decode(head, buf)
        assert float((back - x).abs().max()) <= tol * float(x.abs().max()) + 1e-12
        assert msg.payload.numel() * msg.payload.element_size() * ratio == x.numel() * 4
    ids = torch.arange(6).reshape(2, 3)  # integer tensors cross as they are
    msg = encode(ids, Codec.INT8, 0.0)
    assert torch.equal(decode(Header.read(msg.header), msg.payload), ids)


def test_parallel_grammar() -> None:
    assert parse_parallelism(" Hybrid ") is Parallelism.HYBRID
    assert parse_stages("3") == StageSplit(3)
    assert parse_stages("@2,4") == StageSplit(3, (2, 4))
    for v in ("3", "@2,4"):
        assert str(parse_stages(v)) == v
    for bad in ("0", "x", "@4,2", "@0"):
        with pytest.raises(ValueError, match="stages"):
            parse_stages(bad)
    assert parse_parallelism("tensor") is Parallelism.TENSOR
    with pytest.raises(ValueError, match="valid forms: auto, data, pipeline, hybrid, tensor"):
        parse_parallelism("sideways")


# ---------------------------------------------------------------- real Ray runs


def _reference(task_name: str, steps: int, batch: int) -> tuple[list[float], list[torch.Tensor]]:
    """Single-process training on each step's whole global batch: losses and parameters."""
    return reference_run(task_name, steps, batch)


def _run(
    pool: StagePool,
    task: str,
    clusters: dict[str, int],
    hybrid: bool,
    *,
    batch: int = 16,
    link_mbps: float | None = None,
    rtt_ms: float | None = None,
    **kw: Any,
) -> tuple[PipelineReport, list[torch.Tensor]]:
    """A 3-step run; its report and the final parameters of replica 0, in model order."""
    import ray

    from training.pipeline import PipelineSpec, run_pipeline
    from training.spec import TrainSpec

    train = TrainSpec(
        task=task,
        clusters=clusters,
        steps=3,
        batch_size=batch,
        eval_every=1,
        link_mbps=link_mbps,
        rtt_ms=rtt_ms,
    )
    spec = PipelineSpec(train, place(clusters, None, hybrid), **kw)
    keep: list[Any] = []
    report = run_pipeline(spec, keep=keep, pool=pool)
    p = spec.placement
    params = [q for s in range(p.stages) for q in ray.get(keep[p.rank(s, 0)].parameters.remote())]
    ray.get([a.close.remote() for a in keep])
    return report, params


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Iterator[StagePool]:
    """Stage actors shared by this module's runs: each saves starting processes."""
    kept = StagePool()
    yield kept
    kept.close()


def test_uncompressed_1f1b_pipeline_equals_single_process_char_transformer(
    pool: StagePool,
) -> None:
    report, params = _run(
        pool,
        "builtin:char-transformer",
        {"a": 1, "b": 1},
        False,
        micro_batches=4,
        schedule=Schedule.ONE_F_ONE_B,
        link_mbps=200.0,
        rtt_ms=2.0,
    )
    losses, ref = _reference("builtin:char-transformer", 3, 16)
    assert [h["loss"] for h in report.history] == pytest.approx(losses, rel=1e-5)
    # Adam turns fp-rounding-sized gradient differences into at most ~lr-sized steps
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(params, ref, strict=True))
    wan = report.activation_bytes
    # 3 steps of 16 sequences x 32 positions x 64 dims of fp32 each way, plus headers
    act = 3 * 16 * 32 * 64 * 4
    assert wan[("a", "b")] >= act and wan[("b", "a")] >= act
    assert report.compression_ratio == pytest.approx(1.0)
    assert report.bubble_fraction == pytest.approx(1 / 5)
    assert len(report.stage_compute_s) == 2 and all(c > 0 for c in report.stage_compute_s)


@pytest.mark.slow
def test_hybrid_replicas_share_their_emulated_link(pool: StagePool) -> None:
    """Two replicas of each of two stages cross the one emulated a <-> b link at once, so
    each receiver's messages come at half its rate; GPipe sends every activation before the
    first gradient, so a run takes at least all its bits at the link's rate (each replica on
    a link of its own took half: this fails then)."""
    from training.pipeline import PipelineSpec, run_pipeline
    from training.spec import TrainSpec

    mbps = 0.5
    clusters = {"a": 2, "b": 2}
    train = TrainSpec(
        task="builtin:mnist1d-mlp", clusters=clusters, steps=3, batch_size=160, eval_every=3,
        link_mbps=mbps, rtt_ms=1.0,
    )  # fmt: skip
    spec = PipelineSpec(train, place(clusters, None, True), micro_batches=2)
    report = run_pipeline(spec, pool=pool)
    # the training's bytes: the gradients back are as many as the activations forward, which
    # also carry the final evaluation's (replica 0 alone, at the link's whole rate)
    back = report.activation_bytes[("b", "a")]
    evaluation = report.activation_bytes[("a", "b")] - back
    assert report.wall_s >= 0.8 * (2 * back * 8 / (mbps * 1e6)) + evaluation * 8 / (mbps * 1e6)


def test_hybrid_gpipe_equals_single_process_mlp(pool: StagePool) -> None:
    report, params = _run(
        pool, "builtin:mnist1d-mlp", {"a": 2, "b": 2}, True, micro_batches=3, batch=32
    )
    losses, ref = _reference("builtin:mnist1d-mlp", 3, 32)
    assert report.replicas == 2 and report.stage_clusters == ["a", "b"]
    assert [h["loss"] for h in report.history] == pytest.approx(losses, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, ref, strict=True))
