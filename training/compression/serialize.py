"""Compact binary form of a `Packet`: what crosses the WAN, and what is counted as WAN bytes.

Layout (all integers unsigned LEB128 varints unless said otherwise, tensor data little-endian):

    byte     format version (1)
    varint   length of meta, then meta as compact UTF-8 JSON (length 0 when meta is empty)
    varint   number of tensors, then for each tensor:
        varint  length of name, then name (UTF-8)
        byte    dtype code of the tensor (what `packet_from_bytes` gives back)
        byte    storage code (how its elements are written)
        varint  ndim, then each dim as a varint
        bytes   raw elements: numel * itemsize of the storage, or ceil(numel / 8) for bits

Storage choices that keep the payload small without losing anything:
- bool tensors (sign bits) are bit-packed, 8 per byte;
- int16/int32/int64 tensors (top-k index gaps) are written in the smallest integer type that
  holds their range (uint8, int8, uint16, int16, uint32, int32 or int64) and widened back, or,
  when non-negative and smaller that way, as LEB128 varints (7 bits a byte; a varint tensor's
  byte length follows its dims as one more varint);
- floats (float16, bfloat16, float32, float64) and int8/uint8 are written as they are.
Meta must be JSON (str, int, float, bool, None, lists, str-keyed dicts): tuples come back as
lists. No pickle: a packet from another host cannot run code here.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from training.compression.base import Packet

FORMAT_VERSION = 1

# code -> (torch dtype, numpy little-endian dtype of its raw bytes)
_DTYPES: dict[int, tuple[torch.dtype, np.dtype[Any]]] = {
    1: (torch.float32, np.dtype("<f4")),
    2: (torch.float16, np.dtype("<f2")),
    3: (torch.bfloat16, np.dtype("<i2")),  # raw bf16 bits; numpy has no bfloat16
    4: (torch.float64, np.dtype("<f8")),
    5: (torch.uint8, np.dtype("u1")),
    6: (torch.int8, np.dtype("i1")),
    7: (torch.int16, np.dtype("<i2")),
    8: (torch.int32, np.dtype("<i4")),
    9: (torch.int64, np.dtype("<i8")),
    10: (torch.bool, np.dtype("u1")),
}
_CODE_OF = {torch_dtype: code for code, (torch_dtype, _) in _DTYPES.items()}
# storage-only codes
_UINT16, _UINT32, _BITS, _VARINT = 11, 12, 13, 14
_STORAGE_NUMPY: dict[int, np.dtype[Any]] = {
    **{code: np_dtype for code, (_, np_dtype) in _DTYPES.items() if code != 10},
    _UINT16: np.dtype("<u2"),
    _UINT32: np.dtype("<u4"),
}
# narrowest first: (storage code, min, max)
_INT_STORAGE = [
    (5, 0, 2**8 - 1),
    (6, -(2**7), 2**7 - 1),
    (_UINT16, 0, 2**16 - 1),
    (7, -(2**15), 2**15 - 1),
    (_UINT32, 0, 2**32 - 1),
    (8, -(2**31), 2**31 - 1),
    (9, -(2**63), 2**63 - 1),
]
_WIDENABLE = (torch.int16, torch.int32, torch.int64)


def _write_varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value}")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0

    def take(self, count: int, what: str) -> memoryview:
        end = self.pos + count
        if end > len(self.data):
            raise ValueError(
                f"packet bytes truncated: {what} needs {count} bytes at offset {self.pos}, "
                f"only {len(self.data) - self.pos} left"
            )
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def byte(self, what: str) -> int:
        return int(self.take(1, what)[0])

    def varint(self, what: str) -> int:
        value, shift = 0, 0
        while True:
            byte = self.byte(what)
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 70:
                raise ValueError(f"packet bytes malformed: varint for {what} too long")


def _varint_lengths(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    lengths = np.ones(values.shape, dtype=np.int64)
    for j in range(1, 10):
        lengths += values >= np.uint64(1 << (7 * j))
    return lengths


def _varint_encode(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """LEB128 of non-negative integers, vectorised: 7 bits a byte, high bit = more follows."""
    values = values.astype(np.uint64)
    lengths = _varint_lengths(values)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for j in range(int(lengths.max()) if values.size else 0):
        rows = lengths > j
        chunk = (values[rows] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = np.where(lengths[rows] > j + 1, np.uint64(0x80), np.uint64(0))
        out[starts[rows] + j] = (chunk | more).astype(np.uint8)
    return out


def _varint_decode(raw: np.ndarray[Any, Any], count: int, name: str) -> np.ndarray[Any, Any]:
    ends = np.flatnonzero(raw < 0x80)
    if ends.size != count or (raw.size and ends[-1] != raw.size - 1):
        raise ValueError(f"packet bytes malformed: varint data of {name!r} does not hold {count}")
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if count and lengths.max() > 9:
        raise ValueError(f"packet bytes malformed: varint in {name!r} exceeds 63 bits")
    values = np.zeros(count, dtype=np.uint64)
    for j in range(int(lengths.max()) if count else 0):
        rows = lengths > j
        values[rows] |= (raw[starts[rows] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    return values.astype(np.int64)


def _storage_code(tensor: torch.Tensor, code: int) -> int:
    if tensor.dtype == torch.bool:
        return _BITS
    if tensor.dtype in _WIDENABLE and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        storage = next(s for s, least, most in _INT_STORAGE if least <= low <= high <= most)
        if low >= 0:  # gaps between sorted indices: mostly one byte each as varints
            fixed = tensor.numel() * _STORAGE_NUMPY[storage].itemsize
            varint = int(_varint_lengths(tensor.detach().cpu().numpy().astype(np.uint64)).sum())
            if varint + 4 < fixed:
                return _VARINT
        return storage
    return code


def _raw_elements(tensor: torch.Tensor, storage: int) -> np.ndarray[Any, Any]:
    """The elements as a flat little-endian array in the storage type (no copy if already so)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if storage == _BITS:
        return np.packbits(flat.numpy().astype(np.uint8, copy=False))
    if storage == _VARINT:
        return _varint_encode(flat.numpy())
    if tensor.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().astype("<i2", copy=False)
    return flat.numpy().astype(_STORAGE_NUMPY[storage], copy=False)


