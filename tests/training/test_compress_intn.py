"""4- and 2-bit block quantization, and top-k per chunk with values at 2 or 4 bits
(SparseLoCo's compressor): codes, unbiased rounding, wire size, chunk shares."""

from __future__ import annotations

import math

import pytest
import torch

from training.compression import make_compressor, packet_from_bytes, packet_to_bytes
from training.compression.intn import BLOCK, StochasticIntN, pack_codes, unpack_codes
from training.compression.topk import TopKCompressor, chunked_top_k_indices, packet_indices


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 1000])
def test_codes_pack_and_unpack(bits: int, count: int) -> None:
    codes = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_codes(packed, bits, count), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_each_value_lands_on_one_of_its_two_nearest_levels(bits: int) -> None:
    compressor = StochasticIntN(bits, error_feedback=False)
    x = torch.randn(10, 300, generator=torch.Generator().manual_seed(1)) * 3
    packet = compressor.compress("w", x)
    out = compressor.decompress(packet_from_bytes(packet_to_bytes(packet)))
    assert out.shape == x.shape and out.dtype == torch.float32
    # a level step is 2 * peak / (2^bits - 1) per block; no value is more than one step off
    flat, got = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start : start + BLOCK]
        step = 2 * float(block.abs().max()) / ((1 << bits) - 1)
        assert (got[start : start + BLOCK] - block).abs().max() <= step * 1.01
    # zeros stay zeros (an all-zero block has scale 0)
    assert torch.equal(
        compressor.decompress(compressor.compress("z", torch.zeros(300))), torch.zeros(300)
    )


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    compressor = StochasticIntN(bits, seed=5, error_feedback=False)
    x = torch.linspace(-1, 1, BLOCK)  # one block, peak 1: levels fall between the values
    draws = torch.stack([compressor.decompress(compressor.compress("w", x)) for _ in range(4000)])
    step = 2.0 / ((1 << bits) - 1)
    assert (draws.mean(0) - x).abs().max() < 0.08 * step  # 4000 draws: ~3 sigma is 0.03
    assert (draws - x).abs().max() > 0.2 * step  # and it did round (the check has teeth)


@pytest.mark.parametrize(("spec", "bits"), [("int4", 4.125), ("int2", 2.125)])
def test_wire_size_is_bits_per_value_plus_a_scale_per_block(spec: str, bits: float) -> None:
    n = 100_000
    data = packet_to_bytes(make_compressor(spec).compress("w", torch.randn(n)))
    assert n * bits / 8 <= len(data) <= n * bits / 8 + 64


def test_topk_per_chunk_keeps_each_chunks_share() -> None:
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    flat[:100] *= 100  # a loud region: a global top-k would take everything from it
    chosen = chunked_top_k_indices(flat, 0.05, 128)
    counts = torch.bincount(chosen // 128, minlength=8)
    # 7 full chunks keep ceil(0.05 * 128) = 7, the last (1000 - 896 = 104 values) ceil(5.2) = 6
    assert counts.tolist() == [7] * 7 + [6]
    assert len(set(chosen.tolist())) == chosen.numel() and int(chosen.max()) < 1000
    for c in range(8):  # and within a chunk they are its largest
        chunk = flat[c * 128 : (c + 1) * 128].abs()
        mine = chosen[chosen // 128 == c] - c * 128
        assert chunk[mine].min() >= chunk.topk(int(counts[c])).values.min()


def test_sparseloco_packets_are_small_and_keep_the_rest() -> None:
    n, density = 1 << 20, 0.02
    compressor = make_compressor("topk:0.02:m0:c4096:int2")
    assert isinstance(compressor, TopKCompressor)
    gradient = torch.randn(n, generator=torch.Generator().manual_seed(3))
    packet = compressor.compress("w", gradient)
    data = packet_to_bytes(packet)
    kept = math.ceil(density * 4096) * (n // 4096)
    assert packet_indices(packet).numel() == kept
    # about one byte of index gap and a quarter byte of value per kept value (vs 4 + 4 in
    # fp32 values and int32 indices): over 100x fewer bytes than fp32
    assert len(data) < 1.4 * kept and 4 * n / len(data) > 100
    sent = compressor.decompress(packet_from_bytes(data))
    residual = compressor.residual("w")
    assert residual is not None
    torch.testing.assert_close(sent + residual, gradient, rtol=0, atol=1e-5)
