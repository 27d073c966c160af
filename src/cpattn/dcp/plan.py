"""DCP batch planning: :class:`DCPMeta` device tensors from host lengths (:func:`dcp_plan`) or from
tensors alone (:func:`plan_tensors`, for captured programs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.layout.rows import request_of
from cpattn.ops import checks


@dataclass(frozen=True)
class DCPMeta:
    """Device tensors describing one DCP batch (the same object serves every rank).

    Static (Python ints, fixed per captured graph): ``dcp_size`` (N),
    ``interleave_size`` (I), ``block_size``, and the shapes: T =
    ``num_tokens`` query rows (padding included), B requests, ``max_blocks``.

    Tensors (refreshable in place, see :func:`plan_tensors`):

    - ``block_table``: [B, max_blocks] -- shared by every DCP rank.
    - ``seq_lens``: [B] tokens per request *including* this step's new ones;
      ``query_lens``: [B]; ``cu_seqlens_q``: [B+1].
    - ``req_indices``: [T] int64 request of each query row, -1 for padding.
    - ``positions``: [T] int64 absolute position of each query row, -1 for padding.
    - ``kv_lens``: [N, T] int32 -- local keys row t sees on rank r:
      ``local_len(positions[t] + 1, r)`` (0 for padding).
    - ``slot_mapping``: [N, T] int64 -- where rank r writes each new token's
      KV (-1: not its token); pass ``meta.slot_mapping[rank]`` to ``write_kv``.
    """

    dcp_size: int
    interleave_size: int
    block_size: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    req_indices: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T, the static number of query rows (padding included)."""
        return self.req_indices.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]


def plan_tensors(
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    dcp_size: int,
    interleave_size: int,
    block_size: int,
) -> dict[str, torch.Tensor]:
    """The tensors of a :class:`DCPMeta`, by tensor ops only (no host sync; capturable).

    seq_lens, query_lens: [B] int (B >= 1); block_table: [B, max_blocks];
    num_tokens: T >= sum(query_lens) (rows past the sum are padding).
    Returns a dict with ``cu_seqlens_q`` [B+1], ``req_indices`` [T],
    ``positions`` [T], ``kv_lens`` [N, T], ``slot_mapping`` [N, T].

    Example
    -------
    >>> import torch
    >>> t = plan_tensors(torch.tensor([5, 3]), torch.tensor([1, 2]), torch.zeros(2, 4, dtype=torch.long),
    ...                  num_tokens=4, dcp_size=2, interleave_size=1, block_size=4)
    >>> t["positions"].tolist(), t["kv_lens"].tolist()
    ([4, 1, 2, -1], [[3, 1, 2, 0], [2, 1, 1, 0]])
    """
    dev = block_table.device
    b = seq_lens.shape[0]
    seq = seq_lens.to(dev, torch.int64)
    ql = query_lens.to(dev, torch.int64)
    cu = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    cu[1:] = torch.cumsum(ql, 0)  # [B+1]
    rows = torch.arange(num_tokens, device=dev)  # [T]
    req = request_of(cu, rows)  # [T]: b with cu[b] <= row < cu[b+1]; B past the end
    valid = req < b
    rc = req.clamp(max=b - 1)
    pos = seq[rc] - ql[rc] + (rows - cu[rc])  # [T]: queries are the last q_len tokens
    pos = torch.where(valid, pos, -1)
    req = torch.where(valid, req, -1)
    kv_lens = dcp_local_lens(pos + 1, dcp_size, interleave_size).T.to(torch.int32)  # [N, T]; pos -1 -> 0
    slots = torch.stack([
        dcp_slot_mapping(pos, req, block_table, dcp_rank=r, dcp_size=dcp_size,
                         interleave_size=interleave_size, block_size=block_size)
        for r in range(dcp_size)
    ])  # [N, T]
    return {"cu_seqlens_q": cu, "req_indices": req, "positions": pos, "kv_lens": kv_lens, "slot_mapping": slots}


