"""KV block manager for one rank: a free list, per-request block tables, automatic prefix caching.

Host-side bookkeeping only (pure Python, no tensors): which physical block
ids of a paged KV cache ``[num_blocks, block_size, ...]`` each request holds.
The facts follow vLLM V1 (``BlockPool`` / ``KVCacheManager``); the code is ours.

- **Spans.** Under DCP (N ranks, interleave I, block size B, ``B % I == 0``)
  every rank uses the same block ids and column ``c`` of a block table holds,
  on each rank, that rank's share of tokens ``c*B*N .. (c+1)*B*N - 1``
  (DESIGN.md §4.3). ``span = B * N`` tokens per block id, vLLM's "logical
  block size". A rank needs ``ceil(local_len(S, r) / B)`` blocks for S tokens
  (:func:`local_len`); rank 0 holds the largest share, so its count,
  ``ceil(S / span)``, covers every rank: a group runs one manager with
  ``dcp_rank=0`` and rank r reads the first ``blocks_for(S)`` columns of its row.
- **Growth.** :meth:`BlockManager.allocate` grows a request's table to cover
  ``num_tokens`` (all-or-nothing: False and no change when the free list is
  short); :meth:`~BlockManager.trim` gives back the blocks past a shorter
  length (rejected drafts); :meth:`~BlockManager.free` releases everything.
- **Prefix caching.** A full span's key chains over the pool's blocks of B
  tokens exactly as :func:`cpattn.pool.keys.block_keys` does (the span's key
  is the pool key of its last B-token block), so the KV pool can be this
  cache's second tier. Keys are assigned by :meth:`~BlockManager.cache_blocks`
  once the KV is computed; :meth:`~BlockManager.lookup` finds the longest
  cached prefix. Blocks are reference-counted; a freed block keeps its key
  and stays findable until it is handed out again.
- **Eviction.** One free queue, least recently freed at the head (vLLM's
  ``FreeKVCacheBlockQueue``): a request's blocks are appended in reverse, so
  the tail of a chain is evicted before its root. A block with a reference
  is never in the queue, so it is never handed out.

Example
-------
>>> bm = BlockManager(num_blocks=4, block_size=2)
>>> toks = [7, 8, 9, 10, 11]
>>> bm.allocate("a", 5), bm.block_table("a")          # 5 tokens -> 3 blocks
(True, [0, 1, 2])
>>> keys = bm.extend_keys([], toks)                   # 2 full blocks of 2 tokens
>>> bm.cache_blocks("a", keys, num_computed=5); bm.free("a")
>>> hit = bm.lookup(keys, num_tokens=5)              # the same prompt again
>>> hit.block_ids, hit.num_tokens
([0, 1], 4)
>>> bm.allocate("b", 5, prefix=hit), bm.block_table("b"), bm.stats.hit_tokens
(True, [0, 1, 3], 4)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

_DIGEST = 16  # bytes, as cpattn.pool.keys.DIGEST_BYTES
_NO_IDENTITY = b"\0" * _DIGEST


def local_len(num_tokens: int, dcp_size: int, dcp_rank: int, interleave_size: int) -> int:
    """Tokens of a sequence of ``num_tokens`` held by DCP rank ``dcp_rank`` (host ints).

    ``base = (S // (I*N)) * I``; ``local = base + clip(S - base*N - r*I, 0, I)``
    -- the formula of :func:`cpattn.layout.dcp.dcp_local_lens`, for one rank.

    >>> [[local_len(s, 2, r, 2) for s in range(11)] for r in (0, 1)]   # N = 2, I = 2
    [[0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6], [0, 0, 0, 1, 2, 2, 2, 3, 4, 4, 4]]
    """
    base = (num_tokens // (interleave_size * dcp_size)) * interleave_size
    return base + min(max(num_tokens - base * dcp_size - dcp_rank * interleave_size, 0), interleave_size)


def chain_key(parent: str | None, tokens: Sequence[int], identity_digest: bytes) -> str:
    """Key of one block of tokens after ``parent``: the step of :func:`cpattn.pool.keys.block_keys`.

    BLAKE2b-16 over (parent digest or 16 zero bytes, tokens as int64 LE, identity digest),
    personalised ``cpattn-block``; 32 hex characters.

    >>> k = chain_key(None, [1, 2], b"\\0" * 16)
    >>> len(k), chain_key(k, [3, 4], b"\\0" * 16) != chain_key(None, [3, 4], b"\\0" * 16)
    (32, True)
    """
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"cpattn-block")
    h.update(bytes.fromhex(parent) if parent is not None else b"\0" * _DIGEST)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(identity_digest)
    return h.hexdigest()


@dataclass(frozen=True)
class PrefixHit:
    """A lookup's answer: the cached ``block_ids`` covering the first ``num_tokens`` tokens of a
    sequence of ``query_tokens`` (the hit-rate counters add both when the prefix is adopted).
    (Was ``CachedPrefix``, still importable with a DeprecationWarning.)"""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    query_tokens: int = 0


@dataclass(frozen=True)
class BlockStats:
    """Blocks in use (referenced) / free (in the queue; ``cached`` of them still findable);
    prefix-cache ``hit_tokens`` over ``query_tokens`` of the admitted lookups; ``evictions``."""

    used: int
    free: int
    cached: int
    hit_tokens: int
    query_tokens: int
    evictions: int


class BlockManager:
    """Block ids ``0 .. num_blocks - 1`` of one rank (see the module docstring for the policies).

    Arguments
    ---------
    num_blocks, block_size: the paged cache's ``[num_blocks, block_size, ...]``.
    dcp_size, dcp_rank, interleave_size: the DCP layout (``block_size % interleave_size == 0``).
    identity: an object with ``digest() -> bytes`` (a :class:`cpattn.pool.PoolIdentity`) that
        enters every key, as in the pool; None: 16 zero bytes.
    enable_caching: False turns prefix caching off (no keys, no hits).
    """

    def __init__(self, num_blocks: int, block_size: int, *, dcp_size: int = 1, dcp_rank: int = 0,
                 interleave_size: int = 1, identity=None, enable_caching: bool = True) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("dcp_size", dcp_size),
                        ("interleave_size", interleave_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int; got {v!r}")
        if block_size % interleave_size:
            raise ValueError(f"block_size ({block_size}) must be a multiple of interleave_size "
                             f"({interleave_size}); pick an interleave size that divides the block size")
        if not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"dcp_rank must be in [0, {dcp_size}); got {dcp_rank}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dcp_size, self.dcp_rank, self.interleave_size = dcp_size, dcp_rank, interleave_size
        self.span = block_size * dcp_size
        self.enable_caching = enable_caching
        self._ident = identity.digest() if identity is not None else _NO_IDENTITY
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evicted first
        self._ref = [0] * num_blocks
        self._key: list[str | None] = [None] * num_blocks
        self._cached: dict[str, int] = {}  # key -> block id
        self._tables: dict[Hashable, list[int]] = {}
        self._tuples: dict[Hashable, tuple[int, ...]] = {}  # table_ids' tuples, dropped when a table changes
        self._cached_upto: dict[Hashable, int] = {}  # spans of each request cache_blocks has looked at
        self._hits = self._queries = self._evictions = 0
        self._fresh: list[int] = []  # handed out since the last take_fresh(): their rows are stale
        self.changes = 0  # table changes so far: an unchanged count means every table_ids tuple still holds

    # -- sizes -------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks this rank needs for ``num_tokens`` tokens: ``ceil(local_len / block_size)``.

        >>> BlockManager(8, 4, dcp_size=2, dcp_rank=1, interleave_size=2).blocks_for(10)  # local 4
        1
        """
        if self.dcp_rank == 0:  # rank 0's share: ceil(S / span) (the module docstring), without local_len
            return -(-num_tokens // self.span)
        n = local_len(num_tokens, self.dcp_size, self.dcp_rank, self.interleave_size)
        return -(-n // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def stats(self) -> BlockStats:
        return BlockStats(self.num_used, self.num_free, len(self._cached), self._hits, self._queries,
                          self._evictions)

    def block_table(self, req_id: Hashable) -> list[int]:
        """A copy of the request's block ids in column order ([] if it holds none)."""
        return list(self._tables.get(req_id, ()))

    def table_ids(self, req_id: Hashable) -> tuple[int, ...]:
        """The request's block ids as a tuple, the same object until its table changes (a step loop
        hands it on each step; a runner tells an unchanged row by identity).

        >>> bm = BlockManager(4, 2); _ = bm.allocate("a", 3)
        >>> t = bm.table_ids("a"); t, bm.table_ids("a") is t, bm.allocate("a", 4), bm.table_ids("a") is t
        ((0, 1), True, True, True)
        """
        t = self._tuples.get(req_id)
        if t is None:
            t = self._tuples[req_id] = tuple(self._tables.get(req_id, ()))
        return t

    def refcount(self, block_id: int) -> int:
        return self._ref[block_id]

    def key_of(self, block_id: int) -> str | None:
        """The block's prefix-cache key, or None (not a full cached block)."""
        return self._key[block_id]

    # -- keys and lookups --------------------------------------------------------------------
    def extend_keys(self, keys: list[str], tokens: Sequence[int]) -> list[str]:
        """Append to ``keys`` (the chain so far, in place) the keys of the full spans of ``tokens``.

        ``keys[c]`` names span c and its whole prefix: it equals
        ``block_keys(tokens, identity)[(c + 1) * dcp_size - 1]`` (the pool's key).
        """
        if not self.enable_caching:
            return keys
        bs, n = self.block_size, len(tokens) // self.span
        for c in range(len(keys), n):
            k = keys[-1] if keys else None
            for j in range(c * self.dcp_size, (c + 1) * self.dcp_size):
                k = chain_key(k, tokens[j * bs:(j + 1) * bs], self._ident)
            keys.append(k)
        return keys

    def lookup(self, keys: Sequence[str], num_tokens: int) -> PrefixHit:
        """The longest run of cached spans from the start of a sequence of ``num_tokens`` tokens.

        At most ``num_tokens - 1`` tokens hit: one is always left to compute, so the step has a
        logit to sample from (vLLM's rule; a fully cached prompt recomputes its last span).
        ``keys`` is the sequence's chain (:meth:`extend_keys`). Changes nothing (see :meth:`allocate`).
        """
        ids: list[int] = []
        if self.enable_caching:
            for k in keys[:max(num_tokens - 1, 0) // self.span]:
                b = self._cached.get(k)
                if b is None:
                    break
                ids.append(b)
        return PrefixHit(ids, len(ids) * self.span, num_tokens)

    # -- allocation --------------------------------------------------------------------------
    def _needed(self, req_id: Hashable, num_tokens: int, prefix: PrefixHit | None) -> int:
        held = len(self._tables.get(req_id, ()))
        if prefix is not None and prefix.block_ids:
            if held:
                raise ValueError(f"request {req_id!r} already holds {held} blocks; a cached prefix is "
                                 "adopted only by a request that holds none (a new or preempted one)")
            # cached blocks sitting in the free queue leave it when adopted
            return max(self.blocks_for(num_tokens) - len(prefix.block_ids), 0) + sum(
                1 for b in prefix.block_ids if self._ref[b] == 0)
        return max(self.blocks_for(num_tokens) - held, 0)

    def can_allocate(self, req_id: Hashable, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Whether :meth:`allocate` with these arguments would succeed."""
        return self._needed(req_id, num_tokens, prefix) <= len(self._free)

    def allocate(self, req_id: Hashable, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Grow the request's table to cover ``num_tokens`` tokens, adopting ``prefix`` first.

        Returns False, changing nothing, when the free queue is too short. New blocks come from
        the head of the free queue; a block taken that still had a key is evicted (its key forgotten).
        """
        if prefix is None:  # the common case (a running request grows): one count, no queue walk
            table = self._tables.get(req_id)
            need = self.blocks_for(num_tokens) - (0 if table is None else len(table))
            if need <= 0:
                if table is None:
                    self._tables[req_id] = []
                return True
            if need > len(self._free):
                return False
        elif not self.can_allocate(req_id, num_tokens, prefix):
            return False
        table = self._tables.setdefault(req_id, [])
        self._tuples.pop(req_id, None)
        self.changes += 1
        if prefix is not None and prefix.block_ids:
            for b in prefix.block_ids:
                if self._ref[b] == 0:
                    del self._free[b]
                self._ref[b] += 1
            table.extend(prefix.block_ids)
            self._hits += prefix.num_tokens
        if prefix is not None:
            self._queries += prefix.query_tokens
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            b, _ = self._free.popitem(last=False)
            if self._key[b] is not None:
                del self._cached[self._key[b]]
                self._key[b] = None
                self._evictions += 1
            self._ref[b] = 1
            table.append(b)
            self._fresh.append(b)
        return True

    def allocate_each(self, requests: Sequence[tuple[Hashable, int]]) -> bool:
        """:meth:`allocate` ``(req_id, num_tokens)`` for each pair, in order, all or nothing: False, changing
        nothing, when the free queue cannot cover them all (a step's running requests growing at once).

        >>> bm = BlockManager(3, 2); _ = bm.allocate("a", 2), bm.allocate("b", 2)
        >>> bm.allocate_each([("a", 3), ("b", 3)]), bm.block_table("a")     # 2 blocks needed, 1 free
        (False, [0])
        >>> bm.allocate_each([("a", 3), ("b", 2)]), bm.block_table("a")
        (True, [0, 2])
        """
        tables, need = self._tables, 0
        for req_id, num_tokens in requests:
            table = tables.get(req_id)
            need += max(self.blocks_for(num_tokens) - (0 if table is None else len(table)), 0)
        if need > len(self._free):
            return False
        for req_id, num_tokens in requests:
            self.allocate(req_id, num_tokens)
        return True

    def take_fresh(self) -> list[int]:
        """Block ids handed out as new blocks (not prefix hits) since the last call, in order: whatever
        they hold is stale (another request's, or never written), so a runner may poison them.

        >>> bm = BlockManager(4, 2); _ = bm.allocate("a", 3); bm.take_fresh(), bm.take_fresh()
        ([0, 1], [])
        """
        out, self._fresh = self._fresh, []
        return out

    def cache_blocks(self, req_id: Hashable, keys: Sequence[str], num_computed: int) -> None:
        """Make the request's full spans within its first ``num_computed`` tokens findable.

        ``keys`` is the request's chain (:meth:`extend_keys`); only spans whose KV is computed
        (and, for drafts, accepted) may be cached. A key already cached on another block stays
        there (this block then frees as a plain block).
        """
        if not self.enable_caching:
            return
        table = self._tables.get(req_id, [])
        start, stop = self._cached_upto.get(req_id, 0), min(num_computed // self.span, len(keys), len(table))
        for c in range(start, stop):  # spans before ``start`` were looked at in an earlier step
            b, k = table[c], keys[c]
            if self._key[b] is None and k not in self._cached:
                self._key[b] = k
                self._cached[k] = b
        self._cached_upto[req_id] = max(start, stop)

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail is freed first, so it is evicted first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def trim(self, req_id: Hashable, num_tokens: int) -> None:
        """Give back the request's blocks past those ``num_tokens`` tokens need (e.g. rejected drafts)."""
        table = self._tables.get(req_id)
        if table:
            keep = self.blocks_for(num_tokens)
            if keep < len(table):
                self._release(table[keep:])
                del table[keep:]
                self._tuples.pop(req_id, None)
                self.changes += 1

    def free(self, req_id: Hashable) -> None:
        """Release every block of the request (finished, aborted or preempted); unknown ids are a no-op."""
        self._release(self._tables.pop(req_id, []))
        self._tuples.pop(req_id, None)
        self.changes += 1
        self._cached_upto.pop(req_id, None)


def __getattr__(name: str):
    if name == "CachedPrefix":  # renamed: "prefix" is a request's tokens already cached, this is a lookup's answer
        import warnings

        warnings.warn("cpattn.engine.blocks.CachedPrefix is deprecated; use cpattn.engine.blocks.PrefixHit",
                      DeprecationWarning, stacklevel=2)
        return PrefixHit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
