"""Exact PCP for linear-attention layers: a scan of chunk summaries instead of a KV exchange.

The gated delta recurrence is linear in the state (DESIGN.md §4.13), so a
segment of tokens maps a start state S to ``M S + U`` with its transition
``M = A_n ... A_1`` [Hv, Dk, Dk] and its zero-start state U [Hv, Dk, Dv].
:func:`pcp_gated_delta` on every rank, for its parts (see
:mod:`cpattn.linear.layout`):

1. each part is cut into the chunked op's chunks once (:func:`cpattn.ops.gated_delta_chunks.slabs`:
   the UT solves, decays, decayed ``q k^T``: the bulk of the op's work, done once and kept), and
   summarised: U by the state loop (two small matmuls per chunk, no outputs) from zero -- or, for segment
   0, from the requests' initial state, which every rank has, so U is its end state and M is not needed --
   and M as the product of the chunks' transitions
   ``T_i = end_i I - kd_i^T w_i`` (one batched matmul, then a tree of batched ``Dk x Dk`` products);
2. one all-gather of the summaries ``[M | U]`` ``[parts, B, Hv, Dk, Dk + Dv]`` over the group (bytes
   counted by the group: ``(P-1) * parts * B * Hv * Dk * (Dk + Dv) * 4`` sent per rank, float32);
3. each rank folds the summaries of the segments before each of its parts, in sequence order, onto the
   requests' initial state: ``S <- M S + U`` (segment 0's U is already its end state);
4. each part then runs the op's state loop and outputs from its true start state, on the chunk tensors
   of step 1 (every rank's work before the gather is its parts' chunk tensors and summaries, so the ranks
   meet there at about the same time). Every rank also folds all segments: the final state, the same on
   every rank.

Exact in float64 (to rounding) against one device; NaN in a token reaches
what it reaches there (a NaN summary poisons the start states of the later
segments as the recurrence poisons the state). The price against one device:
per part, the summary's state loop and (after segment 0) the transition product
(~0.35x the chunked op's work over the same tokens at Dk = 64, measured by
``cpattn bench hybrid``; more at Dk = 128: the product is Dk^3 per chunk), and the gather. (An earlier form ran the op
over augmented values ``[0 | v]`` from ``[I | 0]``: ``Dk`` more value
columns, ~1.5-1.8x the op.)

:func:`pcp_causal_conv1d`: the short convolution needs the last ``K - 1``
inputs before each part (a halo). Each rank gathers every part's last
``K - 1`` inputs with a valid flag (a part may hold fewer than K - 1
tokens, or none), and builds each part's conv state from the requests'
conv state and the tails of the segments before it.

Example
-------
>>> import torch, cpattn
>>> from cpattn.linear import ScanLayout, pcp_causal_conv1d, scan_shard
>>> x, w = torch.arange(6.0)[:, None], torch.ones(1, 2)
>>> def rank(group):
...     idx, parts = scan_shard([0, 6], ScanLayout.contiguous(group.size), group.rank)
...     y, _ = pcp_causal_conv1d(group, ScanLayout.contiguous(group.size), x[idx], w, None, parts,
...                              torch.zeros(1, 1, 1), silu=False)
...     return y.flatten().tolist()
>>> cpattn.simulate(2, rank)
[[0.0, 1.0, 3.0], [5.0, 7.0, 9.0]]
"""

from __future__ import annotations

import torch

from cpattn.comm.group import Group
from cpattn.linear.layout import ScanLayout
from cpattn.ops import checks
from cpattn.ops import gated_delta as gd
from cpattn.ops import gated_delta_chunks as chunks
from cpattn.ops.ref import acc_dtype