def _as_tensor(name, x, device):
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(checks.int_list(name, x), dtype=torch.int64)
    checks.int_tensor(name, x, dims=1, desc="[B] (or a list of ints)")
    return x.to(device, torch.int64)


def dcp_plan(
    seq_lens: torch.Tensor | list[int],
    query_lens: torch.Tensor | list[int],
    block_table: torch.Tensor,
    *,
    dcp_size: int,
    interleave_size: int,
    block_size: int,
    num_tokens: int | None = None,
    check: bool = True,
) -> DCPMeta:
    """Plan a DCP decode (or mixed decode + chunked-prefill) step.

    Arguments
    ---------
    seq_lens: [B] tokens of each request after this step (cached + new).
    query_lens: [B] new (query) tokens of each request: 1 for plain decode,
        1 + k with k speculative tokens, more for a prefill chunk, 0 for an
        idle request. The queries are the last ``query_lens[b]`` positions.
    block_table: [B, max_blocks] int, shared by every DCP rank.
    dcp_size: N; interleave_size: I (``block_size % I == 0``); block_size: cache block size.
    num_tokens: T, the static row count (pad a captured batch up to its
        bucket size); default ``sum(query_lens)`` (one host sync).
    check: validate lengths against the block table on the host (syncs).

    Returns
    -------
    A :class:`DCPMeta` (identical on every rank).

    Example
    -------
    >>> import torch
    >>> meta = dcp_plan([5, 3], [1, 2], torch.zeros(2, 4, dtype=torch.long),
    ...                 dcp_size=2, interleave_size=1, block_size=4)
    >>> meta.num_tokens, meta.kv_lens[0].tolist()
    (3, [3, 1, 2])
    """
    checks.int_tensor("block_table", block_table, dims=2, desc="[B, max_blocks]")
    dcp_size = checks.integer("dcp_size", dcp_size, at_least=1)
    dev = block_table.device
    seq, ql = _as_tensor("seq_lens", seq_lens, dev), _as_tensor("query_lens", query_lens, dev)
    b = block_table.shape[0]
    if seq.shape != (b,) or ql.shape != (b,) or b < 1:
        raise ValueError(
            f"seq_lens {tuple(seq.shape)} and query_lens {tuple(ql.shape)} must both be [B] with B = "
            f"block_table rows = {b} >= 1 (pad an empty batch with one idle request)"
        )
    if block_size < 1 or interleave_size < 1 or block_size % interleave_size:
        raise ValueError(
            f"block_size ({block_size}) must be a positive multiple of interleave_size ({interleave_size})"
        )
    if num_tokens is None:
        num_tokens = int(ql.sum())
    num_tokens = checks.integer("num_tokens", num_tokens, at_least=0)
    if check:
        bad = (ql < 0) | (ql > seq)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"request {i}: query_lens[{i}] = {int(ql[i])}, seq_lens[{i}] = {int(seq[i])}; need "
                "0 <= query_lens <= seq_lens per request (seq_lens counts cached + new tokens)"
            )
        if int(ql.sum()) > num_tokens:
            raise ValueError(f"num_tokens = {num_tokens} is below sum(query_lens) = {int(ql.sum())}")
        need = int(dcp_local_lens(seq, dcp_size, interleave_size).max()) if b else 0
        if need > block_table.shape[1] * block_size:
            raise ValueError(
                f"a rank holds up to {need} tokens of one request but block_table addresses "
                f"{block_table.shape[1]} blocks x {block_size}; widen the block table"
            )
    t = plan_tensors(seq, ql, block_table, num_tokens=num_tokens, dcp_size=dcp_size,
                     interleave_size=interleave_size, block_size=block_size)
    return DCPMeta(dcp_size=dcp_size, interleave_size=interleave_size, block_size=block_size,
                   block_table=block_table, seq_lens=seq, query_lens=ql, **t)
