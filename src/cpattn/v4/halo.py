"""Halo exchange for prefill context parallelism: each chunk gets the few tokens before it.

Under PCP a rank holds chunks of each request (head-tail, :func:`cpattn.layout.pcp.pcp_plan`).
A sliding window of W needs, before a chunk starting at s, only the
``W - 1`` tokens ``s - W + 1 .. s - 1``; a compressor only the tokens of the
windows that straddle s. So instead of a ring over the whole sequence,
each rank receives exactly those rows from their owners::

    P = 2, 16 tokens, W = 3 (halo 2)       chunk  0      1      2       3
                                           token  0..3   4..7   8..11   12..15
                                           rank   0      1      1       0
    rank 1 needs 2, 3 (from rank 0) before chunk 1; chunk 2's halo 6, 7 is its own
    rank 0 needs 10, 11 (from rank 1) before chunk 3

Bytes per rank are ``halo x row`` per chunk, independent of the sequence
length. :func:`halo_plan` works on the host (which rank sends which rows to
which rank, grouped by ring shift ``(dst - src) mod P``); :func:`halo_rows`
runs it: one ring exchange per shift with traffic (shift 1 and P - 1 when
chunks are at least a halo long), then one gather builds each chunk's
*extended* rows ``[halo | chunk]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.pcp import PCPPlan


@dataclass(frozen=True)
class HaloPlan:
    """One stream's halo exchange (per rank r, lists indexed by rank).

    shifts: ring shifts with traffic, the same on every rank; send[r][k]:
    [n] local rows rank r sends to ``r + shifts[k]``; recv[r][k]: rows it
    receives from ``r - shifts[k]``; ext_src[r]: [E_r] row of
    ``cat(local rows, received rows in shift order)`` for each extended row;
    ext_pos[r], ext_chunk[r]: [E_r] position and local chunk of each
    extended row (chunk k of rank r: its k-th chunk in local order).
    """

    shifts: tuple[int, ...]
    send: tuple[tuple[torch.Tensor, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    ext_src: tuple[torch.Tensor, ...]
    ext_pos: tuple[torch.Tensor, ...]
    ext_chunk: tuple[torch.Tensor, ...]


def local_chunks(pcp: PCPPlan, rank: int) -> list[tuple[int, int, int, int]]:
    """Rank's chunks in local order: (request, start, end, first local row), empty chunks skipped."""
    out, row = [], 0
    for bounds in (pcp.a_bounds[rank], pcp.b_bounds[rank]):
        for req, (s, e) in enumerate(bounds):
            if e > s:
                out.append((req, s, e, row))
                row += e - s
    return out


def halo_plan(pcp: PCPPlan, halo: Callable[[int], int]) -> HaloPlan:
    """Plan the halo of every chunk: ``halo(s)`` tokens before a chunk starting at position s.

    >>> from cpattn.layout.pcp import pcp_plan
    >>> hp = halo_plan(pcp_plan([0, 16], 2), lambda s: 2)
    >>> hp.shifts, [t.tolist() for t in hp.send[0]], hp.ext_pos[1].tolist()
    ((1,), [[2, 3]], [2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10, 11])
    """
    p = pcp.pcp_size
    owner: dict[tuple[int, int], tuple[int, int]] = {}  # (request, position) -> (rank, local row)
    chunks = [local_chunks(pcp, r) for r in range(p)]
    for r in range(p):
        for req, s, e, row in chunks[r]:
            for pos in range(s, e):
                owner[(req, pos)] = (r, row + pos - s)
    want: list[list[list[int]]] = [[[] for _ in range(p)] for _ in range(p)]  # [dst][src] -> src rows, in order
    layout: list[list[tuple[int, int, int, int]]] = [[] for _ in range(p)]  # per dst: (src, index, pos, chunk)
    for r in range(p):
        for k, (req, s, e, row) in enumerate(chunks[r]):
            for pos in range(max(0, s - halo(s)), s):
                src, src_row = owner[(req, pos)]
                if src == r:
                    layout[r].append((r, src_row, pos, k))
                else:
                    layout[r].append((src, len(want[r][src]), pos, k))
                    want[r][src].append(src_row)
            layout[r].extend((r, row + pos - s, pos, k) for pos in range(s, e))
    shifts = tuple(sh for sh in range(1, p) if any(want[(r + sh) % p][r] for r in range(p)))
    send = tuple(tuple(torch.tensor(want[(r + sh) % p][r], dtype=torch.int64) for sh in shifts) for r in range(p))
    recv = tuple(tuple(len(want[r][(r - sh) % p]) for sh in shifts) for r in range(p))
    ext_src, ext_pos, ext_chunk = [], [], []
    for r in range(p):
        base = {r: 0}
        at = pcp.num_tokens[r]
        for k, sh in enumerate(shifts):
            base[(r - sh) % p] = at
            at += recv[r][k]
        ext_src.append(torch.tensor([base[src] + i for src, i, _, _ in layout[r]], dtype=torch.int64))
        ext_pos.append(torch.tensor([pos for _, _, pos, _ in layout[r]], dtype=torch.int64))
        ext_chunk.append(torch.tensor([k for _, _, _, k in layout[r]], dtype=torch.int64))
    return HaloPlan(shifts, send, recv, tuple(ext_src), tuple(ext_pos), tuple(ext_chunk))


def halo_rows(rows: torch.Tensor, plan: HaloPlan, group: Group) -> torch.Tensor:
    """This rank's extended rows [E_r, ...] (``[halo | chunk]`` per chunk) from its local rows [T_r, ...].

    Every rank calls it (one ring exchange per shift of the plan). A rank
    with nothing to send or receive at a shift still takes part with one
    padding row, so no message is empty.
    """
    r = group.rank
    parts, pending = [rows], []
    for k, shift in enumerate(plan.shifts):
        idx = plan.send[r][k].to(rows.device)
        msg = rows[idx] if idx.numel() else rows.new_zeros(1, *rows.shape[1:])
        pending.append(group.ring_exchange(msg, (max(plan.recv[r][k], 1), *rows.shape[1:]), shift=shift))
    for k, pend in enumerate(pending):
        parts.append(pend.wait()[: plan.recv[r][k]])
    return torch.cat(parts)[plan.ext_src[r].to(rows.device)]