def _check_parts(layout: ScanLayout, group: Group, parts_cu, total: int, what: str) -> list[list[int]]:
    if layout.size != group.size:
        raise ValueError(f"layout has {layout.size} ranks but the group has {group.size}; build it for the group")
    if len(parts_cu) != layout.parts:
        raise ValueError(f"parts_cu has {len(parts_cu)} entries; the layout gives each rank {layout.parts} parts")
    cus = [[int(c) for c in cu] for cu in parts_cu]
    if len({len(c) for c in cus}) != 1 or sum(c[-1] for c in cus) != total or any(c[0] != 0 for c in cus):
        raise ValueError(f"parts_cu {cus}: every part needs B+1 offsets from 0, the parts summing to {what}")
    return cus


def fold(summaries: torch.Tensor, start: torch.Tensor, dk: int) -> list[torch.Tensor]:
    """Start states of every segment: ``[start, U_0, M_1 U_0 + U_1, ...]`` (S+1 states [B, Hv, Dk, Dv]).

    summaries: [S, B, Hv, Dk, Dk + Dv] ``[M | U]`` in sequence order; segment 0's U is already its end state
    (its owner ran it from ``start``, which every rank has), so its M is not used.
    """
    states = [start]
    for s in range(summaries.shape[0]):
        m, u = summaries[s, ..., :dk], summaries[s, ..., dk:]
        states.append(u if s == 0 else m @ states[-1] + u)
    return states


