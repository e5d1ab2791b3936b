"""The contract every gradient compressor meets.

A compressor turns one named gradient tensor into a `Packet` (what crosses the WAN between
cluster leaders) and back. Error feedback lives inside the compressor: `compress` adds the
residual it kept for that key, and keeps what it could not send for the next call, so that
over time the sum of what was sent plus the residual equals the sum of the gradients.

Compressors are pure torch code: no torch.distributed, no Ray, no I/O. The runtime
(`training/exchange.py`) serialises packets with `packet_to_bytes`, moves the bytes, and
counts them per link.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Packet:
    """One compressed tensor: named payload tensors plus small metadata (shape, dtype...)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


class Compressor(ABC):
    """Compresses gradients tensor by tensor, keeping per-key state (error feedback, warm starts).

    `mergeable` is True when decompress(a) + decompress(b) may be replaced by summing payloads
    (fp32/fp16); the runtime never relies on it for correctness, only for speed.
    `momentum_correction` is True when the compressor applies momentum itself (DGC); the runtime
    then runs the local optimizer without momentum for parameters it handles. `ring`: see below.
    """

    name: str = "abstract"
    mergeable: bool = False
    momentum_correction: bool = False
    ring: bool = False
    """True when the compressor may compress any slice of a tensor and partial sums of
    several leaders' tensors (it keeps no per-leader state but error feedback): the runtime
    then all-reduces through a ring of compressed chunks (reduce-scatter + all-gather), whose
    bytes per leader stay flat as clusters are added. False: each leader's whole packet is
    all-gathered (PowerSGD's factors, DGC's momentum correction, sign)."""

    @abstractmethod
    def compress(self, key: str, tensor: torch.Tensor) -> Packet:
        """Compress `tensor` (error feedback included) and remember the new residual for `key`."""

    @abstractmethod
    def decompress(self, packet: Packet) -> torch.Tensor:
        """Rebuild a dense float32 tensor of the original shape from `packet`.

        Reads only the packet (no per-key state), so a receiver may decode with its own
        instance of the same spec.
        """

    def step(self) -> None:  # noqa: B027 - optional hook, stateless compressors skip it
        """Called once after each exchange round (schedules such as DGC's density warm-up)."""

    def state_dict(self) -> dict[str, Any]:
        """State needed to resume exactly (residuals, warm starts, counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what `state_dict` returned."""
