"""8-bit quantization with error feedback: 4x fewer bytes than fp32.

Two encoders:
- stochastic (the default, "int8"): symmetric scale max|x|/127 and stochastic rounding, so
  E[decode(encode(x))] == x exactly; the noise is unbiased and error feedback removes the rest.
- min-max ("int8:minmax", as INTELLECT-1 sends its pseudo-gradients): 256 levels spread
  between the tensor's min and max, round to nearest; biased per round, but the bias stays
  in the residual.
One scale per tensor keeps the header at one or two floats.
"""

from __future__ import annotations

from typing import Any

import torch

from training.compression.base import Packet
from training.compression.feedback import ErrorFeedbackCompressor


class StochasticInt8(ErrorFeedbackCompressor):
    """Symmetric int8 in [-127, 127] with unbiased stochastic rounding.

    Random numbers come from the compressor's own CPU generator (seeded), so a run is
    reproducible and `state_dict` can resume it to identical packets.
    """

    name = "int8"
    ring = True

    def __init__(self, *, seed: int = 0, error_feedback: bool = True) -> None:
        super().__init__(error_feedback=error_feedback)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        peak = corrected.abs().max() if corrected.numel() else corrected.new_zeros(())
        scale = peak / 127.0
        if float(scale) == 0.0 or not torch.isfinite(scale):
            codes = torch.zeros(corrected.shape, dtype=torch.int8, device=corrected.device)
            return Packet(tensors={"q": codes, "s": corrected.new_zeros(())})
        noise = torch.rand(corrected.shape, generator=self._generator).to(corrected.device)
        # floor(x/s + U) with U ~ U[0,1) rounds up with probability frac(x/s): unbiased.
        levels = (corrected / scale).add_(noise).floor_().clamp_(-127, 127)
        return Packet(tensors={"q": levels.to(torch.int8), "s": scale})

    def decompress(self, packet: Packet) -> torch.Tensor:
        return packet.tensors["q"].to(torch.float32) * packet.tensors["s"]

    def extra_state(self) -> dict[str, Any]:
        return {"rng": self._generator.get_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            self._generator.set_state(state["rng"].clone())


class MinMaxInt8(ErrorFeedbackCompressor):
    """Asymmetric 8-bit: q = round((x - min) / s) in [0, 255], s = (max - min) / 255."""

    name = "int8:minmax"
    ring = True

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        if corrected.numel() == 0:
            codes = torch.zeros(corrected.shape, dtype=torch.uint8, device=corrected.device)
            return Packet(tensors={"q": codes, "ls": corrected.new_zeros(2)})
        low, high = corrected.min(), corrected.max()
        scale = (high - low) / 255.0
        if float(scale) == 0.0 or not torch.isfinite(scale):
            codes = torch.zeros(corrected.shape, dtype=torch.uint8, device=corrected.device)
            return Packet(tensors={"q": codes, "ls": torch.stack([low, scale.new_zeros(())])})
        levels = (corrected - low).div_(scale).round_().clamp_(0, 255)
        return Packet(tensors={"q": levels.to(torch.uint8), "ls": torch.stack([low, scale])})

    def decompress(self, packet: Packet) -> torch.Tensor:
        low_scale = packet.tensors["ls"]
        return packet.tensors["q"].to(torch.float32) * low_scale[1] + low_scale[0]
