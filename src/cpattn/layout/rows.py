"""Packed batches: per-request lengths -> ``cu_seqlens``, and rows -> the request each belongs to."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def cu_seqlens(lens: Iterable[int]) -> list[int]:
    """``cu_seqlens`` of per-request lengths: [B] ints -> [B+1] host ints, ``0`` then the running sum.

    Wrap it in ``torch.tensor(..., dtype=...)`` where a tensor is wanted.

    Example
    -------
    >>> cu_seqlens([3, 0, 2])
    [0, 3, 3, 5]
    """
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


def request_of(cu_seqlens: torch.Tensor | Sequence[int], rows: torch.Tensor | None = None, *,
               past: int | None = None) -> torch.Tensor:
    """Request of each packed row: ``b`` with ``cu[b] <= row < cu[b + 1]``; ``B`` (or ``past``) for rows at or past ``cu[-1]``.

    cu_seqlens: [B+1] int (non-decreasing, as the public entry points check), a tensor or host ints;
    rows: [N] int -> [N] int64 (same device as ``rows``); default every row, ``arange(cu[-1])``, which
    gives ``repeat_interleave(arange(B), lens)``; past: the request given rows at or past ``cu[-1]``
    (e.g. -1 for padding rows), default ``B``.

    Example
    -------
    >>> import torch
    >>> request_of(torch.tensor([0, 2, 2, 5]), torch.arange(6)).tolist()
    [0, 0, 2, 2, 2, 3]
    >>> request_of([0, 2, 2, 5]).tolist()
    [0, 0, 2, 2, 2]
    >>> request_of(torch.tensor([0, 2, 2, 5]), torch.arange(6), past=-1).tolist()
    [0, 0, 2, 2, 2, -1]
    """
    cu = cu_seqlens
    if not isinstance(cu, torch.Tensor):
        cu = torch.tensor(list(cu), dtype=torch.int64, device=None if rows is None else rows.device)
    if rows is None:
        rows = torch.arange(int(cu[-1]), device=cu.device)
    req = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    if past is not None:
        req = torch.where(req < cu.shape[0] - 1, req, past)
    return req
