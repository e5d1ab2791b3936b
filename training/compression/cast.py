"""Half-precision casts (fp16, bf16) with error feedback: 2x fewer bytes, tiny rounding error."""

from __future__ import annotations

import torch

from training.compression.base import Packet
from training.compression.feedback import ErrorFeedbackCompressor

_FP16_MAX = float(torch.finfo(torch.float16).max)


class CastCompressor(ErrorFeedbackCompressor):
    """Rounds to fp16 or bf16; the rounding error (and anything beyond fp16's range, which is
    clamped rather than turned into inf) stays in the residual and is sent later."""

    mergeable = True  # payloads may be summed after upcasting to float32
    ring = True

    def __init__(self, dtype: torch.dtype, *, error_feedback: bool = True) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        super().__init__(error_feedback=error_feedback)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        source = corrected
        if self.dtype == torch.float16:
            source = corrected.clamp(-_FP16_MAX, _FP16_MAX)
        return Packet(tensors={"x": source.to(self.dtype)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        return packet.tensors["x"].to(torch.float32)
