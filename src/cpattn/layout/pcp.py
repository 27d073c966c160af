"""PCP layout: who holds which prefill token (head-tail / zigzag chunks).

Each request's ``n`` new tokens are cut into ``2P`` chunks with bounds
``c * n // (2P)``; rank r owns chunks ``a = r`` and ``b = 2P-1-r``. For
P = 2 and a request of 8 tokens::

    token   0 1 | 2 3 | 4 5 | 6 7
    chunk     0     1     2     3
    rank      0     1     1     0

Causal work per rank is then equal (chunk c costs about c + 1/2; the pair
sums to 2P), which a contiguous split cannot do (efficiency P / (2P-1)).

A rank's local tokens are ordered ``[A | B]``: the a-chunks of all requests
in request order, then the b-chunks. The plan is host-side (Python ints and
small index tensors), built once per batch and shared by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpattn.layout import rows as packed
from cpattn.ops import checks


@dataclass(frozen=True)
class PCPPlan:
    """Host-side PCP plan for one batch (see :func:`pcp_plan`).

    Per rank r (lists indexed by rank):

    - ``token_index[r]``: [T_r] int64, global packed index of each local token.
    - ``positions[r]``: [T_r] int64, absolute position (context + offset).
    - ``cu_a[r]``, ``cu_b[r]``: [B+1] int32, cumulative a- / b-chunk lengths.
    - ``a_bounds[r]``, ``b_bounds[r]``: per request ``(start, end)`` of the
      chunk inside the request's new tokens.
    - ``num_tokens[r]``: T_r.

    Global: ``pcp_size`` (P), ``query_lens`` (new tokens) and ``context_lens`` per request,
    ``cu_seqlens`` [B+1], ``restore_index`` [T] (``cat(parts)[restore_index]``
    is global order), and for the all-gather method ``prefix_index[r] =
    (idx_a, cu_ka, idx_b, cu_kb)``: rows of the padded rank-major gathered
    buffer ``[P * max_tokens]`` holding each request's keys up to the end of
    rank r's a- (b-) chunk, with their cu_seqlens.
    """

    pcp_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    token_index: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]
    cu_a: tuple[torch.Tensor, ...]
    cu_b: tuple[torch.Tensor, ...]
    a_bounds: tuple[tuple[tuple[int, int], ...], ...]
    b_bounds: tuple[tuple[tuple[int, int], ...], ...]
    num_tokens: tuple[int, ...]
    restore_index: torch.Tensor
    prefix_index: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]

    @property
    def max_tokens(self) -> int:
        """Largest T_r: the padded per-rank size of an all-gather."""
        return max(self.num_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    def num_a(self, rank: int) -> int:
        """Number of local tokens in rank's a-chunks (the ``A`` part of ``[A | B]``)."""
        return int(self.cu_a[rank][-1])


