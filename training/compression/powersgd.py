"""PowerSGD low-rank compression (Vogels, Karimireddy & Jaggi, NeurIPS 2019).

Each gradient is viewed as a matrix M (n = first dim, m = the rest: a conv kernel
[out, in, kh, kw] becomes out x (in*kh*kw)). One power-iteration step per round, warm-started
from the previous round's Q:

    P = M Q;  P = orthogonalise(P);  Q = M^T P;  send P (n x r), Q (m x r);  decode P Q^T

and error feedback keeps M - P Q^T for the next round. Bytes fall from 4nm to 4r(n+m).

Per leader, not all-reduced: in the paper (and PyTorch's DDP hook) P and Q are all-reduced
between the two matrix products, so every worker decodes the rank-r approximation of the
*mean* gradient. cpn exchanges whole packets by all-gather between cluster leaders, so each
leader compresses its own (cluster-averaged) matrix and orthogonalises its own P; receivers
decode every leader's P Q^T and average them. The average has rank <= r * leaders, costs the
same bytes per leader, and needs one exchange per round instead of two.

Tensors with fewer than 2 dims, or too small to benefit (r(n+m) * 2 > nm, PyTorch's
min_compression_rate of 2), go uncompressed as float32 inside the packet (`x`), leaving no
residual.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from training.compression.base import Packet
from training.compression.feedback import ErrorFeedbackCompressor, clone_tensors

MIN_COMPRESSION_RATE = 2.0


def matrix_shape(shape: torch.Size | list[int]) -> tuple[int, int]:
    """The (rows, cols) a tensor of `shape` is compressed as."""
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def compresses(shape: torch.Size | list[int], rank: int) -> bool:
    """Whether a tensor of `shape` goes low-rank (True) or plain float32 (False)."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape)
    effective = min(rank, rows, cols)
    return effective > 0 and effective * (rows + cols) * MIN_COMPRESSION_RATE <= rows * cols


class PowerSGDCompressor(ErrorFeedbackCompressor):
    """Rank-`rank` PowerSGD with warm start and error feedback; see the module docstring.

    Packet: `p` (n x r) and `q` (m x r) float32, meta `shape`; or `x` (float32, uncompressed).
    The first Q of each key is drawn from the compressor's seeded generator.
    """

    name = "powersgd"

    def __init__(self, rank: int, *, seed: int = 0, error_feedback: bool = True) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        super().__init__(error_feedback=error_feedback)
        self.rank = rank
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._q: dict[str, torch.Tensor] = {}

    def encode(self, key: str, corrected: torch.Tensor) -> Packet:
        if not compresses(corrected.shape, self.rank):
            return Packet(tensors={"x": corrected.clone()})
        rows, cols = matrix_shape(corrected.shape)
        rank = min(self.rank, rows, cols)
        matrix = corrected.reshape(rows, cols)
        q = self._q.get(key)
        if q is None or q.shape != (cols, rank):
            q = torch.randn(cols, rank, generator=self._generator).to(matrix.device)
        p = matrix @ q
        # QR's Q comes column-major; make it row-major like a deserialized packet, so the sender
        # and every receiver decode P Q^T with the same BLAS path, bit for bit.
        p = torch.linalg.qr(p, mode="reduced").Q.contiguous()
        q = (matrix.T @ p).contiguous()
        self._q[key] = q
        return Packet(tensors={"p": p, "q": q.clone()}, meta={"shape": list(corrected.shape)})

    def decompress(self, packet: Packet) -> torch.Tensor:
        if "x" in packet.tensors:
            return packet.tensors["x"].to(torch.float32)
        p = packet.tensors["p"].to(torch.float32).contiguous()
        q = packet.tensors["q"].to(torch.float32).contiguous()
        return (p @ q.T).reshape([int(d) for d in packet.meta["shape"]])

    def extra_state(self) -> dict[str, Any]:
        return {"q": clone_tensors(self._q), "rng": self._generator.get_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._q = clone_tensors(state.get("q", {}))
        if "rng" in state:
            self._generator.set_state(state["rng"].clone())
