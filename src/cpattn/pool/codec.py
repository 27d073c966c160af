"""The stored form of one KV block: a fixed header, the raw payload bytes, a CRC-32 trailer.

::

    offset  size  field
    0       4     magic b"CPKV"
    4       2     format version (1)
    6       16    the block's key (raw digest; the hex key decoded)
    22      16    dtype name, ASCII, NUL-padded ("bfloat16")
    38      1     ndim (<= 4)
    39      32    shape, 4 x uint64 (unused dims 0)
    71      8     payload bytes
    79      n     payload: the tensor's bytes, C order, native little-endian
    79 + n  4     CRC-32 (zlib) of bytes 0 .. 79 + n

:func:`decode` returns ``None`` -- a miss -- for anything but an intact
entry of the expected key, dtype and shape: a truncated or padded entry,
garbage, a flipped bit (the CRC), an entry filed under another key, or a
payload of another dtype or shape. Storing the key inside the entry makes a
misfiled entry (copied by hand, or a backend bug) a miss instead of wrong KV.

CRC-32 catches every burst error up to 32 bits and any other corruption
with probability 1 - 2**-32; it runs at a few GB/s, well below the cost of
moving the block.

Example
-------
>>> import torch
>>> t = torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4)
>>> blob = encode("00" * 16, t)
>>> torch.equal(decode("00" * 16, blob, torch.bfloat16, (2, 3, 4)), t)
True
>>> decode("00" * 16, blob[:-1], torch.bfloat16, (2, 3, 4)) is None  # truncated
True
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import torch

MAGIC = b"CPKV"
VERSION = 1
_HEADER = struct.Struct("<4sH16s16sB4QQ")
HEADER_BYTES = _HEADER.size  # 79
TRAILER_BYTES = 4
MAX_DIMS = 4


def _dtype_name(dtype: torch.dtype) -> bytes:
    return str(dtype).removeprefix("torch.").encode("ascii")


def encoded_size(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of the stored form of a payload of ``dtype`` and ``shape``.

    >>> import torch
    >>> encoded_size(torch.float16, (2, 4, 8))
    211
    """
    return HEADER_BYTES + math.prod(shape) * dtype.itemsize + TRAILER_BYTES


def encode(key: str, payload: torch.Tensor) -> bytearray:
    """The stored form of ``payload`` under ``key``.

    Arguments
    ---------
    key: 32 hex characters (a :func:`cpattn.pool.keys.block_keys` key).
    payload: a tensor of at most 4 dims, any dtype, on any device (copied to
        the host once).

    Returns
    -------
    blob: bytearray of ``encoded_size(payload.dtype, payload.shape)`` bytes.

    Example
    -------
    >>> import torch
    >>> len(encode("ab" * 16, torch.zeros(2, 4, 8, dtype=torch.float16)))
    211
    """
    if payload.dim() > MAX_DIMS:
        raise ValueError(f"payload must have at most {MAX_DIMS} dims; got shape {tuple(payload.shape)}")
    raw = bytes.fromhex(key)
    if len(raw) != 16:
        raise ValueError(f"key must be 32 hex characters; got {key!r}")
    host = payload.detach().to("cpu").contiguous()
    n = host.numel() * host.element_size()
    shape = tuple(host.shape) + (0,) * (MAX_DIMS - host.dim())
    blob = bytearray(HEADER_BYTES + n + TRAILER_BYTES)
    _HEADER.pack_into(blob, 0, MAGIC, VERSION, raw, _dtype_name(host.dtype), host.dim(), *shape, n)
    if n:
        np.frombuffer(blob, np.uint8, count=n, offset=HEADER_BYTES)[:] = host.reshape(-1).view(torch.uint8).numpy()
    crc = zlib.crc32(memoryview(blob)[: HEADER_BYTES + n])
    struct.pack_into("<I", blob, HEADER_BYTES + n, crc)
    return blob


def check(key: str, blob, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """Why ``blob`` is not an intact entry of ``key`` with ``dtype`` / ``shape``; None when it is.

    >>> import torch
    >>> check("00" * 16, b"garbage", torch.float32, (1,))
    'truncated: 7 bytes, a header needs 79'
    """
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_BYTES + TRAILER_BYTES:
        return f"truncated: {len(view)} bytes, a header needs {HEADER_BYTES}"
    magic, version, raw, name, ndim, *rest = _HEADER.unpack_from(view, 0)
    dims, n = rest[:MAX_DIMS], rest[MAX_DIMS]
    if magic != MAGIC or version != VERSION:
        return f"not a cpattn block (magic {magic!r}, version {version})"
    if raw != bytes.fromhex(key):
        return f"filed under key {key} but written for {raw.hex()}"
    if name.rstrip(b"\0") != _dtype_name(dtype):
        return f"dtype {name.rstrip(bytes(1)).decode(errors='replace')}, expected {_dtype_name(dtype).decode()}"
    if ndim > MAX_DIMS or tuple(dims[:ndim]) != tuple(shape):
        return f"shape {tuple(dims[:min(ndim, MAX_DIMS)])}, expected {tuple(shape)}"
    if n != math.prod(shape) * dtype.itemsize or len(view) != HEADER_BYTES + n + TRAILER_BYTES:
        return f"length {len(view)} bytes, expected {HEADER_BYTES + n + TRAILER_BYTES}"
    (crc,) = struct.unpack_from("<I", view, HEADER_BYTES + n)
    if zlib.crc32(view[: HEADER_BYTES + n]) != crc:
        return "checksum mismatch"
    return None


def decode(key: str, blob, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The payload stored in ``blob`` as a new CPU tensor, or None if it fails :func:`check`.

    ``blob`` is any bytes-like object (bytes, bytearray, memoryview); the
    result owns its memory (the blob may be released afterwards).

    Example
    -------
    >>> import torch
    >>> blob = encode("11" * 16, torch.ones(2, 2))
    >>> decode("11" * 16, blob, torch.float32, (2, 2)).sum().item()
    4.0
    >>> blob[HEADER_BYTES] ^= 1  # one flipped bit
    >>> decode("11" * 16, blob, torch.float32, (2, 2)) is None
    True
    """
    if check(key, blob, dtype, shape) is not None:
        return None
    out = torch.empty(shape, dtype=dtype)
    n = out.numel() * out.element_size()
    if n:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(blob, np.uint8, count=n, offset=HEADER_BYTES)
    return out
