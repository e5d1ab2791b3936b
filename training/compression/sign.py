"""1-bit sign compression with a scale and error feedback (EF-SignSGD, Karimireddy et al. 2019).

Sends sign(p) as bits plus one float, scale = mean |p| (= ||p||_1 / d), where p is the gradient
plus the residual; decode is scale * sign. The scaled sign is a contraction, so error feedback
fixes signSGD's bias (Bernstein et al. 2018 need large batches without it). Zero goes out as +.
~32x fewer bytes than fp32.
"""

from __future__ import annotations

import torch

from training.compression.base import Packet
from training.compression.feedback import ErrorFeedbackCompressor


class SignCompressor(ErrorFeedbackCompressor):
    """Packet: `b` (bool, True for >= 0; bit-packed on the wire) and `s` (float32 scale)."""

    name = "sign"

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        scale = corrected.abs().mean() if corrected.numel() else corrected.new_zeros(())
        return Packet(tensors={"b": corrected >= 0, "s": scale})

    def decompress(self, packet: Packet) -> torch.Tensor:
        scale = packet.tensors["s"].to(torch.float32)
        # (2b - 1) * scale, one pass: b * 2s - s
        return packet.tensors["b"].to(torch.float32).mul_(2 * scale).sub_(scale)
