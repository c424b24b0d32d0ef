"""MindSpore ``.ckpt`` files, read and written without MindSpore or protobuf installed.

A MindSpore checkpoint is one protobuf message (MindSpore's ``checkpoint.proto``)::

    message Checkpoint { repeated Value value = 1; }
    message Value      { string tag = 1; TensorProto tensor = 2; }
    message TensorProto { repeated int64 dims = 1; string tensor_type = 2; bytes tensor_content = 3; }

``tensor_content`` is the raw little-endian C-order buffer; a scalar has no ``dims``. Only the three wire
types this schema uses are decoded (varint, length-delimited, and packed ``dims``); other fields are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from dreamstep.errors import UserError

# MindSpore's tensor_type strings <-> torch dtypes.
MS_DTYPES: dict[str, torch.dtype] = {
    "Float32": torch.float32,
    "Float16": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float64": torch.float64,
    "Int64": torch.int64,
    "Int32": torch.int32,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Bool": torch.bool,
}
TORCH_TO_MS = {v: k for k, v in MS_DTYPES.items()}


class _Corrupt(ValueError):
    """The bytes are not a well-formed checkpoint message."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Corrupt("varint runs past the end")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield (field number, wire type, value) of one message: ints for varints, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise _Corrupt("field runs past the end")
            value, pos = buf[pos:pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise _Corrupt("field runs past the end")
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise _Corrupt(f"unsupported wire type {wire}")
        yield field, wire, value


def _tensor(buf: bytes, tag: str) -> torch.Tensor:
    dims: list[int] = []
    dtype_name, content = "", b""
    for field, wire, value in _fields(buf):
        if field == 1 and wire == 0:
            dims.append(value)
        elif field == 1 and wire == 2:  # packed repeated int64
            pos = 0
            while pos < len(value):
                dim, pos = _varint(value, pos)
                dims.append(dim)
        elif field == 2:
            dtype_name = value.decode()
        elif field == 3:
            content = value
    if dtype_name not in MS_DTYPES:
        raise _Corrupt(f"tensor '{tag}' has tensor_type '{dtype_name}', not one of {', '.join(MS_DTYPES)}")
    dtype = MS_DTYPES[dtype_name]
    numel = 1
    for d in dims:
        numel *= d
    if len(content) != numel * dtype.itemsize:
        raise _Corrupt(f"tensor '{tag}' holds {len(content)} bytes, its shape {dims} needs "
                       f"{numel * dtype.itemsize}")
    flat = torch.frombuffer(bytearray(content), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    return flat.reshape(dims)


def load_mindspore_ckpt(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a MindSpore checkpoint, by parameter name, in their stored dtype and values."""
    buf = Path(path).read_bytes()
    tensors: dict[str, torch.Tensor] = {}
    try:
        for field, wire, value in _fields(buf):
            if field != 1 or wire != 2:
                raise _Corrupt(f"unexpected top-level field {field}")
            tag, tensor_buf = "", None
            for f, _, v in _fields(value):
                if f == 1:
                    tag = v.decode()
                elif f == 2:
                    tensor_buf = v
            if tensor_buf is None:
                raise _Corrupt(f"entry '{tag}' has no tensor")
            tensors[tag] = _tensor(tensor_buf, tag)
    except (_Corrupt, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable MindSpore checkpoint (truncated or corrupt: {e})") from None
    if not tensors:
        raise UserError(f"{path}: the MindSpore checkpoint holds no tensors")
    return tensors


def _key(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _encode_varint(len(payload)) + payload


def save_mindspore_ckpt(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors as a MindSpore checkpoint laid out as MindSpore writes it (unpacked ``dims``)."""
    out = bytearray()
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in TORCH_TO_MS:
            raise UserError(f"tensor '{name}' has dtype {t.dtype}, which a MindSpore checkpoint cannot hold")
        proto = b"".join(_key(1, 0) + _encode_varint(d) for d in t.shape)
        proto += _length_delimited(2, TORCH_TO_MS[t.dtype].encode())
        proto += _length_delimited(3, t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out += _length_delimited(1, _length_delimited(1, name.encode()) + _length_delimited(2, proto))
    Path(path).write_bytes(bytes(out))
