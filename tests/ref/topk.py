"""The top-k rule every sparse selection in the library keeps, written as a Python sort.

Best score first, the lower index first among equal scores; ``-inf`` and NaN scores are never chosen.
DSA's ``topk_indices``, GLM-5's shared top-k and V4's CSA indexer are all checked against it.
"""

from __future__ import annotations

import torch

NEG = float("-inf")


def topk_order(scores: list[float], k: int) -> list[int]:
    """The indices of the ``k`` best finite scores, (score desc, index asc); fewer when fewer are finite.

    >>> topk_order([1.0, 3.0, float("-inf"), 3.0, float("nan")], 3)
    [1, 3, 0]
    """
    keep = [i for i, s in enumerate(scores) if s == s and s != NEG]
    return sorted(keep, key=lambda i: (-scores[i], i))[:k]


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, S] -> int32 [T, k]: :func:`topk_order` of each row, padded with -1."""
    out = [(topk_order(row, k) + [-1] * k)[:k] for row in scores.tolist()]
    return torch.tensor(out, dtype=torch.int32).view(len(out), k)