def packet_to_bytes(packet: Packet) -> bytes:
    """Serialise `packet` compactly (see the module docstring for the layout)."""
    header = bytearray([FORMAT_VERSION])
    if packet.meta:
        try:
            meta = json.dumps(packet.meta, separators=(",", ":"), allow_nan=True).encode()
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"packet meta must be JSON (str, int, float, bool, None, lists, dicts): {error}"
            ) from error
    else:
        meta = b""
    _write_varint(header, len(meta))
    header += meta
    _write_varint(header, len(packet.tensors))
    # headers and raw arrays joined once at the end: one copy of the payload, not three
    parts: list[bytes | bytearray | memoryview] = []
    for name, tensor in packet.tensors.items():
        code = _CODE_OF.get(tensor.dtype)
        if code is None:
            supported = ", ".join(str(d) for d, _ in _DTYPES.values())
            raise ValueError(
                f"packet tensor {name!r} has dtype {tensor.dtype}; supported: {supported}"
            )
        encoded_name = name.encode()
        _write_varint(header, len(encoded_name))
        header += encoded_name
        storage = _storage_code(tensor, code)
        header.append(code)
        header.append(storage)
        _write_varint(header, tensor.dim())
        for size in tensor.shape:
            _write_varint(header, int(size))
        raw = _raw_elements(tensor, storage)
        if storage == _VARINT:  # the only storage whose length the shape does not imply
            _write_varint(header, raw.size)
        parts.append(header)
        parts.append(raw.data)
        header = bytearray()
    parts.append(header)
    return b"".join(parts)


def _read_tensor(reader: _Reader, name: str) -> torch.Tensor:
    code = reader.byte(f"dtype of {name!r}")
    storage = reader.byte(f"storage of {name!r}")
    if code not in _DTYPES:
        raise ValueError(f"packet bytes malformed: tensor {name!r} has unknown dtype code {code}")
    torch_dtype, np_dtype = _DTYPES[code]
    shape = [reader.varint(f"shape of {name!r}") for _ in range(reader.varint(f"ndim {name!r}"))]
    count = math.prod(shape)
    if storage == _BITS:
        if torch_dtype != torch.bool:
            raise ValueError(f"packet bytes malformed: tensor {name!r} bit-packed but not bool")
        packed = np.frombuffer(reader.take((count + 7) // 8, f"bits of {name!r}"), np.uint8)
        bits = np.unpackbits(packed, count=count).astype(bool)
        return torch.from_numpy(bits).reshape(shape)
    if storage == _VARINT and torch_dtype in _WIDENABLE:
        size = reader.varint(f"varint length of {name!r}")
        raw_varints = np.frombuffer(reader.take(size, f"data of {name!r}"), np.uint8)
        values = _varint_decode(raw_varints, count, name)
        if count and values.max() > torch.iinfo(torch_dtype).max:
            raise ValueError(f"packet bytes malformed: {name!r} overflows {torch_dtype}")
        return torch.from_numpy(values).to(torch_dtype).reshape(shape)
    allowed = {code} | ({s for s, _, _ in _INT_STORAGE} if torch_dtype in _WIDENABLE else set())
    if storage not in allowed or torch_dtype == torch.bool:
        raise ValueError(
            f"packet bytes malformed: tensor {name!r} of {torch_dtype} stored as code {storage}"
        )
    stored = _STORAGE_NUMPY[storage]
    raw = reader.take(count * stored.itemsize, f"data of {name!r}")
    array = np.frombuffer(raw, dtype=stored, count=count)
    if torch_dtype == torch.bfloat16:
        return torch.from_numpy(array.astype(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(array.astype(np_dtype.newbyteorder("="))).reshape(shape)


def packet_from_bytes(data: bytes | bytearray | memoryview) -> Packet:
    """Rebuild the `Packet` that `packet_to_bytes` wrote; ValueError on malformed input."""
    reader = _Reader(data)
    version = reader.byte("format version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"packet bytes have format version {version}; this build reads {FORMAT_VERSION}"
        )
    meta_length = reader.varint("meta length")
    meta: dict[str, Any] = {}
    if meta_length:
        try:
            meta = json.loads(bytes(reader.take(meta_length, "meta")).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"packet bytes malformed: meta is not JSON: {error}") from error
        if not isinstance(meta, dict):
            raise ValueError("packet bytes malformed: meta is not a JSON object")
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(reader.varint("tensor count")):
        name_raw = reader.take(reader.varint("name length"), "tensor name")
        try:
            name = bytes(name_raw).decode()
        except UnicodeDecodeError as error:
            raise ValueError(f"packet bytes malformed: tensor name: {error}") from error
        tensors[name] = _read_tensor(reader, name)
    if reader.pos != len(reader.data):
        raise ValueError(
            f"packet bytes malformed: {len(reader.data) - reader.pos} trailing bytes after "
            "the last tensor"
        )
    return Packet(tensors=tensors, meta=meta)
