"""DSA-CP's host-side plan: which tokens each rank keeps (contiguous ranges or PCP head-tail chunks), where
every token's entry lives in the replicated cache, and the work per rank."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from cpattn._deprecation import renamed_kwargs
from cpattn.layout.pcp import pcp_plan
from cpattn.layout import rows as packed
from cpattn.layout.rows import request_of
from cpattn.ops import checks

SPLITS = ("contiguous", "balanced")


@dataclass(frozen=True)
class DSACPPlan:
    """Host-side DSA-CP plan for one batch (see :func:`dsa_cp_plan`).

    Per rank r: ``token_index[r]`` [T_r] global packed token ids,
    ``positions[r]`` [T_r] absolute positions, ``requests[r]`` [T_r] request
    ids, ``num_tokens[r]`` = T_r, ``max_visible[r]`` = max(pos) + 1 (0 if none).

    Global: ``dsa_cp_size`` N, ``split``, ``query_lens`` (new tokens) / ``context_lens`` [B],
    ``cu_seqlens`` [B+1], ``restore_index`` [T] (``cat(parts)[restore_index]``
    is request order), ``gather_rows`` [T] (row of token i in the padded
    rank-major all-gather buffer ``[N * max_tokens]``), ``cache_starts`` [B]
    (first cache row of each request), ``cache_rows`` [T] (cache row token i
    is written to: ``start + ctx + offset``), ``cache_size`` (rows needed).
    """

    dsa_cp_size: int
    split: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    token_index: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]
    requests: tuple[torch.Tensor, ...]
    num_tokens: tuple[int, ...]
    max_visible: tuple[int, ...]
    restore_index: torch.Tensor
    gather_rows: torch.Tensor
    cache_starts: tuple[int, ...]
    cache_rows: torch.Tensor
    cache_size: int

    @property
    def cp_size(self) -> int:
        """Deprecated name of :attr:`dsa_cp_size`."""
        warnings.warn("DSACPPlan.cp_size is deprecated; use DSACPPlan.dsa_cp_size", DeprecationWarning, stacklevel=2)
        return self.dsa_cp_size

    @property
    def max_tokens(self) -> int:
        """Largest T_r: the padded per-rank size of the all-gather."""
        return max(self.num_tokens)


@renamed_kwargs(cp_size="dsa_cp_size")
def dsa_cp_plan(
    cu_seqlens: torch.Tensor | list[int],
    dsa_cp_size: int,
    *,
    context_lens: torch.Tensor | list[int] | None = None,
    cache_starts: list[int] | None = None,
    split: str = "contiguous",
) -> DSACPPlan:
    """Plan how a packed batch's new tokens are split over a DSA-CP group.

    Arguments
    ---------
    cu_seqlens: [B+1] cumulative new-token counts (prefill chunks, or 1 per
        request in decode).
    dsa_cp_size: N, the DSA-CP group's ranks (``cp_size=`` is its deprecated keyword).
    context_lens: [B] cached tokens before each request's new ones (prefix
        caching / chunked prefill / decode); positions start there.
    cache_starts: [B] first row of each request in the replicated cache;
        default packs requests back to back (``sum_{j<b} ctx_j + n_j``).
    split: "contiguous" (the packed token dim cut into N near-equal ranges,
        the guide's DSA-CP) or "balanced" (PCP head-tail chunks per request).

    Example
    -------
    >>> from cpattn.dsa import dsa_cp_plan
    >>> [t.tolist() for t in dsa_cp_plan([0, 8], 2).token_index]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> [t.tolist() for t in dsa_cp_plan([0, 8], 2, split="balanced").token_index]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    dsa_cp_size = checks.integer("dsa_cp_size", dsa_cp_size, at_least=1)
    cu = checks.int_list("cu_seqlens", cu_seqlens)
    checks.cumulative("cu_seqlens", cu)
    seq = [b - a for a, b in zip(cu, cu[1:])]
    ctx = [0] * len(seq) if context_lens is None else checks.int_list("context_lens", context_lens)
    checks.nonnegative("context_lens", ctx, len(seq), "one per request")
    if cache_starts is None:  # requests back to back
        cache_starts = packed.cu_seqlens(c + n for c, n in zip(ctx, seq))[:-1]
    cache_starts = checks.int_list("cache_starts", cache_starts)
    checks.nonnegative("cache_starts", cache_starts, len(seq), "one per request")
    _check_disjoint(cache_starts, [c + n for c, n in zip(ctx, seq)])
    n_tok = cu[-1]
    req_of = request_of(cu)  # [T]
    pos_of = torch.arange(n_tok) - torch.tensor(cu[:-1], dtype=torch.int64)[req_of] + torch.tensor(
        ctx, dtype=torch.int64)[req_of] if n_tok else torch.zeros(0, dtype=torch.int64)  # [T]
    if split == "balanced":
        token_index = list(pcp_plan(cu, dsa_cp_size, context_lens=ctx).token_index)
    else:
        n = dsa_cp_size
        token_index = [torch.arange(r * n_tok // n, (r + 1) * n_tok // n) for r in range(n)]
    num = [int(t.numel()) for t in token_index]
    order = torch.cat(token_index)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(n_tok)
    gather_rows = torch.empty(n_tok, dtype=torch.int64)
    for r, idx in enumerate(token_index):
        gather_rows[idx] = r * max(num) + torch.arange(num[r])
    starts_t = torch.tensor(cache_starts, dtype=torch.int64)
    cache_rows = starts_t[req_of] + pos_of if n_tok else torch.zeros(0, dtype=torch.int64)
    size = max([s + c + n for s, c, n in zip(cache_starts, ctx, seq)], default=0)
    return DSACPPlan(
        dsa_cp_size=dsa_cp_size,
        split=split,
        query_lens=tuple(seq),
        context_lens=tuple(ctx),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        token_index=tuple(token_index),
        positions=tuple(pos_of[t] for t in token_index),
        requests=tuple(req_of[t] for t in token_index),
        num_tokens=tuple(num),
        max_visible=tuple(int(pos_of[t].max()) + 1 if t.numel() else 0 for t in token_index),
        restore_index=restore,
        gather_rows=gather_rows,
        cache_starts=tuple(cache_starts),
        cache_rows=cache_rows,
        cache_size=size,
    )


def _check_disjoint(starts: list[int], sizes: list[int]) -> None:
    """Requests' cache row ranges ``[start, start + ctx + n)`` must not overlap (one request would overwrite another)."""
    spans = sorted((s, s + n, b) for b, (s, n) in enumerate(zip(starts, sizes)) if n > 0)
    for (s0, e0, b0), (s1, e1, b1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(
                f"cache_starts[{b1}] = {s1} puts request {b1} inside request {b0}'s cache rows {s0}..{e0 - 1} "
                "(context_lens + new tokens); give each request its own rows"
            )


def dsa_cp_work(plan: DSACPPlan, topk: int) -> list[dict]:
    """Exact per-rank work of a DSA-CP plan (noise-free load balance).

    Returns one dict per rank: ``tokens``, ``indexer_keys`` (sum over local
    tokens of ``pos + 1``: query-key pairs the indexer scores) and
    ``attended_keys`` (sum of ``min(pos + 1, topk)``: pairs the sparse
    attention computes). Indexer FLOPs are ``2 * indexer_keys * H_I * D_I``;
    attention FLOPs ``2 * attended_keys * H * (Dqk + Dv)``.

    Example
    -------
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_work
    >>> [w["indexer_keys"] for w in dsa_cp_work(dsa_cp_plan([0, 8], 2), 4)]
    [10, 26]
    """
    out = []
    for pos in plan.positions:
        vis = pos + 1
        out.append({
            "tokens": int(pos.numel()),
            "indexer_keys": int(vis.sum()),
            "attended_keys": int(vis.clamp(max=topk).sum()),
        })
    return out

