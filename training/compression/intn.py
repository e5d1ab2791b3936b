"""4- and 2-bit quantization with a scale per block, stochastic rounding and error feedback.

Each block of `BLOCK` consecutive values gets one bfloat16 scale s; a value x becomes one of
the 2^bits levels (q - (L-1)/2) * s, q in [0, L), an evenly spaced grid symmetric around
zero (int4: +-0.5s .. +-7.5s with s = max|x| / 7.5; int2: +-0.5s, +-1.5s with s = max|x| /
1.5). Rounding to one of the two nearest levels is stochastic and unbiased, so what error
feedback keeps is noise, not drift. Codes are packed 2 (int4) or 4 (int2) to a byte: with the
scales, 4.125 and 2.125 bits a value, 7.8x and 15x fewer bytes than fp32.

`quantize` / `dequantize` are shared with top-k, whose kept values may go out at 4 or 2 bits.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from training.compression.base import Packet
from training.compression.feedback import ErrorFeedbackCompressor

BLOCK = 128
"""Values per scale."""


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2^bits) (any integer dtype, 1-D) packed little-end first into uint8."""
    per = 8 // bits
    flat = codes.to(torch.uint8).reshape(-1)
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    grouped = flat.view(-1, per)
    out = grouped[:, 0].clone()
    for j in range(1, per):
        out |= grouped[:, j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` codes `pack_codes` packed, as int64."""
    per = 8 // bits
    mask = (1 << bits) - 1
    data = packed.to(torch.uint8).reshape(-1, 1)
    shifts = torch.arange(per, dtype=torch.uint8).mul_(bits).reshape(1, -1)
    codes = (data >> shifts) & mask
    return codes.reshape(-1)[:count].to(torch.int64)


def quantize(
    values: torch.Tensor, bits: int, generator: torch.Generator, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (uint8) and one bfloat16 scale per `block` values of the 1-D `values`.

    The scale is rounded to bfloat16 before the values are divided by it, so the receiver
    decodes with exactly the scale used here; values a rounded-down scale puts past the
    outer level are clamped to it (error feedback sends the rest later)."""
    levels = 1 << bits
    half = (levels - 1) / 2.0
    count = values.numel()
    blocks = math.ceil(count / block) if count else 0
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:count] = values.detach().to("cpu", torch.float32).reshape(-1)
    rows = padded.view(blocks, block)
    peak = rows.abs().amax(dim=1) if blocks else padded.new_zeros(0)
    scales = (peak / half).to(torch.bfloat16)
    scale = scales.to(torch.float32).unsqueeze(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    noise = torch.rand(rows.shape, generator=generator)
    # floor(x/s + half + U), U ~ U[0,1): the upper of the two nearest levels with probability
    # equal to the distance from the lower one, so E[level] = x/s (unbiased)
    codes = (rows / safe).add_(half).add_(noise).floor_().clamp_(0, levels - 1)
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))  # an all-zero block
    return pack_codes(codes.reshape(-1)[:count], bits), scales


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, bits: int, count: int, block: int = BLOCK
) -> torch.Tensor:
    """The 1-D float32 values `quantize` encoded (zeros where a block's scale is zero)."""
    half = ((1 << bits) - 1) / 2.0
    codes = unpack_codes(packed, bits, count).to(torch.float32)
    scale = scales.to(torch.float32).repeat_interleave(block)[:count]
    return (codes - half).mul_(scale)


class StochasticIntN(ErrorFeedbackCompressor):
    """`bits`-bit (4 or 2) block quantization with stochastic rounding and error feedback.

    Packet: `q` (packed codes, uint8), `s` (bfloat16 scales), meta `shape`. Random numbers
    come from the compressor's own seeded CPU generator, so `state_dict` resumes it to
    identical packets.
    """

    ring = True

    def __init__(self, bits: int, *, seed: int = 0, error_feedback: bool = True) -> None:
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {bits}")
        super().__init__(error_feedback=error_feedback)
        self.bits = bits
        self.name = f"int{bits}"
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        packed, scales = quantize(corrected.reshape(-1), self.bits, self._generator)
        return Packet(tensors={"q": packed, "s": scales}, meta={"shape": list(corrected.shape)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        shape = [int(d) for d in packet.meta["shape"]]
        flat = dequantize(packet.tensors["q"], packet.tensors["s"], self.bits, math.prod(shape))
        return flat.reshape(shape)

    def extra_state(self) -> dict[str, Any]:
        return {"rng": self._generator.get_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            self._generator.set_state(state["rng"].clone())
