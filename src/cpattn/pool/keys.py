"""Pool keys: a chained hash over whole blocks of token ids.

``key_j = H(key_{j-1} | tokens of block j | identity)`` where ``identity``
folds in everything that decides the bytes of a block: the model's weights
and config (``weights``, a :func:`cpattn.pool.fingerprint.model_digest`),
the KV layout, the cache dtype and the per-block shape ``[L, block_size, F]``,
plus an optional ``model`` label. A key therefore
names a block *and its whole prefix*: the same tokens after a different
prefix, or under another model or dtype, get another key. Nothing about the
parallel layout enters the key, so a block written under one layout (one
device, PCP = P, DCP = N) is found under any other.

``H`` is BLAKE2b with a 16-byte digest; keys are 32 lowercase hex
characters (valid as LMDB keys and as Mooncake object keys). Only whole
blocks get keys: the tail of a sequence shorter than ``block_size`` has none.

Example
-------
>>> import torch
>>> ident = PoolIdentity("tiny-ds3", torch.bfloat16, num_layers=2, block_size=4, row_width=576)
>>> keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], ident)  # 2 whole blocks; token 9 has no key
>>> len(keys), len(keys[0])
(2, 32)
>>> block_keys([1, 2, 3, 4, 0, 0, 0, 0], ident)[0] == keys[0]  # same first block, same key
True
>>> block_keys([1, 2, 3, 4, 5, 6, 7, 8], ident.with_model("other"))[0] == keys[0]
False
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

DIGEST_BYTES = 16
_VERSION = b"cpattn-kv-pool/2"  # /2: weights digest and KV layout enter the identity


@dataclass(frozen=True)
class PoolIdentity:
    """What a block's bytes depend on besides its tokens.

    Attributes
    ----------
    model: str
        A label (a namespace of its own: pools under two labels never share
        blocks). It does *not* name the weights: ``weights`` does. An identity
        without ``weights`` trusts the label to change whenever the weights do;
        the engine always fills ``weights`` itself
        (:func:`cpattn.engine.pooling.pool_identity`).
    dtype: torch.dtype
        The cache dtype of a payload.
    num_layers, block_size, row_width: int
        One payload is a tensor ``[num_layers, block_size, row_width]``:
        ``row_width`` is F, the columns the engine packs per token and layer
        (K, V and indexer-key rows side by side).
    weights: str
        :func:`cpattn.pool.fingerprint.model_digest` of the config and weights
        ("" when unknown): a changed weight is another identity, a cold pool.
    layout: str
        How a row's columns are laid out (the engine writes its per-layer KV
        layouts here): two layouts of one width never share blocks.
    """

    model: str
    dtype: torch.dtype
    num_layers: int
    block_size: int
    row_width: int
    weights: str = ""
    layout: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype; got {self.dtype!r}")
        for name in ("num_layers", "block_size", "row_width"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int; got {v!r}")
        for name in ("model", "weights", "layout"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str; got {getattr(self, name)!r}")

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(num_layers, block_size, row_width)``: the shape of one payload."""
        return (self.num_layers, self.block_size, self.row_width)

    def with_model(self, model: str) -> PoolIdentity:
        """The same identity for another model name."""
        return replace(self, model=model)

    def digest(self) -> bytes:
        """16 bytes naming this identity (model label, weights, layout, dtype, block shape, key format version).

        >>> import torch
        >>> a = PoolIdentity("m", torch.float32, 2, 4, 8)
        >>> a.digest() == PoolIdentity("m", torch.float32, 2, 4, 8).digest()
        True
        >>> a.digest() == PoolIdentity("m", torch.float16, 2, 4, 8).digest()
        False
        >>> a.digest() == PoolIdentity("m", torch.float32, 2, 4, 8, weights="ab" * 16).digest()  # other weights
        False
        """
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"cpattn-ident")
        for part in (_VERSION, self.model.encode(), self.weights.encode(), self.layout.encode(),
                     str(self.dtype).encode()):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        h.update(struct.pack("<3Q", *self.block_shape))
        return h.digest()


def _token_bytes(tokens: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids as little-endian int64 bytes (one copy, no Python loop for tensors)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(f"tokens must be a 1-D integer tensor; got {tokens.dtype} {tuple(tokens.shape)}")
        return tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return struct.pack(f"<{len(tokens)}q", *(int(t) for t in tokens))


def block_keys(tokens: Sequence[int] | torch.Tensor, identity: PoolIdentity) -> list[str]:
    """Keys of the whole blocks of a token sequence: ``len(tokens) // block_size`` hex strings.

    Arguments
    ---------
    tokens: [S] token ids of one request from its first token (a list or a
        1-D integer tensor; int64 range).
    identity: the model / dtype / block shape the blocks belong to.

    Returns
    -------
    keys: list of ``S // identity.block_size`` strings of 32 hex characters;
        ``keys[j]`` names block j (tokens ``j*B .. (j+1)*B - 1``) and its
        whole prefix.

    Example
    -------
    >>> import torch
    >>> ident = PoolIdentity("m", torch.float32, num_layers=1, block_size=2, row_width=8)
    >>> block_keys(torch.tensor([5, 6, 7]), ident) == block_keys([5, 6], ident)
    True
    """
    raw = _token_bytes(tokens)
    bs = identity.block_size
    n = len(raw) // 8 // bs
    ident = identity.digest()
    keys, prev = [], b"\0" * DIGEST_BYTES
    for j in range(n):
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"cpattn-block")
        h.update(prev)
        h.update(raw[j * bs * 8 : (j + 1) * bs * 8])
        h.update(ident)
        prev = h.digest()
        keys.append(prev.hex())
    return keys
