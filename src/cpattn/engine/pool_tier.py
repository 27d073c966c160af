"""The KV pool as the step loop's second tier: spans the device blocks lost are fetched back, computed
spans are stored.

The block manager's span ``c`` of a sequence is, under DCP over N ranks with
``interleave_size == block_size``, the pool's whole blocks ``c*N .. c*N + N - 1``
(global block j on rank ``j % N``, :mod:`cpattn.engine.pooling`), and its key
is the pool key of block ``c*N + N - 1``: both chain the same hash, with the
pool's identity (the weights' digest, layout, dtype, block size) in every key.

- **fetch** (at admission, :class:`~cpattn.engine.scheduler.Scheduler` ``tier2``):
  after the device-cached spans, the next spans whose N pool blocks are all
  present are loaded now (host tensors), so nothing can vanish between the
  lookup and the step; the runner writes them into the request's fresh blocks.
- **store** (after each step's update): each rank stores every whole block
  that became computed on it, read from its own cache; the whole chain is
  renewed for eviction.

Example
-------
>>> import torch
>>> from cpattn.pool import DictStore, KVPool, PoolIdentity
>>> pool = KVPool(DictStore(), PoolIdentity("toy", torch.float32, num_layers=1, block_size=2, row_width=3))
>>> tier = PoolTier(pool, dcp_size=1)
>>> tier.fetch([1, 2, 3, 4, 5], 0, 2)                       # nothing stored yet
[]
>>> pool.store(pool.keys([1, 2, 3, 4, 5]), [torch.ones(1, 2, 3), torch.zeros(1, 2, 3)])
2
>>> [p[0].shape for p in tier.fetch([1, 2, 3, 4, 5], 0, 2)]   # two spans, one payload per rank
[torch.Size([2, 3]), torch.Size([2, 3])]
>>> tier.loaded_blocks, tier.loaded_bytes                    # 2 blocks of 1 x 2 x 3 float32
(2, 48)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class PoolTier:
    """A :class:`~cpattn.pool.KVPool` as the second tier of a DCP group of ``dcp_size`` ranks (module doc);
    ``rank``: this process's rank under torchrun, which stores only its own blocks (None: every rank's,
    the simulated mesh)."""

    def __init__(self, pool, dcp_size: int, rank: int | None = None) -> None:
        self.pool, self.n, self.rank = pool, dcp_size, rank  # rank: store only its blocks (torchrun)
        self.loaded_blocks = self.stored_blocks = 0
        self.loaded_bytes = 0  # of the payloads fetch returned (this process's: every rank's N per span)

    def fetch(self, tokens: Sequence[int], start: int, stop: int) -> list[tuple[torch.Tensor, ...]]:
        """Spans ``start .. stop - 1`` (at most) present in the pool, each as N per-rank payloads [B, F]."""
        if stop <= start:
            return []
        n, keys = self.n, self.pool.keys(tokens)
        avail = min(self.pool.lookup(keys) // n, stop)
        if avail <= start:
            return []
        got = self.pool.load(keys[start * n:avail * n])  # an entry lost since the lookup ends the run
        spans = len(got) // n
        self.loaded_blocks += spans * n
        self.loaded_bytes += sum(t.numel() * t.element_size() for t in got[:spans * n])
        return [tuple(got[i * n + r].reshape(got[i * n + r].shape[-2:]) for r in range(n)) for i in range(spans)]

    def store(self, tokens: Sequence[int], blocks: range, table: Sequence[int],
              read: Callable[[int, int], torch.Tensor]) -> int:
        """Store whole pool blocks ``blocks`` of a sequence (its block ids ``table``, one per span): global
        block j is rank ``j % N``'s block ``table[j // N]``, read by ``read(rank, block_id) -> [B, F]``. Whole
        blocks, not whole spans: a span still filling has its first blocks stored already, so an engine of
        another DCP size (a P/D consumer) finds every whole block. Returns the pool blocks written."""
        if not len(blocks):
            return 0
        n, chain = self.n, self.pool.keys(tokens)
        if self.rank is not None:
            blocks = [j for j in blocks if j % n == self.rank]
            if not blocks:
                return 0
        keys = [chain[j] for j in blocks]
        payloads = [read(j % n, table[j // n])[None] for j in blocks]
        done = self.pool.store(keys, payloads, chain=chain[: blocks[-1] + 1])
        self.stored_blocks += done
        return done
