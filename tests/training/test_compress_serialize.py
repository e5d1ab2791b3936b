"""The wire format: exact round trips for every dtype, shape and compressor; compact storage;
clear errors on malformed bytes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.compression import (
    Packet,
    compressor_specs,
    make_compressor,
    packet_from_bytes,
    packet_to_bytes,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


def _bits(tensor: torch.Tensor) -> bytes:
    """Bitwise content, so NaN and -0.0 compare exactly."""
    flat = tensor.detach().reshape(-1).clone()
    return (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy().tobytes()


def _assert_same(a: Packet, b: Packet) -> None:
    assert a.meta == b.meta
    assert list(a.tensors) == list(b.tensors)
    for name, tensor in a.tensors.items():
        other = b.tensors[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert _bits(other) == _bits(tensor), name


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        tensor = (
            torch.randn(shape, generator=generator, dtype=torch.float64)
            * 10 ** draw(st.integers(-6, 6))
        ).to(dtype)
        if tensor.numel() and draw(st.booleans()):
            special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
            tensor.view(-1)[: min(4, tensor.numel())] = special[: min(4, tensor.numel())]
        return tensor
    info = torch.iinfo(dtype)
    low = draw(st.integers(info.min, info.max))
    high = draw(st.integers(low, info.max))
    if high == 2**63 - 1:  # randint's exclusive bound cannot exceed int64
        return torch.full(shape, high, dtype=dtype)
    return torch.randint(low, high + 1, shape, generator=generator, dtype=dtype)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=5)
    | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(
    named=st.dictionaries(st.text(max_size=6), tensors(), max_size=4),
    meta=st.dictionaries(st.text(max_size=4), json_values, max_size=3),
)
def test_any_packet_round_trips_exactly(named: dict[str, torch.Tensor], meta: dict) -> None:
    packet = Packet(tensors=named, meta=meta)
    _assert_same(packet_from_bytes(packet_to_bytes(packet)), packet)


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(compressor_specs()),
    shape=st.lists(st.integers(1, 40), max_size=4).filter(lambda s: math.prod(s) <= 4000),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 1000),
)
def test_every_compressor_packet_round_trips_exactly(
    spec: str, shape: list[int], dtype: torch.dtype, seed: int
) -> None:
    compressor = make_compressor(spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):  # the second round has residuals and warm starts in play
        gradient = torch.randn(shape, generator=generator).to(dtype)
        packet = compressor.compress("w", gradient)
        restored = packet_from_bytes(packet_to_bytes(packet))
        _assert_same(restored, packet)
        assert _bits(compressor.decompress(restored)) == _bits(compressor.decompress(packet))
        compressor.step()


@pytest.mark.parametrize(
    ("low", "high", "itemsize"),
    [
        (0, 255, 1),
        (-128, 127, 1),
        (0, 65_535, 2),
        (-1, 32_767, 2),
        (0, 2**32 - 1, 4),
        (-1, 2**31 - 1, 4),
        (-1, 2**40, 8),
    ],
)
def test_integers_use_the_smallest_type_that_fits(low: int, high: int, itemsize: int) -> None:
    values = torch.tensor([low, high], dtype=torch.int64)
    data = packet_to_bytes(Packet(tensors={"i": values}))
    # version, meta length, count, name length, name, dtype, storage, ndim, dim: 9 bytes
    assert len(data) == 9 + 2 * itemsize
    assert torch.equal(packet_from_bytes(data).tensors["i"], values)


def test_top_k_index_gaps_go_out_as_one_or_two_byte_varints() -> None:
    n, k = 10_000_000, 100_000
    generator = torch.Generator().manual_seed(0)
    indices = torch.sort(torch.randperm(n, generator=generator)[:k]).values
    gaps = torch.diff(indices, prepend=torch.tensor([-1])) - 1
    data = packet_to_bytes(Packet(tensors={"g": gaps}))
    assert len(data) < 1.4 * k  # mean gap 100: ~72% fit in one byte, the rest in two
    assert torch.equal(packet_from_bytes(data).tensors["g"], gaps)
    extremes = torch.tensor([0, 127, 128, 16_383, 16_384, 2**63 - 1] * 3, dtype=torch.int64)
    assert torch.equal(
        packet_from_bytes(packet_to_bytes(Packet({"x": extremes}))).tensors["x"], extremes
    )


def test_negative_indices_and_signed_ranges_survive() -> None:
    values = torch.tensor([-129, 5, 200], dtype=torch.int32)
    assert torch.equal(
        packet_from_bytes(packet_to_bytes(Packet({"i": values}))).tensors["i"], values
    )


def test_signs_are_bit_packed() -> None:
    packet = make_compressor("sign").compress("w", torch.randn(10_000))
    assert len(packet_to_bytes(packet)) <= 10_000 // 8 + 20


def test_malformed_bytes_raise_value_error() -> None:
    data = packet_to_bytes(make_compressor("topk:0.1").compress("w", torch.randn(100)))
    varints = packet_to_bytes(Packet({"g": torch.tensor([5] * 20 + [300])}))
    assert len(varints) == 10 + 22  # header + 20 one-byte and 1 two-byte varints, not uint16
    for bad, message in [
        (data[:-1], "truncated"),
        (data + b"\x00", "trailing"),
        (b"\x07" + data[1:], "format version"),
        (b"", "truncated"),
        (varints[:-1] + b"\x80", "varint data"),
        (varints[:-2] + b"\x00\x00", "varint data"),
    ]:
        with pytest.raises(ValueError, match=message):
            packet_from_bytes(bad)


def test_unsupported_dtype_and_non_json_meta_are_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        packet_to_bytes(Packet({"x": torch.zeros(2, dtype=torch.complex64)}))
    with pytest.raises(ValueError, match="meta must be JSON"):
        packet_to_bytes(Packet({}, meta={"f": object()}))
