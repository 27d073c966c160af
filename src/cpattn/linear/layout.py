"""Who holds which tokens of a linear-attention layer under PCP: sequence-order segments.

A linear layer's state is a scan over the tokens *in sequence order*. Each
request's new tokens are cut into S segments (bounds ``c * n // S`` by
default, or any given bounds: empty and one-token segments are fine), and
every rank holds the same number of parts, part i being segment
``segments[rank][i]`` of every request, packed in request order (its own
``cu_seqlens`` from 0). A rank's local tokens are its parts concatenated.

- :meth:`ScanLayout.contiguous` (P segments, rank r holds segment r): the
  plain split.
- :meth:`ScanLayout.head_tail` (2P segments, rank r holds r and 2P-1-r):
  exactly the attention layers' head-tail layout
  (:func:`cpattn.layout.pcp.pcp_plan`: local tokens ``[A | B]``, parts
  ``cu_a`` / ``cu_b``). A hybrid model therefore keeps the tokens where
  the attention layers want them: the linear layers scan the 2P segments in
  sequence order (two summaries per rank) instead of moving tokens, and the
  linear work (linear in the tokens) stays balanced as the attention work is.

Example
-------
>>> lay = ScanLayout.head_tail(2)
>>> lay.segments, lay.num_segments
(((0, 3), (1, 2)), 4)
>>> idx, parts = scan_shard([0, 8], lay, 1)
>>> idx.tolist(), [p.tolist() for p in parts]
([2, 3, 4, 5], [[0, 2], [0, 2]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.ops import checks


@dataclass(frozen=True)
class ScanLayout:
    """``segments[r]``: the sequence-order segment ids of rank r's parts (the same count on every rank)."""

    segments: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        counts = {len(s) for s in self.segments}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(f"segments {self.segments}: every rank must hold the same number (>= 1) of parts")
        flat = sorted(i for s in self.segments for i in s)
        if flat != list(range(len(flat))):
            raise ValueError(f"segments {self.segments} must name each of 0..{len(flat) - 1} exactly once")

    @classmethod
    def contiguous(cls, size: int) -> ScanLayout:
        """P segments; rank r holds segment r."""
        size = checks.integer("pcp_size", size, at_least=1)
        return cls(tuple((r,) for r in range(size)))

    @classmethod
    def head_tail(cls, size: int) -> ScanLayout:
        """2P segments; rank r holds r and 2P-1-r (the PCP attention layout)."""
        size = checks.integer("pcp_size", size, at_least=1)
        return cls(tuple((r, 2 * size - 1 - r) for r in range(size)))

    @property
    def size(self) -> int:
        return len(self.segments)

    @property
    def num_segments(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def parts(self) -> int:
        """Parts per rank."""
        return len(self.segments[0])

    def gathered_segments(self) -> list[int]:
        """Segment id of each row of a rank-major all-gather of the per-part summaries."""
        return [s for r in self.segments for s in r]


def segment_bounds(n: int, num_segments: int) -> list[int]:
    """Default bounds of a request of n tokens: ``[c * n // S for c in 0..S]``.

    >>> segment_bounds(7, 3)
    [0, 2, 4, 7]
    """
    return [c * n // num_segments for c in range(num_segments + 1)]


def scan_shard(cu_seqlens, layout: ScanLayout, rank: int, bounds: list[list[int]] | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank ``rank``'s local tokens of a packed batch: (global row of each local token [T_r] int64, per part its
    ``cu_seqlens`` [B+1] int32).

    bounds: optional per request ``S+1`` non-decreasing offsets from 0 to its length (segment c is
    ``bounds[b][c]:bounds[b][c+1]``); default :func:`segment_bounds`.
    """
    cu = checks.int_list("cu_seqlens", cu_seqlens)
    checks.cumulative("cu_seqlens", cu)
    rank = checks.rank("rank", rank, layout.size, "ranks of the layout")
    s = layout.num_segments
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if bounds is None:
        bounds = [segment_bounds(n, s) for n in lens]
    if len(bounds) != len(lens):
        raise ValueError(f"bounds has {len(bounds)} entries for {len(lens)} requests; give one list per request")
    for b, (n, bd) in enumerate(zip(lens, bounds)):
        if len(bd) != s + 1 or bd[0] != 0 or bd[-1] != n or any(x > y for x, y in zip(bd, bd[1:])):
            raise ValueError(f"bounds[{b}] = {list(bd)} must be {s + 1} non-decreasing offsets from 0 to {n}")
    rows, parts = [], []
    for seg in layout.segments[rank]:
        part_cu = [0]
        for b in range(len(lens)):
            lo, hi = bounds[b][seg], bounds[b][seg + 1]
            rows.extend(range(cu[b] + lo, cu[b] + hi))
            part_cu.append(part_cu[-1] + hi - lo)
        parts.append(torch.tensor(part_cu, dtype=torch.int32))
    return torch.tensor(rows, dtype=torch.int64), parts