def pcp_gated_delta(
    group: Group, layout: ScanLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, parts_cu: list[torch.Tensor], initial_state: torch.Tensor, *, scale: float,
    use_qk_l2norm: bool = True, chunk_size: int = gd.CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of this rank's parts, exact for the whole sequence (see the module doc).

    Arguments
    ---------
    group: the PCP group (``layout.size`` ranks).
    q, k: [T_r, Hk, Dk]; v: [T_r, Hv, Dv]; g, beta: [T_r, Hv] -- this rank's
        local tokens, its parts concatenated.
    parts_cu: per part its ``cu_seqlens`` [B+1] (from 0; the same B everywhere).
    initial_state: [B, Hv, Dk, Dv], each request's state before segment 0
        (zeros, or the cached state of a continued request), the same on every rank.
    scale, use_qk_l2norm, chunk_size: as :func:`cpattn.ops.gated_delta_chunk`.

    Returns
    -------
    o: [T_r, Hv, Dv] in q's dtype; final_state: [B, Hv, Dk, Dv] after every
    segment (float32, float64 for float64 inputs), equal on all ranks.
    """
    cus = _check_parts(layout, group, parts_cu, q.shape[0], f"q's {q.shape[0]} tokens")
    gd._check_qkv(q, k, v, g, beta, "T_r")
    gd._check_state("initial_state", initial_state, len(cus[0]) - 1, q, v)
    acc = acc_dtype(q, initial_state)
    nb, hv, dk, dv = initial_state.shape
    chunk_size = checks.integer("chunk_size", chunk_size, at_least=1)
    init = initial_state.to(acc)
    qq, kk = gd.prepare_qk(q, k, hv, scale, use_qk_l2norm, acc)  # [T_r, Hv, Dk]
    vv, gg, bb = v.to(acc), g.to(acc), beta.to(acc)
    out = torch.empty(q.shape[0], hv, dv, dtype=acc, device=q.device)
    sums = torch.zeros(len(cus), nb, hv, dk, dk + dv, dtype=acc, device=q.device)
    later, off = [], 0  # (part, request, token rows, chunk tensors) to run once the start states are known
    for p, (seg, cu) in enumerate(zip(layout.segments[group.rank], cus)):
        for b in range(nb):
            rows = slice(off + cu[b], off + cu[b + 1])
            x = [t[rows].transpose(0, 1) for t in (qq, kk, vv, gg, bb)]  # [Hv, n, D] / [Hv, n]
            if rows.stop == rows.start:  # no tokens: S -> S
                if seg == 0:
                    sums[p, b, ..., dk:] = init[b]
                else:
                    sums[p, b, ..., :dk] = torch.eye(dk, dtype=acc, device=q.device)
                continue
            sl = chunks.slabs(*x, chunk_size)
            if seg == 0:  # starts from the requests' initial state, which every rank has: U is its end state
                sums[p, b, ..., dk:] = chunks.final_state(sl, init[b])
            else:
                sums[p, b, ..., :dk] = chunks.transition(sl)
                sums[p, b, ..., dk:] = chunks.final_state(sl, init.new_zeros(hv, dk, dv))
            later.append((p, b, rows, sl))
        off += cu[-1]
    gathered = group.all_gather(sums)  # [P * parts, B, Hv, Dk, Dk+Dv], rank-major
    seq = torch.empty_like(gathered)
    seq[torch.tensor(layout.gathered_segments(), device=q.device)] = gathered
    starts = fold(seq, init, dk)
    for p, b, rows, sl in later:
        o, _ = chunks.run_slabs(sl, starts[layout.segments[group.rank][p]][b])
        out[rows] = o.transpose(0, 1)
    return out.to(q.dtype), starts[-1]


def _tails(x: torch.Tensor, cu: torch.Tensor, w: int) -> torch.Tensor:
    """Each request's last ``w`` rows of a part [B, w, C+1], the last channel 1 where the row exists."""
    cu = cu.to(device=x.device, dtype=torch.int64)
    e = (cu[1:] - cu[:-1])[:, None] - w + torch.arange(w, device=x.device)  # [B, w] offsets in the request
    live = e >= 0
    rows = torch.where(live, cu[:-1, None] + e, 0)
    vals = x[rows] if x.shape[0] else x.new_zeros(*rows.shape, x.shape[1])
    vals = torch.where(live[..., None], vals, 0.0)
    return torch.cat([vals, live[..., None].to(x.dtype)], dim=-1)


def _append_tail(halo: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The last w rows of ``halo`` [B, w, C] followed by the live rows of ``tail`` [B, w, C+1] (a live suffix)."""
    w = halo.shape[1]
    m = tail[..., -1].sum(-1).to(torch.int64)  # [B] live rows
    both = torch.cat([halo, tail[..., :-1].to(halo.dtype)], dim=1)  # [B, 2w, C]
    i = torch.arange(w, device=halo.device)[None]
    src = torch.where(i < w - m[:, None], m[:, None] + i, w + i)  # [B, w]
    return both.gather(1, src[..., None].expand(-1, -1, both.shape[-1]))


def pcp_causal_conv1d(
    group: Group, layout: ScanLayout, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    parts_cu: list[torch.Tensor], conv_state: torch.Tensor, *, silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv of this rank's parts with halos from the segments before them (see the module doc).

    x: [T_r, C] this rank's local tokens (parts concatenated); weight [C, K]; bias [C] or None; parts_cu as
    :func:`pcp_gated_delta`; conv_state: [B, K-1, C] each request's inputs before segment 0, the same on every
    rank. Returns (y [T_r, C], the conv state after every segment [B, K-1, C], equal on all ranks).
    """
    cus = _check_parts(layout, group, parts_cu, x.shape[0], f"x's {x.shape[0]} tokens")
    w = weight.shape[1] - 1
    tails, off = [], 0
    for cu, cu_t in zip(cus, parts_cu):
        tails.append(_tails(x[off:off + cu[-1]], cu_t, w))
        off += cu[-1]
    gathered = group.all_gather(torch.stack(tails))  # [P * parts, B, w, C+1]
    seq = torch.empty_like(gathered)
    seq[torch.tensor(layout.gathered_segments(), device=x.device)] = gathered
    halos = [conv_state]
    for s in range(seq.shape[0]):
        halos.append(_append_tail(halos[-1], seq[s]))
    ys, off = [], 0
    for seg, cu, cu_t in zip(layout.segments[group.rank], cus, parts_cu):
        y, _ = gd.causal_conv1d(x[off:off + cu[-1]], weight, bias, cu_t.to(x.device), halos[seg], silu=silu)
        ys.append(y)
        off += cu[-1]
    return torch.cat(ys), halos[-1]
