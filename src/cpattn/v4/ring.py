"""Paged ring buffers: the per-request state of DeepSeek-V4's sliding window and compressors.

A ring keeps the last ``R`` positions of a request: position p lives in slot
``p % R``, slot s in block ``block_table[b, s // block_size]`` at offset
``s % block_size`` (the layout of :func:`cpattn.ops.window_attention.window_attention_with_lse`).
A step that appends ``n`` tokens after ``L`` cached ones reads the ``back``
positions before L and its own n (the window: ``back = W - 1``; a
compressor: the tokens of the windows that complete, ``back = 2m - 1``
overlapping, ``m - 1`` not). Two ways, planned on the host by :func:`ring_plan`:

- in place, when ``n <= R - back``: write the n new rows into the ring, then
  read through its block table. Decode steps (1 + k tokens) always do this.
- through a scratch ring, when n is larger (prefill): copy the ``back`` old
  rows and the n new ones into a scratch ring big enough for both, read
  there, then *commit* the new rows to the ring (only the last R of them).

Capacity and rewinds: with ``R = back + 1 + max_rewind`` (rounded up to
whole blocks) a ring can be rewound by up to ``max_rewind`` tokens below the
highest length it ever held, and a step of up to ``1 + max_rewind`` tokens
runs in place::

    W = 4 (back 3), max_rewind 2: R = 6 slots
    held after appending 0..9 : positions 4..9
    rewind 2 -> length 8      : the next step reads 5..7 (all still held)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.layout.rows import cu_seqlens, request_of
from cpattn.ops.rows import write_rows


def ring_capacity(back: int, max_rewind: int, block_size: int) -> int:
    """Slots per request: ``back + 1 + max_rewind`` rounded up to whole blocks.

    >>> ring_capacity(127, 3, 16)
    144
    """
    need = back + 1 + max_rewind
    return -(-need // block_size) * block_size


def ring_slots(block_table: torch.Tensor, block_size: int, req: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat cache row of position p of request b: [T] (sync-free tensor math).

    block_table: [B, n]; req, positions: [T] int (positions >= 0). The ring
    holds ``n * block_size`` slots.

    >>> ring_slots(torch.tensor([[5, 2]]), 4, torch.tensor([0, 0, 0]), torch.tensor([0, 5, 9])).tolist()
    [20, 9, 21]
    """
    ring = block_table.shape[1] * block_size
    s = positions.long() % ring
    blk = block_table[req.long(), torch.div(s, block_size, rounding_mode="floor")].long()
    return blk * block_size + s % block_size


@dataclass(frozen=True)
class RingPlan:
    """How one step reads and writes one kind of ring (host-built, device tensors).

    table: [B, n] -- the block table reads go through (the ring's, or the
    scratch ring's); write: [T] -- slots of the step's new rows in that ring.
    When a scratch ring is used (``scratch_blocks > 0``): copy_src / copy_dst
    [K] -- old rows moved from the ring into the scratch ring; commit: [T] --
    slots of the new rows in the ring itself (-1: overwritten by a later row
    of the same step, so never written).
    """

    table: torch.Tensor
    write: torch.Tensor
    scratch_blocks: int = 0
    copy_src: torch.Tensor | None = None
    copy_dst: torch.Tensor | None = None
    commit: torch.Tensor | None = None


def ring_plan(
    block_table: torch.Tensor, block_size: int, back: int, context_lens: list[int], query_lens: list[int]
) -> RingPlan:
    """Plan one step over a ring (see the module doc).

    block_table: [B, n] the ring's blocks; back: positions before the step's
    first token that it reads; context_lens / query_lens: per request, L and n.

    >>> p = ring_plan(torch.tensor([[0, 1]]), 2, 1, [5], [2])  # ring of 4, in place
    >>> p.scratch_blocks, p.write.tolist()
    (0, [1, 2])
    >>> p = ring_plan(torch.tensor([[0, 1]]), 2, 1, [5], [6])  # 1 + 6 > 4: scratch ring of 4 blocks
    >>> p.scratch_blocks, p.copy_src.tolist(), p.commit.tolist()
    (4, [0], [-1, -1, 3, 0, 1, 2])
    """
    dev = block_table.device
    b_n, width = block_table.shape
    ring = width * block_size
    req = request_of(cu_seqlens(query_lens))
    pos = torch.cat([torch.arange(l, l + n) for l, n in zip(context_lens, query_lens)] or [torch.zeros(0)]).long()
    req, pos = req.to(dev), pos.to(dev)
    if max(query_lens, default=0) <= ring - back:
        return RingPlan(block_table, ring_slots(block_table, block_size, req, pos))
    per = -(-(back + max(query_lens)) // block_size)  # scratch blocks per request
    table = torch.arange(b_n * per, device=dev).view(b_n, per)
    old = [(b, p) for b, l in enumerate(context_lens) for p in range(max(0, l - back), l)]
    old_req = torch.tensor([b for b, _ in old], dtype=torch.int64, device=dev)
    old_pos = torch.tensor([p for _, p in old], dtype=torch.int64, device=dev)
    ends = torch.tensor([l + n for l, n in zip(context_lens, query_lens)], dtype=torch.int64, device=dev)
    keep = pos >= ends[req] - ring  # rows later rows of the same step do not overwrite
    commit = torch.where(keep, ring_slots(block_table, block_size, req, pos), -1)
    return RingPlan(table, ring_slots(table, block_size, req, pos), b_n * per,
                    ring_slots(block_table, block_size, old_req, old_pos),
                    ring_slots(table, block_size, old_req, old_pos), commit)


def ring_extend(cache: torch.Tensor, plan: RingPlan, rows: torch.Tensor) -> torch.Tensor:
    """Write the step's new rows [T, *row] and return the ring to read (``plan.table`` addresses it).

    In place: writes into ``cache`` and returns it. Scratch: returns a new
    NaN-poisoned ring holding the ``back`` old rows and the new ones; call
    :func:`ring_commit` afterwards.
    """
    if not plan.scratch_blocks:
        write_rows(cache, rows, plan.write)
        return cache
    scratch = torch.full((plan.scratch_blocks, *cache.shape[1:]), float("nan"), dtype=cache.dtype, device=cache.device)
    flat = cache.view(-1, *cache.shape[2:])
    write_rows(scratch, flat[plan.copy_src], plan.copy_dst)
    write_rows(scratch, rows, plan.write)
    return scratch


def ring_commit(cache: torch.Tensor, plan: RingPlan, rows: torch.Tensor) -> None:
    """After a scratch step: write the new rows [T, *row] that stay into the ring itself (no-op in place)."""
    if plan.scratch_blocks:
        write_rows(cache, rows, plan.commit)