def chunk_bounds(n: int, num_chunks: int) -> list[int]:
    """Bounds of ``num_chunks`` near-equal chunks of ``n`` tokens: ``[c * n // num_chunks]``."""
    return [c * n // num_chunks for c in range(num_chunks + 1)]


def _ranges(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenation of ``arange(s, e)`` for each span, int64."""
    parts = [torch.arange(s, e, dtype=torch.int64) for s, e in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def pcp_plan(
    cu_seqlens: torch.Tensor | list[int], pcp_size: int, *, context_lens: torch.Tensor | list[int] | None = None
) -> PCPPlan:
    """Plan a head-tail PCP split of a packed prefill batch.

    Arguments
    ---------
    cu_seqlens: [B+1] cumulative new-token counts (any lengths, zero too):
        integers starting at 0, non-decreasing.
    pcp_size: P, the number of PCP ranks (an integer >= 1).
    context_lens: [B] cached tokens before each request's new tokens
        (prefix caching / chunked prefill); positions start there.

    Floats are refused (never truncated); every bad argument is a ValueError
    naming it.

    Returns
    -------
    A :class:`PCPPlan`.

    Example
    -------
    >>> from cpattn import pcp_plan
    >>> plan = pcp_plan([0, 8], 2)
    >>> plan.token_index[0].tolist(), plan.token_index[1].tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    pcp_size = checks.integer("pcp_size", pcp_size, at_least=1)
    cu = checks.int_list("cu_seqlens", cu_seqlens)
    checks.cumulative("cu_seqlens", cu)
    seq_lens = [b - a for a, b in zip(cu, cu[1:])]
    ctx = [0] * len(seq_lens) if context_lens is None else checks.int_list("context_lens", context_lens)
    checks.nonnegative("context_lens", ctx, len(seq_lens), "one per request")

    p = pcp_size
    bounds = [chunk_bounds(n, 2 * p) for n in seq_lens]
    token_index, positions, cu_a, cu_b, a_bounds, b_bounds = [], [], [], [], [], []
    for r in range(p):
        ab = [(bd[r], bd[r + 1]) for bd in bounds]
        bb = [(bd[2 * p - 1 - r], bd[2 * p - r]) for bd in bounds]
        spans = [(i, s, e) for part in (ab, bb) for i, (s, e) in enumerate(part)]
        token_index.append(_ranges([(cu[i] + s, cu[i] + e) for i, s, e in spans]))
        positions.append(_ranges([(ctx[i] + s, ctx[i] + e) for i, s, e in spans]))
        cu_a.append(torch.tensor(packed.cu_seqlens([e - s for s, e in ab]), dtype=torch.int32))
        cu_b.append(torch.tensor(packed.cu_seqlens([e - s for s, e in bb]), dtype=torch.int32))
        a_bounds.append(tuple(ab))
        b_bounds.append(tuple(bb))
    order = torch.cat(token_index)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    t_max = max(t.numel() for t in token_index)
    where = torch.empty_like(order)  # global token -> row of the gathered buffer
    for rank, idx in enumerate(token_index):
        where[idx] = rank * t_max + torch.arange(idx.numel())
    prefix_index = tuple(
        _prefix(where, cu, a_bounds[r]) + _prefix(where, cu, b_bounds[r]) for r in range(p)
    )
    return PCPPlan(
        pcp_size=p,
        query_lens=tuple(seq_lens),
        context_lens=tuple(ctx),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        token_index=tuple(token_index),
        positions=tuple(positions),
        cu_a=tuple(cu_a),
        cu_b=tuple(cu_b),
        a_bounds=tuple(a_bounds),
        b_bounds=tuple(b_bounds),
        num_tokens=tuple(int(t.numel()) for t in token_index),
        restore_index=restore,
        prefix_index=prefix_index,
    )


def _prefix(where: torch.Tensor, cu: list[int], bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered-buffer rows of keys 0 .. chunk end per request (none for an empty chunk)."""
    lens = [e if e > s else 0 for s, e in bounds]
    idx = _ranges([(cu[i], cu[i] + n) for i, n in enumerate(lens)])
    return where[idx], torch.tensor(packed.cu_seqlens(lens), dtype=torch.int32)


def pcp_shard(x: torch.Tensor, plan: PCPPlan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of a packed global tensor: [T, ...] -> [T_rank, ...].

    ``plan`` is a :class:`PCPPlan` or a :class:`cpattn.dsa.DSACPPlan` (the
    same ``token_index`` / ``restore_index`` / ``num_tokens`` fields).

    Example
    -------
    >>> import torch
    >>> from cpattn import pcp_plan, pcp_shard
    >>> pcp_shard(torch.arange(8), pcp_plan([0, 8], 2), 1).tolist()
    [2, 3, 4, 5]
    """
    rank = checks.rank("rank", rank, len(plan.num_tokens), "the plan's ranks")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != plan.restore_index.numel():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a packed [T={plan.restore_index.numel()}, ...] tensor (the plan's tokens); got {got}")
    return x[plan.token_index[rank].to(x.device)]


def pcp_unshard(parts: list[torch.Tensor], plan: PCPPlan) -> torch.Tensor:
    """Inverse of :func:`pcp_shard`: per-rank [T_r, ...] tensors -> global [T, ...] in request order.

    ``plan`` is a :class:`PCPPlan` or a :class:`cpattn.dsa.DSACPPlan`.

    Example
    -------
    >>> import torch
    >>> from cpattn import pcp_plan, pcp_shard, pcp_unshard
    >>> plan = pcp_plan([0, 5, 8], 2)
    >>> x = torch.arange(8)
    >>> torch.equal(pcp_unshard([pcp_shard(x, plan, r) for r in range(2)], plan), x)
    True
    """
    if len(parts) != len(plan.num_tokens):
        raise ValueError(f"pcp_unshard needs {len(plan.num_tokens)} parts (one per rank); got {len(parts)}")
    for r, x in enumerate(parts):
        if x.shape[0] != plan.num_tokens[r]:
            raise ValueError(f"part {r} has {x.shape[0]} tokens; the plan gives rank {r} {plan.num_tokens[r]}")
    cat = torch.cat(list(parts))
    return cat[plan.restore_index.to(cat.device)]


def causal_pairs(plan: PCPPlan, rank: int) -> int:
    """Exact number of visible (query, key) pairs rank ``rank`` computes over the new tokens.

    Context keys add ``T_r * ctx`` pairs per request and are not counted here.
    Attention FLOPs are ``4 * pairs * Hq * D`` (QK^T and PV, 2 FLOPs a MAC).
    """
    rank = checks.rank("rank", rank, plan.pcp_size, "the plan's PCP ranks")
    return sum(_prefix_pairs(s, e) for s, e in plan.a_bounds[rank] + plan.b_bounds[rank])


def contiguous_causal_pairs(seq_lens: list[int], pcp_size: int, rank: int) -> int:
    """Visible pairs of rank ``rank`` under a plain contiguous split (for comparison)."""
    return sum(_prefix_pairs(*chunk_bounds(n, pcp_size)[rank : rank + 2]) for n in seq_lens)


def _prefix_pairs(s: int, e: int) -> int:
    """sum_{t=s}^{e-1} (t + 1): query t sees keys 0..t."""
    return (e * (e + 1) - s * (s + 1)) // 2


def gather_unshard(group, x: torch.Tensor, plan) -> torch.Tensor:
    """All-gather every rank's [T_r, ...] rows of a token split and restore request order: -> [T, ...].

    ``group``: a :class:`~cpattn.comm.group.Group`. One all-gather, padded to ``plan.max_tokens``; works for
    any plan with ``num_tokens``, ``max_tokens`` and ``restore_index`` (the PCP plan, a DSA-CP plan).
    """
    t_max = plan.max_tokens
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # [T_r, F] (T_r may be 0)
    flat = torch.nn.functional.pad(flat, (0, 0, 0, t_max - flat.shape[0]))  # [t_max, F]
    everything = group.all_gather(flat)  # [P * t_max, F], rank-major
    rows = torch.cat([everything[j * t_max : j * t_max + m] for j, m in enumerate(plan.num_tokens)])
    return rows[plan.restore_index.to(rows.device)].view(-1, *x.shape[1:])
