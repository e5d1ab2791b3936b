"""fp32, uncompressed: the baseline every other compressor is measured against."""

from __future__ import annotations

import torch

from training.compression.base import Compressor, Packet
from training.compression.feedback import as_float32


class NoCompression(Compressor):
    """Sends the gradient as float32: exact, so it needs no error feedback and keeps no state."""

    name = "none"
    mergeable = True
    ring = True

    def compress(self, key: str, tensor: torch.Tensor) -> Packet:
        return Packet(tensors={"x": as_float32(tensor)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        return packet.tensors["x"].to(torch.float32)
