"""Checks of attention row metadata: paged-attention rows (:func:`paged_rows`) and the indexer's key map."""

from __future__ import annotations

import torch

from cpattn.ops.checks.core import values_checkable
from cpattn.ops.checks.tensors import _extremes, _where


def paged_rows(block_table: torch.Tensor, req_indices: torch.Tensor, kv_lens: torch.Tensor, *,
               num_blocks: int, block_size: int) -> None:
    """Paged-attention row metadata: requests exist, lengths fit the table, every read block is in the cache.

    Rules: ``req_indices[t] < B`` (negative: a padding row);
    ``0 <= kv_lens[t] <= max_blocks * block_size``; and the blocks a real row
    reads, ``block_table[req, :ceil(kv_lens[t] / block_size)]``, are ids in
    ``0 .. num_blocks-1`` (entries past them are never read and may hold
    anything). Valid input costs two host reads of a few min/max values.
    """
    t = req_indices.shape[0]
    if t == 0 or not values_checkable(block_table, req_indices, kv_lens):
        return
    b, w = block_table.shape
    reach = w * block_size
    _, r_hi, l_lo, l_hi = _extremes(req_indices, kv_lens)
    if r_hi < b and l_lo >= 0 and l_hi <= reach:
        cols = -(-l_hi // block_size)  # no row reads past this column
        if b == 0 or cols == 0 or r_hi < 0:
            return
        table = block_table[:, :cols]
        b_lo, b_hi = _extremes(table)
        if b_lo >= 0 and b_hi < num_blocks:
            return  # the common case: every entry any row could read is a block of the cache
        # a short request may leave unused entries (-1 or anything) in that range: what each one reads
        longest = torch.zeros(b, dtype=torch.int64, device=kv_lens.device).scatter_reduce_(
            0, req_indices.clamp(min=0).long(), torch.where(req_indices >= 0, kv_lens.long(), 0), "amax"
        )  # [B] keys of each request's longest row
        read = torch.arange(cols, device=kv_lens.device) * block_size < longest[:, None]  # [B, cols]
        if not bool((read & ((table < 0) | (table >= num_blocks))).any()):
            return
    _paged_error(block_table, req_indices, kv_lens, num_blocks=num_blocks, block_size=block_size)


def _paged_error(block_table, req_indices, kv_lens, *, num_blocks, block_size) -> None:
    """Raise the ValueError of :func:`paged_rows` for its first offending query row."""
    b, w = block_table.shape
    reach = w * block_size
    live = req_indices >= 0  # [T]
    bad = (req_indices >= b) | (kv_lens < 0) | (kv_lens > reach)  # [T]
    if b > 0 and w > 0:
        n_blk = torch.div(kv_lens + (block_size - 1), block_size, rounding_mode="floor")  # [T]
        needed = (torch.arange(w, device=kv_lens.device) < n_blk[:, None]) & live[:, None]  # [T, W]
        ids = block_table[req_indices.clamp(0, b - 1)]  # [T, W]
        bad = bad | (needed & ((ids < 0) | (ids >= num_blocks))).any(dim=1)
    r = _where(bad)[0]
    req, n = int(req_indices[r]), int(kv_lens[r])
    if req >= b:
        raise ValueError(
            f"req_indices[{r}] = {req}; expected a row of block_table (0..{b - 1}) or a negative value for a "
            "padding row"
        )
    if n < 0:
        raise ValueError(f"kv_lens[{r}] = {n}; expected a key count >= 0 (0 for a row that sees nothing)")
    if n > reach:
        raise ValueError(
            f"kv_lens[{r}] = {n} keys, but a block_table row addresses only {w} blocks x {block_size} = {reach}; "
            "widen the block table"
        )
    row = block_table[req].tolist()
    need = -(-n // block_size)
    col = next(j for j in range(need) if not 0 <= row[j] < num_blocks)
    seen = (f"block_table[{req}, {col}] = {row[col]} is read by query row {r} "
            f"(kv_lens[{r}] = {n} keys need {need} block{'s' * (need != 1)})")
    if row[col] < 0:
        raise ValueError(f"{seen}: a -1 block inside the visible keys; give every visible key a block")
    raise ValueError(
        f"{seen} but the cache has blocks 0..{num_blocks - 1}; the block table must hold block ids of this cache"
    )


def key_ranges(key_start: torch.Tensor, visible: torch.Tensor, *, num_keys: int, max_keys: int) -> None:
    """Indexer key map: ``0 <= key_start``, ``0 <= visible <= max_keys``, ``key_start + visible <= num_keys``.

    One host read; the error names the first query breaking a rule.
    """
    if key_start.numel() == 0 or not values_checkable(key_start, visible):
        return
    end = key_start.long() + visible.long()
    bad = (key_start < 0) | (visible < 0) | (visible > max_keys) | (end > num_keys)
    if not bool(bad.any()):
        return
    t = _where(bad)[0]
    s, v = int(key_start[t]), int(visible[t])
    raise ValueError(
        f"query {t}: key_start[{t}] = {s}, visible[{t}] = {v}; expected 0 <= key_start, 0 <= visible <= "
        f"max_keys = {max_keys} and key_start + visible <= {num_keys} (rows of k). Fix the key map "
        "(causal_key_ranges builds it from cu_seqlens)"
    )
