"""Rows of a packed batch -> the request each belongs to."""

from __future__ import annotations

import torch


def request_of(cu_seqlens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Request of each packed row: ``b`` with ``cu[b] <= row < cu[b + 1]``; ``B`` for rows at or past ``cu[-1]``.

    cu_seqlens: [B+1] int (non-decreasing, as the public entry points check);
    rows: [N] int -> [N] int64 (same device as ``rows``).

    Example
    -------
    >>> import torch
    >>> request_of(torch.tensor([0, 2, 2, 5]), torch.arange(6)).tolist()
    [0, 0, 2, 2, 2, 3]
    """
    return torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)
