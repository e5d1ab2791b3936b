"""What crosses a pipeline link: an activation (or its gradient), compressed, behind a header.

A message is a fixed-size float64 header (send time, codec, scale, shape) and the payload.
The receiver needs no shape agreed in advance (micro-batches may differ in size), and the
send time lets it wait out an emulated link (`training.wan`) without the sender blocking.
Codecs: none (exact), fp16, bf16 (a cast), int8 (a per-tensor scale, round to nearest).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from grammar import Compression, CompressionKind

HEADER_LEN = 12
MAX_DIMS = HEADER_LEN - 5
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


class Codec(IntEnum):
    NONE = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3


_BY_KIND = {
    CompressionKind.NONE: Codec.NONE,
    CompressionKind.FP16: Codec.FP16,
    CompressionKind.BF16: Codec.BF16,
    CompressionKind.INT8: Codec.INT8,
}


def codec_for(value: Compression) -> Codec:
    """The activation codec of a compression value (ValueError for gradient-only forms)."""
    if value.kind not in _BY_KIND:
        raise ValueError(
            f"compression: {value} does not apply to activations; "
            "use none, fp16, bf16 or int8 with --parallel pipeline|hybrid"
        )
    return _BY_KIND[value.kind]


@dataclass(frozen=True)
class Encoded:
    header: torch.Tensor
    payload: torch.Tensor

    @property
    def wire_bytes(self) -> int:
        """Bytes this message puts on the link, header included."""
        return _nbytes(self.header) + _nbytes(self.payload)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def encode(x: torch.Tensor, codec: Codec, sent_at: float) -> Encoded:
    """`x` as a header and a flat payload under `codec` (non-float tensors cross as they are)."""
    if x.dim() > MAX_DIMS:
        raise ValueError(f"activations of {x.dim()} dims: at most {MAX_DIMS} cross a link")
    x = x.detach().contiguous()
    scale = 1.0
    if not x.is_floating_point() or codec is Codec.NONE:
        codec, payload = Codec.NONE, x.reshape(-1)
    elif codec is Codec.FP16:
        payload = x.to(torch.float16).reshape(-1)
    elif codec is Codec.BF16:
        payload = x.to(torch.bfloat16).reshape(-1)
    else:
        peak = float(x.abs().max()) if x.numel() else 0.0
        scale = peak / 127.0 if peak > 0 else 1.0
        payload = torch.round(x / scale).clamp_(-127, 127).to(torch.int8).reshape(-1)
    header = torch.zeros(HEADER_LEN, dtype=torch.float64)
    if x.dtype not in _DTYPES:
        raise ValueError(f"activations of dtype {x.dtype}: one of {_DTYPES} crosses a link")
    header[0], header[1], header[2] = sent_at, float(codec), scale
    header[3], header[4] = float(_DTYPES.index(x.dtype)), float(x.dim())
    for i, d in enumerate(x.shape):
        header[5 + i] = float(d)
    return Encoded(header, payload)


@dataclass(frozen=True)
class Header:
    sent_at: float
    codec: Codec
    scale: float
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def read(cls, header: torch.Tensor) -> Header:
        ndim = int(header[4])
        shape = tuple(int(header[5 + i]) for i in range(ndim))
        dtype = _DTYPES[int(header[3])]
        return cls(float(header[0]), Codec(int(header[1])), float(header[2]), dtype, shape)

    def payload_buffer(self) -> torch.Tensor:
        """An empty flat tensor the payload is received into."""
        wire = {
            Codec.NONE: self.dtype,
            Codec.FP16: torch.float16,
            Codec.BF16: torch.bfloat16,
            Codec.INT8: torch.int8,
        }[self.codec]
        n = 1
        for d in self.shape:
            n *= d
        return torch.empty(n, dtype=wire)


def decode(head: Header, payload: torch.Tensor) -> torch.Tensor:
    """The tensor `encode` was given (lossy under fp16, bf16 and int8)."""
    if head.codec is Codec.INT8:
        out = payload.to(head.dtype) * head.scale
    else:
        out = payload.to(head.dtype)
    return out.reshape(head.shape)
