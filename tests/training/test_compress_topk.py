"""Top-k with the Deep Gradient Compression refinements: momentum correction, momentum factor
masking, local accumulation, density warm-up."""

from __future__ import annotations

import math

import pytest
import torch

from training.compression import make_compressor, packet_from_bytes, packet_to_bytes
from training.compression.topk import dgc_density, packet_indices


def test_momentum_correction_matches_the_dgc_algorithm() -> None:
    """Reference: DGC Algorithm (Lin et al. 2018), written out here independently."""
    momentum, density, shape = 0.9, 0.05, (30, 20)
    compressor = make_compressor(f"topk:{density}:m{momentum}")
    assert compressor.momentum_correction
    generator = torch.Generator().manual_seed(1)
    u = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64)
    sum_velocities = torch.zeros(shape, dtype=torch.float64)
    sum_sent = torch.zeros(shape, dtype=torch.float64)
    k = math.ceil(density * 600)
    for _ in range(10):
        gradient = torch.randn(shape, generator=generator)
        u = momentum * u + gradient.double()
        v = v + u
        sum_velocities += u
        packet = packet_from_bytes(packet_to_bytes(compressor.compress("w", gradient)))
        indices = packet_indices(packet)
        assert indices.numel() == k and indices.unique().numel() == k
        flat_v = v.reshape(-1)
        # the k largest accumulated magnitudes were sent, with their accumulated values
        unsent = torch.ones(600, dtype=torch.bool)
        unsent[indices] = False
        assert flat_v[indices].abs().min() >= flat_v[unsent].abs().max() - 1e-5
        torch.testing.assert_close(packet.tensors["v"].double(), flat_v[indices], atol=1e-4, rtol=0)
        sum_sent += compressor.decompress(packet).double()
        # local accumulation keeps the rest; momentum factor masking clears sent coordinates
        mask = torch.zeros(600, dtype=torch.bool)
        mask[indices] = True
        v = v.reshape(-1).masked_fill(mask, 0.0).reshape(shape)
        u = u.reshape(-1).masked_fill(mask, 0.0).reshape(shape)
        compressor.step()
    state = compressor.state_dict()
    torch.testing.assert_close(state["residuals"]["w"].double(), v, atol=1e-4, rtol=0)
    torch.testing.assert_close(state["velocity"]["w"].double(), u, atol=1e-4, rtol=0)
    torch.testing.assert_close(sum_sent + v, sum_velocities, atol=1e-4, rtol=0)


def test_momentum_zero_turns_momentum_correction_off() -> None:
    compressor = make_compressor("topk:0.1:m0")
    assert not compressor.momentum_correction
    compressor.compress("w", torch.randn(100))
    assert compressor.state_dict()["velocity"] == {}


def test_density_warm_up_follows_the_dgc_ramp() -> None:
    n, target, warmup = 20_000, 0.01, 30
    compressor = make_compressor(f"topk:{target}:m0:w{warmup}")
    counts = []
    for _ in range(34):
        counts.append(compressor.compress("w", torch.randn(n)).tensors["v"].numel())
        compressor.step()
    # DGC: 75% -> 93.75% -> 98.4375% sparsity, then the target; 30 rounds split over 3 stages.
    expected = [5000] * 10 + [1250] * 10 + [313] * 10 + [200] * 4
    assert counts == expected


def test_density_schedule_function() -> None:
    assert [dgc_density(r, 0.001, 8) for r in range(10)] == [
        0.25,
        0.25,
        0.0625,
        0.0625,
        0.015625,
        0.015625,
        0.00390625,
        0.00390625,
        0.001,
        0.001,
    ]
    assert dgc_density(0, 0.01, 0) == 0.01  # no warm-up by default
    assert dgc_density(0, 0.5, 10) == 0.5  # target already above the ramp's start
    assert dgc_density(1000, 0.01, 30) == 0.01


@pytest.mark.parametrize("n", [1, 7, 300, 70_000])
def test_k_is_ceil_of_density_times_size_and_indices_are_compact(n: int) -> None:
    compressor = make_compressor("topk:0.01")
    packet = compressor.compress("w", torch.randn(n))
    k = math.ceil(0.01 * n)
    assert packet.tensors["v"].numel() == k
    assert packet_indices(packet).unique().numel() == k
    index_bytes = 1 if n <= 256 else 2  # gaps: at most the fixed width of the index range
    assert len(packet_to_bytes(packet)) <= k * (4 + index_bytes) + 40


@pytest.mark.parametrize("case", ["random", "sparse_off_stride", "sparse_on_stride", "ties"])
def test_fast_top_k_selection_is_an_exact_top_k(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors go through the sampled-threshold path; it must still give an exact top-k,
    including where the strided sample misleads it (then it falls back to a full top-k)."""
    from training.compression import topk as topk_module

    n, k = 400_000, 1000
    stride = n // max(4096, math.ceil(topk_module.SAMPLE_TAIL * n / (2 * k)))
    generator = torch.Generator().manual_seed(5)
    if case == "random":
        flat = torch.randn(n, generator=generator)
    elif case == "ties":
        flat = torch.randint(-3, 4, (n,), generator=generator).float()
    else:
        flat = torch.randn(n, generator=generator) * 1e-3
        # k/2 big values, only where the strided sample looks (on) or never looks (off)
        positions = torch.arange(0, n, stride)[: k // 2] + (case == "sparse_off_stride")
        flat[positions] = 100.0 + torch.arange(positions.numel()).float()
    sizes: list[int] = []
    real_topk = torch.topk

    def spy(values: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(values.numel())
        return real_topk(values, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "topk", spy)
    indices = topk_module.top_k_indices(flat, k)
    monkeypatch.undo()
    assert (n in sizes) == (case == "sparse_on_stride")  # full top-k only as the fallback
    assert indices.numel() == k and indices.unique().numel() == k
    expected = torch.topk(flat.abs(), k).values
    got = torch.sort(flat.abs()[indices], descending=True).values
    assert torch.equal(got, expected)


@pytest.mark.parametrize("value_spec", ["fp16", "bf16"])
def test_half_precision_values_keep_their_rounding_error(value_spec: str) -> None:
    compressor = make_compressor(f"topk:0.1:m0:{value_spec}")
    generator = torch.Generator().manual_seed(2)
    total, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
    for _ in range(6):
        gradient = torch.randn(500, generator=generator)
        total += gradient.double()
        packet = packet_from_bytes(packet_to_bytes(compressor.compress("w", gradient)))
        assert packet.tensors["v"].dtype == getattr(
            torch, "float16" if value_spec == "fp16" else "bfloat16"
        )
        sent += compressor.decompress(packet).double()
    residual = compressor.state_dict()["residuals"]["w"].double()
    torch.testing.assert_close(sent + residual, total, atol=1e-4, rtol=0)
    fp32 = make_compressor("topk:0.1:m0").compress("w", gradient)
    assert len(packet_to_bytes(packet_from_bytes(packet_to_bytes(packet)))) < len(
        packet_to_bytes(fp32)
    )


@pytest.mark.parametrize(
    ("spec", "at_least"), [("topk:0.01", 70), ("topk:0.01:fp16", 110), ("topk:0.001", 600)]
)
def test_wire_ratio_on_a_large_tensor(spec: str, at_least: float) -> None:
    """Index gaps as varints: 1% density costs ~5.3 bytes per kept value, not 8."""
    gradient = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    wire = packet_to_bytes(make_compressor(spec).compress("w", gradient))
    assert 4 * gradient.numel() / len(wire) >= at_least
