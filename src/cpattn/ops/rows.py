"""``write_rows``: write one row per token into a paged cache, in place (an explicit cache write).

DeepSeek-V4 keeps several small per-layer caches with one row per token or
per compressed entry: the sliding-window ring ``[kv]``, the compressor rings
``[kv | gate]``, the compressed entries and the indexer keys. They all share
one layout, ``[num_blocks, block_size, *row]``, and one write: row i goes to
slot ``slots[i] = block * block_size + offset``, or nowhere when the slot is
-1 (a token another DCP rank owns, a ring row overwritten later in the same
write, a padding row). The op mutates ``cache`` (``mutates_args``), so a
captured graph sees the write.
"""

from __future__ import annotations

import torch

from cpattn.ops import registry
from cpattn.ops.paged import scatter_rows


@registry.define("write_rows", mutates_args=("cache",))
def _write_rows_op(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    scatter_rows(cache.view(-1, *cache.shape[2:]), rows, slots)


registry.generic("write_rows")  # sync-free body: every device, and the CPU decomposition


@registry.kernel("write_rows", "cpu")
def _write_rows_cpu(cache, rows, slots):
    keep = (slots >= 0).nonzero().view(-1)  # host-side selection: fine inside a CPU kernel
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots[keep].long(), rows[keep].to(cache.dtype))


@registry.fake("write_rows")
def _write_rows_fake(cache, rows, slots):
    return None


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache.view(-1, *row)[slots[i]] = rows[i]`` for every ``slots[i] >= 0``, in place.

    Arguments
    ---------
    cache: [num_blocks, block_size, *row] contiguous; rows: [T, *row] (cast to
    the cache's dtype); slots: [T] int, distinct where >= 0, -1 skips a row.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.rows import write_rows
    >>> cache = torch.zeros(2, 2, 3)
    >>> write_rows(cache, torch.ones(2, 3), torch.tensor([3, -1]))
    >>> cache[1, 1].tolist(), cache[0, 0].tolist()
    ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    """
    if cache.dim() < 3 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [num_blocks, block_size, *row] tensor; got {tuple(cache.shape)}")
    if rows.shape[1:] != cache.shape[2:]:
        row = ", ".join(map(str, cache.shape[2:]))
        raise ValueError(f"rows {tuple(rows.shape)} must be [T, {row}] like the cache rows")
    if slots.shape != (rows.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [T={rows.shape[0]}]; got {slots.dtype} {tuple(slots.shape)}")
    registry.call("write_rows", cache, rows, slots)
