"""DCP layout: which rank of the decode-context-parallel group holds which cached token.

N = ``dcp_size``, I = ``interleave_size`` (``cp_kv_cache_interleave_size``),
B = ``block_size`` with ``B % I == 0``. Tokens are dealt to ranks in runs of
I (DESIGN.md §4.3)::

    owner(t)       = (t // I) % N
    local_index(t) = (t // (I*N)) * I + t % I

For N = 2, I = 2 and 10 tokens::

    token        0 1 2 3 4 5 6 7 8 9
    owner        0 0 1 1 0 0 1 1 0 0
    local index  0 1 0 1 2 3 2 3 4 5      local lens: rank 0 -> 6, rank 1 -> 4

Every rank uses the same block ids (one block table for the group); each
physical block of rank r holds rank r's share. Everything here is plain
tensor arithmetic (no Python loop over tokens, no host sync), so it can run
inside a captured graph. :func:`reshard_kv_blocks` moves whole blocks between
an unsharded (prefill) cache and the DCP layout when ``I == B`` (§4.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.ops import checks


def _check_sizes(dcp_size: int, interleave_size: int, block_size: int | None = None) -> None:
    checks.integer("dcp_size", dcp_size, at_least=1)
    checks.integer("interleave_size", interleave_size, at_least=1)
    if block_size is not None and (checks.integer("block_size", block_size) < 1 or block_size % interleave_size):
        raise ValueError(
            f"block_size ({block_size}) must be a positive multiple of interleave_size ({interleave_size}); "
            "pick an interleave size that divides the block size"
        )


def dcp_owner(t: torch.Tensor, dcp_size: int, interleave_size: int) -> torch.Tensor:
    """DCP rank holding token position ``t``: ``(t // I) % N``.

    t: [...] int tensor of absolute positions (>= 0). Returns the same shape.

    Example
    -------
    >>> import torch
    >>> dcp_owner(torch.arange(8), 2, 2).tolist()
    [0, 0, 1, 1, 0, 0, 1, 1]
    """
    _check_sizes(dcp_size, interleave_size)
    _check_positions("t", t)
    return torch.div(t, interleave_size, rounding_mode="floor") % dcp_size


def dcp_local_index(t: torch.Tensor, dcp_size: int, interleave_size: int) -> torch.Tensor:
    """Index of token ``t`` in its owner's local sequence: ``(t // (I*N)) * I + t % I``.

    t: [...] int tensor of absolute positions (>= 0). Returns the same shape.

    Example
    -------
    >>> import torch
    >>> dcp_local_index(torch.arange(8), 2, 2).tolist()
    [0, 1, 0, 1, 2, 3, 2, 3]
    """
    _check_sizes(dcp_size, interleave_size)
    _check_positions("t", t)
    period = interleave_size * dcp_size
    return torch.div(t, period, rounding_mode="floor") * interleave_size + t % interleave_size


def dcp_local_lens(seq_lens: torch.Tensor, dcp_size: int, interleave_size: int) -> torch.Tensor:
    """Tokens of each sequence held by each rank: [B] -> [B, dcp_size].

    ``base = (S // (I*N)) * I``; ``local_len[r] = base + clip(S - base*N - r*I, 0, I)``.
    Row b sums to ``seq_lens[b]``. Also gives how many keys a query at
    position p sees on rank r: ``dcp_local_lens(p + 1, ...)[:, r]``.

    Example
    -------
    >>> import torch
    >>> dcp_local_lens(torch.tensor([10, 3, 0]), 2, 2).tolist()
    [[6, 4], [2, 1], [0, 0]]
    """
    _check_sizes(dcp_size, interleave_size)
    _check_positions("seq_lens", seq_lens)
    s = seq_lens.long()[..., None]  # [B, 1]
    base = torch.div(s, interleave_size * dcp_size, rounding_mode="floor") * interleave_size  # [B, 1]
    ranks = torch.arange(dcp_size, device=seq_lens.device)  # [N]
    extra = (s - base * dcp_size - ranks * interleave_size).clamp(0, interleave_size)  # [B, N]
    return base + extra


def dcp_slot_mapping(
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    *,
    dcp_rank: int,
    dcp_size: int,
    interleave_size: int,
    block_size: int,
) -> torch.Tensor:
    """Cache slot of each token on rank ``dcp_rank``; -1 where another rank owns it.

    Arguments
    ---------
    positions: [T] absolute position of each token; < 0 marks a padding row.
    req_indices: [T] request (row of ``block_table``) of each token; < 0 marks padding.
    block_table: [B, max_blocks] physical block ids, shared by every DCP rank;
        local index i lives in block ``block_table[b, i // block_size]`` at
        offset ``i % block_size``. Entries < 0 mean "no block".

    Returns
    -------
    slots: [T] int64, ``block * block_size + offset`` or -1 (not written
    here: another rank's token, a padding row, or a missing block -- a -1
    entry, or a local index past the table's columns). A real row whose
    request is not a row of ``block_table`` is a ValueError (not checked
    while tracing or capturing).

    Example
    -------
    >>> import torch
    >>> bt = torch.tensor([[3, 5]])
    >>> dcp_slot_mapping(torch.arange(6), torch.zeros(6, dtype=torch.long), bt,
    ...                  dcp_rank=1, dcp_size=2, interleave_size=1, block_size=2).tolist()
    [-1, 6, -1, 7, -1, 10]
    """
    _check_sizes(dcp_size, interleave_size, block_size)
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank must be in [0, {dcp_size}); got {dcp_rank}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_blocks]; got shape {tuple(block_table.shape)}")
    if positions.shape != req_indices.shape or positions.dim() != 1:
        raise ValueError(
            f"positions {tuple(positions.shape)} and req_indices {tuple(req_indices.shape)} must both be [T]"
        )
    checks.int_tensor("positions", positions, dims=1, desc="[T]")
    checks.int_tensor("req_indices", req_indices, dims=1, desc="[T]")
    checks.int_tensor("block_table", block_table, dims=2, desc="[B, max_blocks]")
    pos = positions.long()
    req = req_indices.long()
    owner = dcp_owner(pos.clamp(min=0), dcp_size, interleave_size)  # [T]
    local = dcp_local_index(pos.clamp(min=0), dcp_size, interleave_size)  # [T]
    nb, mb = block_table.shape
    col = torch.div(local, block_size, rounding_mode="floor")  # [T]
    real = (pos >= 0) & (req >= 0)  # [T] not a padding row
    checks.within("req_indices", req, 0, nb, where=real,
                  expected=f"a row of block_table (0..{nb - 1}), or a negative value for a padding row")
    inside = real & (req < nb) & (col < mb)
    block = block_table[req.clamp(0, max(nb - 1, 0)), col.clamp(0, max(mb - 1, 0))].long()  # [T]
    slot = block * block_size + local % block_size
    keep = inside & (owner == dcp_rank) & (block >= 0)
    return torch.where(keep, slot, torch.full_like(slot, -1))


def _check_positions(name: str, t: torch.Tensor) -> None:
    """An integer tensor of positions or lengths, every entry >= 0 (values: one host read, eager only)."""
    checks.int_tensor(name, t)
    checks.within(name, t, 0, None, expected="a position / length >= 0")


def owned_blocks(num_blocks: int, rank: int, dcp_size: int, *, start: int = 0) -> range:
    """Global blocks ``j`` in ``[start, num_blocks)`` that DCP rank ``rank`` owns when I == B (§4.5).

    Whole blocks are dealt round-robin: block ``j`` lives on rank ``j % N`` as its local block
    ``j // N``. Returns ``range(first, num_blocks, N)`` with ``first`` the least ``j >= start`` of the
    rank; the local ids are ``j // N`` of it. Host ints, no checks (callers check their sizes).

    Example
    -------
    >>> list(owned_blocks(7, 1, 2)), list(owned_blocks(7, 0, 2, start=3)), [j // 2 for j in owned_blocks(7, 1, 2)]
    ([1, 3, 5], [4, 6], [0, 1, 2])
    """
    return range(start + (rank - start) % dcp_size, num_blocks, dcp_size)


def _rows(ids: range) -> slice:
    """A range of block ids as the slice that views those blocks of a [num_blocks, ...] tensor."""
    return slice(ids.start, ids.stop, ids.step)


def reshard_kv_blocks(
    blocks: torch.Tensor, *, dcp_size: int, interleave_size: int, block_size: int
) -> list[torch.Tensor]:
    """Deal one request's unsharded KV blocks to N DCP ranks (P/D transfer, DESIGN.md §4.5).

    With ``interleave_size == block_size`` every block of B consecutive
    tokens belongs wholly to one rank: logical block k goes to rank
    ``k % N`` as its local block ``k // N``, so whole blocks move.

    Arguments
    ---------
    blocks: [num_blocks, block_size, ...] -- the request's blocks in logical
        order, as a PCP prefill engine holds them (``cache[block_table[b, :n]]``).

    Returns
    -------
    N tensors; rank r's is [ceil((num_blocks - r) / N), block_size, ...] in
    local block order. Copy them into rank r's cache at its block ids.

    Example
    -------
    >>> import torch
    >>> parts = reshard_kv_blocks(torch.arange(5)[:, None], dcp_size=2, interleave_size=1, block_size=1)
    >>> [p.flatten().tolist() for p in parts]
    [[0, 2, 4], [1, 3]]
    """
    _check_transfer(dcp_size, interleave_size, block_size)
    if blocks.dim() < 2 or blocks.shape[1] != block_size:
        raise ValueError(
            f"blocks must be [num_blocks, block_size={block_size}, ...]; got shape {tuple(blocks.shape)}"
        )
    n = blocks.shape[0]
    return [blocks[_rows(owned_blocks(n, r, dcp_size))] for r in range(dcp_size)]


def unshard_kv_blocks(
    parts: list[torch.Tensor], *, dcp_size: int, interleave_size: int, block_size: int
) -> torch.Tensor:
    """Inverse of :func:`reshard_kv_blocks`: N ranks' local blocks -> [num_blocks, block_size, ...].

    parts[r]: [n_r, block_size, ...] with ``n_0 >= n_1 >= ... >= n_0 - 1``
    (the counts reshard_kv_blocks produces).

    Example
    -------
    >>> import torch
    >>> x = torch.arange(10.).view(5, 2)
    >>> kw = dict(dcp_size=3, interleave_size=2, block_size=2)
    >>> torch.equal(unshard_kv_blocks(reshard_kv_blocks(x, **kw), **kw), x)
    True
    """
    _check_transfer(dcp_size, interleave_size, block_size)
    if len(parts) != dcp_size:
        raise ValueError(f"parts must hold one tensor per rank ({dcp_size}); got {len(parts)}")
    total = sum(p.shape[0] for p in parts)
    for r, p in enumerate(parts):
        want = len(owned_blocks(total, r, dcp_size))
        if p.shape[0] != want or p.shape[1:] != parts[0].shape[1:]:
            raise ValueError(
                f"parts[{r}] has shape {tuple(p.shape)}; with {total} blocks over {dcp_size} ranks it "
                f"must be [{want}, {', '.join(map(str, parts[0].shape[1:]))}]"
            )
    out = parts[0].new_empty(total, *parts[0].shape[1:])  # [num_blocks, block_size, ...]
    for r, p in enumerate(parts):
        out[_rows(owned_blocks(total, r, dcp_size))] = p
    return out


def _check_transfer(dcp_size: int, interleave_size: int, block_size: int) -> None:
    _check_sizes(dcp_size, interleave_size, block_size)
    if interleave_size != block_size:
        raise ValueError(
            f"whole-block KV transfer needs interleave_size == block_size; got interleave_size="
            f"{interleave_size}, block_size={block_size}. With a smaller interleave each block mixes "
            "tokens of several ranks; set cp_kv_cache_interleave_size = block_size for P/D and KV pooling"
        )


@dataclass(frozen=True)
class HandoffFacts:
    """What one rank's hand-off did: rows (or blocks) it sent / kept / received, bytes sent and received."""

    rows_sent: int = 0
    rows_kept: int = 0
    rows_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
