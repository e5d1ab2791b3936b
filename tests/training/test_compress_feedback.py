"""Error feedback: over several rounds, what was sent plus the final residual equals the sum of
the gradients, for every compressor; fp32 "none" is exact."""

from __future__ import annotations

import pytest
import torch

from training.compression import (
    compressor_specs,
    make_compressor,
    packet_from_bytes,
    packet_to_bytes,
)

# A small model's worth of shapes: linear, conv kernel, bias, scalar, and a tiny matrix.
SHAPES = {
    "fc.weight": (48, 40),
    "conv.weight": (16, 8, 3, 3),
    "fc.bias": (48,),
    "scale": (),
    "tiny": (2, 3),
}
# topk with momentum accumulates velocities, not gradients: tested against a reference below.
EF_SPECS = [
    "fp16",
    "bf16",
    "int8",
    "int8:minmax",
    "int4",
    "int2",
    "topk:0.05:m0",
    "topk:0.1:m0:c64:int2",
    "topk:0.1:m0:c100:int4",
    "topk:0.01:m0:w4",
    "powersgd:2",
    "powersgd:1",
    "sign",
]


def _residual(compressor, key: str) -> torch.Tensor:
    return compressor.state_dict().get("residuals", {}).get(key, torch.zeros(()))


@pytest.mark.parametrize("spec", EF_SPECS)
def test_sent_plus_residual_equals_sum_of_gradients(spec: str) -> None:
    generator = torch.Generator().manual_seed(7)
    compressor = make_compressor(spec, seed=3)
    totals = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    sent = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    for _ in range(8):
        for key, shape in SHAPES.items():
            gradient = torch.randn(shape, generator=generator)
            totals[key] += gradient.double()
            wire = packet_to_bytes(compressor.compress(key, gradient))
            sent[key] += compressor.decompress(packet_from_bytes(wire)).double()
        compressor.step()
    lossy = False
    for key in SHAPES:
        residual = _residual(compressor, key).double()
        torch.testing.assert_close(sent[key] + residual, totals[key], rtol=0, atol=1e-4)
        lossy = lossy or bool(residual.abs().max() > 0)
    # The check has teeth: these compressors really left something unsent.
    assert lossy


@pytest.mark.parametrize("spec", EF_SPECS)
def test_without_the_residual_the_sum_is_off(spec: str) -> None:
    """Control: dropping the residual breaks the identity (so the test above can fail)."""
    generator = torch.Generator().manual_seed(7)
    compressor = make_compressor(spec, seed=3)
    total = torch.zeros(48, 40, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for _ in range(4):
        gradient = torch.randn(48, 40, generator=generator)
        total += gradient.double()
        sent += compressor.decompress(compressor.compress("w", gradient)).double()
        compressor.step()
    assert (sent - total).abs().max() > 1e-6


def test_none_is_exact_and_does_not_alias_the_gradient() -> None:
    compressor = make_compressor("none")
    values = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    values[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    packet = compressor.compress("w", values)
    restored = compressor.decompress(packet_from_bytes(packet_to_bytes(packet)))
    assert restored.dtype == torch.float32
    assert torch.equal(restored.view(torch.int32), values.view(torch.int32))  # bitwise
    values.zero_()  # the runtime may reuse the gradient buffer after compress()
    assert not torch.equal(compressor.decompress(packet), values)
    assert compressor.state_dict() == {}


@pytest.mark.parametrize("spec", compressor_specs())
def test_decompress_gives_float32_of_the_original_shape(spec: str) -> None:
    compressor = make_compressor(spec)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for key, shape in SHAPES.items():
            gradient = torch.randn(shape).to(dtype)
            out = compressor.decompress(compressor.compress(f"{key}.{dtype}", gradient))
            assert out.dtype == torch.float32
            assert out.shape == gradient.shape


def test_fp16_clamps_instead_of_overflowing_and_sends_the_excess_later() -> None:
    compressor = make_compressor("fp16")
    gradient = torch.tensor([1e6, -1e6, 1.0])
    first = compressor.decompress(compressor.compress("w", gradient))
    assert torch.isfinite(first).all()
    second = compressor.decompress(compressor.compress("w", torch.zeros(3)))
    torch.testing.assert_close(first + second + _residual(compressor, "w"), gradient)


def test_a_key_changing_shape_is_refused() -> None:
    compressor = make_compressor("int8")
    compressor.compress("w", torch.randn(4, 4))
    with pytest.raises(ValueError, match="'w' has shape"):
        compressor.compress("w", torch.randn(5, 4))


@pytest.mark.parametrize("spec", compressor_specs())
def test_decompress_is_stateless_any_instance_decodes(spec: str) -> None:
    """Receivers decode with their own instance of the spec, never the sender's state."""
    sender, receiver = make_compressor(spec, seed=1), make_compressor(spec, seed=2)
    for round_index in range(3):
        gradient = torch.randn(32, 20, generator=torch.Generator().manual_seed(round_index))
        packet = packet_from_bytes(packet_to_bytes(sender.compress("w", gradient)))
        assert torch.equal(receiver.decompress(packet), sender.decompress(packet))
        sender.step()
    assert not receiver.state_dict().get("residuals")  # decoding kept no state
