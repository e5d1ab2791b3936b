"""Error feedback shared by the lossy compressors.

Each lossy compressor only says how to encode one (already corrected) tensor; this base adds
the residual kept for the key before encoding and keeps what the packet could not carry
(corrected - decompress(packet)) afterwards. That makes "sent + residual == sum of gradients"
hold by construction, and keeps the state a compressor must checkpoint in one place.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from training.compression.base import Compressor, Packet


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """A detached float32 copy: the runtime may reuse gradient buffers after compress()."""
    return tensor.detach().to(torch.float32, copy=True, memory_format=torch.contiguous_format)


def check_shape(kind: str, key: str, kept: torch.Tensor, tensor: torch.Tensor) -> None:
    """Refuse to mix state of differently shaped tensors under one key (a model change)."""
    if kept.shape != tensor.shape:
        raise ValueError(
            f"{kind} kept for key {key!r} has shape {tuple(kept.shape)} but the tensor has "
            f"shape {tuple(tensor.shape)}; use one key per parameter, or start a new compressor"
        )


def clone_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


class ErrorFeedbackCompressor(Compressor):
    """Base for lossy compressors: residual accumulation around an `encode` step.

    `error_feedback=False` turns the residual off (used to test an encoder's own statistics,
    e.g. that stochastic rounding is unbiased); the runtime always keeps it on.
    """

    def __init__(self, *, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self._residuals: dict[str, torch.Tensor] = {}

    @abstractmethod
    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        """Encode a float32 tensor that already includes the residual.

        Must neither modify `corrected` nor return a packet holding it (or a view of it): the
        caller turns it into the residual in place afterwards.
        """

    def compress(self, key: str, tensor: torch.Tensor) -> Packet:
        corrected = as_float32(tensor)
        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is not None:
                check_shape("residual", key, residual, corrected)
                corrected += residual
        packet = self.encode(key, corrected)
        if self.error_feedback:
            # in place: encoders never alias `corrected` in their packets
            self._residuals[key] = corrected.sub_(self.decompress(packet).to(corrected.device))
        return packet

    def residual(self, key: str) -> torch.Tensor | None:
        """What has not been sent yet for `key` (None before the first compress)."""
        return self._residuals.get(key)

    def extra_state(self) -> dict[str, Any]:
        """Subclass state beyond residuals (warm starts, RNG, counters)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": clone_tensors(self._residuals), **self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = clone_tensors(state.get("residuals", {}))
        self.load_extra_state(state)
