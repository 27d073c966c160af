"""Pool keys (chained prefix hash) and the block codec: exact round trips, every corruption a miss."""

import hashlib
import struct

import pytest
import torch

from cpattn.pool import PoolIdentity, block_keys
from cpattn.pool import codec

IDENT = PoolIdentity("tiny", torch.bfloat16, num_layers=2, block_size=4, row_width=8)


def spec_keys(tokens, ident):
    """The documented formula, written out: key_j = blake2b(key_{j-1} | int64 LE tokens | identity digest)."""
    prev, out = b"\0" * 16, []
    for j in range(len(tokens) // ident.block_size):
        block = tokens[j * ident.block_size : (j + 1) * ident.block_size]
        h = hashlib.blake2b(prev + struct.pack(f"<{len(block)}q", *block) + ident.digest(), digest_size=16,
                            person=b"cpattn-block")
        prev = h.digest()
        out.append(prev.hex())
    return out


def test_keys_follow_the_chained_formula():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert block_keys(tokens, IDENT) == spec_keys(tokens, IDENT)
    assert block_keys(torch.tensor(tokens, dtype=torch.int32), IDENT) == spec_keys(tokens, IDENT)
    assert block_keys(tokens[:3], IDENT) == []


def test_key_depends_on_the_whole_prefix_and_nothing_after():
    a = list(range(16))
    b = list(a)
    b[5] = 99  # block 1 changes
    ka, kb = block_keys(a, IDENT), block_keys(b, IDENT)
    assert ka[0] == kb[0] and all(x != y for x, y in zip(ka[1:], kb[1:]))
    assert block_keys(a[:8], IDENT) == ka[:2]
    # the same block after another prefix gets another key
    assert block_keys([7, 7, 7, 7] + a[4:8], IDENT)[1] != ka[1]


@pytest.mark.parametrize("field,value", [
    ("model", "other"), ("dtype", torch.float16), ("num_layers", 3), ("row_width", 16),
])
def test_identity_fields_change_every_key(field, value):
    from dataclasses import replace

    tokens = list(range(8))
    ka = block_keys(tokens, IDENT)
    kb = block_keys(tokens, replace(IDENT, **{field: value}))
    assert all(x != y for x, y in zip(ka, kb))


def test_block_size_changes_keys():
    from dataclasses import replace

    tokens = list(range(8))
    assert block_keys(tokens, replace(IDENT, block_size=8))[0] not in block_keys(tokens, IDENT)


def test_identity_validates():
    with pytest.raises(ValueError, match="block_size"):
        PoolIdentity("m", torch.float32, 1, 0, 4)
    with pytest.raises(TypeError, match="dtype"):
        PoolIdentity("m", "float32", 1, 2, 4)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
def test_codec_round_trips_exact_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(2, 4, 8, generator=g) * 50).to(dtype)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        t.view(-1)[0] = float("nan")  # NaN payload bits survive
    blob = codec.encode("ab" * 16, t)
    assert len(blob) == codec.encoded_size(dtype, (2, 4, 8))
    out = codec.decode("ab" * 16, bytes(blob), dtype, (2, 4, 8))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_codec_every_truncation_and_every_flipped_byte_is_a_miss():
    t = torch.arange(12, dtype=torch.float16).view(1, 3, 4)
    blob = bytes(codec.encode("cd" * 16, t))
    for n in range(len(blob)):
        assert codec.decode("cd" * 16, blob[:n], torch.float16, (1, 3, 4)) is None, n
    assert codec.decode("cd" * 16, blob + b"\0", torch.float16, (1, 3, 4)) is None
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        assert codec.decode("cd" * 16, bad, torch.float16, (1, 3, 4)) is None, i
    assert codec.decode("cd" * 16, b"\xff" * len(blob), torch.float16, (1, 3, 4)) is None


def test_codec_rejects_other_key_dtype_or_shape():
    t = torch.ones(2, 4, 8, dtype=torch.float16)
    blob = codec.encode("ef" * 16, t)
    assert codec.decode("ef" * 16, blob, torch.float16, (2, 4, 8)) is not None
    assert "filed under" in codec.check("00" * 16, blob, torch.float16, (2, 4, 8))
    assert "dtype" in codec.check("ef" * 16, blob, torch.bfloat16, (2, 4, 8))  # same item size
    assert "shape" in codec.check("ef" * 16, blob, torch.float16, (4, 2, 8))  # same element count
    assert codec.check("ef" * 16, blob, torch.float16, (2, 4, 8)) is None


def test_codec_copies_device_and_strided_payloads():
    t = torch.arange(64, dtype=torch.float32).view(8, 8).t()[None]  # non-contiguous [1, 8, 8]
    out = codec.decode("01" * 16, codec.encode("01" * 16, t), torch.float32, (1, 8, 8))
    assert torch.equal(out, t)
