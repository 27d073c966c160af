"""Which pool blocks a DCP rank stores and loads, and where they go in its cache.

With the interleave size equal to the block size (DESIGN.md §4.5), global
block j of a request belongs wholly to DCP rank ``j % N`` and is that rank's
local block ``j // N``. Every rank reads and writes only its own blocks:
no collective, no block split. For N = 2 and 7 blocks::

    global block   0 1 2 3 4 5 6
    rank           0 1 0 1 0 1 0
    local block    0 0 1 1 2 2 3

Keys do not depend on N, so blocks stored under DCP = 2 serve DCP = 4 or one
device: each reader simply picks its own subset of the same key list.

Per request under DCP, on every rank::

    keys = pool.keys(tokens)
    hit = pool.lookup(keys)                   # the full list: same answer on every rank
    mine = rank_blocks(keys[:hit], rank, n)   # this rank's cached blocks
    got = pool.load(mine.keys)                # -> local blocks mine.local_ids[:len(got)]
    ... after the prefill ...
    new = rank_blocks(keys, rank, n, start=hit)
    pool.store(new.keys, [my_cache_block(i) for i in new.local_ids])

A rank whose load comes back short (an entry evicted or found corrupt after
the lookup) holds fewer cached blocks than its peers: the engine must then
agree on ``min`` over the group (one scalar) or recompute that request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpattn.layout.dcp import owned_blocks


@dataclass(frozen=True)
class RankBlocks:
    """One rank's share of a request's blocks.

    global_ids[i] is the request's block number, local_ids[i] its position in
    this rank's local block sequence (``global // N``), keys[i] its pool key.
    """

    global_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    keys: tuple[str, ...]


def rank_blocks(keys: Sequence[str], rank: int, dcp_size: int, *, start: int = 0) -> RankBlocks:
    """The blocks ``j >= start`` of ``keys`` that DCP rank ``rank`` of ``dcp_size`` owns.

    Arguments
    ---------
    keys: the request's block keys, block 0 first (:meth:`KVPool.keys`).
    rank, dcp_size: this rank and the DCP group size N (1: one device).
    start: first global block to consider (e.g. the number already cached
        when choosing which new blocks to store).

    Returns
    -------
    RankBlocks with ``global_ids = [j for j in range(start, len(keys)) if j % N == rank]``,
    ``local_ids = [j // N ...]`` and their keys.

    Example
    -------
    >>> keys = [f"k{j}" for j in range(7)]
    >>> rb = rank_blocks(keys, 1, 2)
    >>> rb.global_ids, rb.local_ids, rb.keys
    ((1, 3, 5), (0, 1, 2), ('k1', 'k3', 'k5'))
    >>> rank_blocks(keys, 0, 2, start=3).global_ids
    (4, 6)
    >>> rank_blocks(keys, 0, 1).local_ids == tuple(range(7))
    True
    """
    if dcp_size < 1 or not 0 <= rank < dcp_size:
        raise ValueError(f"need 0 <= rank < dcp_size with dcp_size >= 1; got rank={rank}, dcp_size={dcp_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0; got {start}")
    ids = tuple(owned_blocks(len(keys), rank, dcp_size, start=start))
    return RankBlocks(ids, tuple(j // dcp_size for j in ids), tuple(keys[j] for j in ids))
