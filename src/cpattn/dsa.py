"""DeepSeek Sparse Attention across devices: DSA-CP and key-sharded exact top-k (DESIGN.md §4.4).

Three entry points, all pure functions of tensors, a host-side plan and a
:class:`~cpattn.comm.Group`:

``dsa_attention`` -- one device: indexer -> top-k -> sparse MLA over a packed
varlen batch. The single-device meaning of everything below.

``dsa_cp_attention`` -- DSA-CP as in the guide. Tokens are split over the
group (``split="contiguous"``: the packed token dim cut into N ranges, as the
guide's DSA-CP / FlashComm does; ``split="balanced"``: the PCP head-tail
chunks of :func:`cpattn.layout.pcp.pcp_plan`). Each rank keeps all heads of
its tokens. The small per-token pieces ``[latent 512 | rope 64 | indexer
key]`` are all-gathered (one collective) and written into a replicated cache,
so the indexer sees every key and local top-k *is* the global top-k. The
output stays token-sharded or returns to the head-sharded layout with one
all-to-all::

    rank r: q, latent, k_I of its T_r tokens
        -- all_gather([latent | k_I]) --> replicated cache (+ cached context)
        -- indexer + top-k (exact) --> sparse MLA --> out [T_r, H, 512]
        -- all_to_all (output="head") --> out [T, H/N, 512]

Work per rank: the indexer of a token at position p scores p + 1 keys, its
sparse attention min(p + 1, k) keys; :func:`dsa_cp_work` reports both per
rank, for either split (contiguous ranges leave the last rank the longest
prefixes; head-tail pairs even them out). A layer without an indexer
(GLM-5's "shared" layers) reuses the selection a rank computed on an
earlier layer (``return_indices=True``): :func:`dsa_cp_sparse_attention`
gathers only its latents and attends the same cache rows.

``dsa_dcp_attention`` -- sparse attention over a key-sharded (DCP) cache:
rank r holds a subset of the keys, named by their global positions. Each
rank scores its own keys and keeps its local top-k candidates
``(score, global id)``; the candidates are all-gathered and the global top-k
re-selected with the same strict order (score descending, id ascending).
This is exact: an element of the global top-k has fewer than k elements
ahead of it globally, hence fewer than k ahead of it on its owner, so it is
among its owner's candidates. The union of the local top-k sets is NOT the
global top-k (it holds up to N*k keys); attending that union would change
the result. Each rank then attends the selected keys it owns and the
partials are merged by LSE (:func:`cpattn.ops.merge_attn_states`).

The softmax scale is always the model's (``qk_head_dim**-0.5 * mscale**2``,
:func:`cpattn.ops.dsa.mla_softmax_scale`), never ``576**-0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.dcp import dcp_owner
from cpattn.layout.pcp import pcp_plan
from cpattn.ops import checks, merge_attn_states
from cpattn.ops.dsa import causal_key_ranges, indexer_scores, sparse_mla_attention_with_lse, topk_indices

SPLITS = ("contiguous", "balanced")
OUTPUTS_CP = ("token", "head")
OUTPUTS_DCP = ("replicated", "head")


# =========================================================================== one device
def dsa_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    q_index: torch.Tensor,
    w_index: torch.Tensor,
    k_index: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    cu_seqlens_k: torch.Tensor | list[int],
    *,
    topk: int,
    softmax_scale: float,
    value_dim: int = 512,
    return_lse: bool = False,
    return_indices: bool = False,
):
    """DSA on one device over a packed varlen batch (bottom-right causal).

    Arguments
    ---------
    q: [Tq, H, Dqk] -- absorbed queries (Dqk = 576 = 512 latent + 64 rope).
    latent: [Tk, Dqk] -- one ``[latent | rope]`` entry per key token.
    q_index: [Tq, H_I, D_I]; w_index: [Tq, H_I]; k_index: [Tk, D_I] -- indexer.
    cu_seqlens_q, cu_seqlens_k: [B+1] -- request b's queries are the last
        ``Lq`` of its ``Lk`` key tokens (query i sees keys ``0 .. Lk-Lq+i``).
    topk: ``index_topk`` (2048 in DeepSeek-V3.2); softmax_scale: the model's.

    Returns
    -------
    out [Tq, H, value_dim]; with ``return_lse`` also lse [Tq, H] float32;
    with ``return_indices`` also the selected request-local key positions
    [Tq, topk] int32 (-1 padded), in (score desc, position asc) order.

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import dsa_attention
    >>> T, H = 6, 4
    >>> out = dsa_attention(torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16),
    ...                     torch.rand(T, 2), torch.randn(T, 16), [0, 6], [0, 6],
    ...                     topk=3, softmax_scale=0.1, value_dim=32)
    >>> out.shape
    torch.Size([6, 4, 32])
    """
    cq, ck = checks.int_list("cu_seqlens_q", cu_seqlens_q), checks.int_list("cu_seqlens_k", cu_seqlens_k)
    checks.cumulative("cu_seqlens_q", cq, total=q.shape[0], of=f"q has {q.shape[0]} tokens", exact=True)
    checks.cumulative("cu_seqlens_k", ck, total=latent.shape[0], of=f"latent has {latent.shape[0]} rows")
    if k_index.shape[0] != latent.shape[0]:
        raise ValueError(f"k_index has {k_index.shape[0]} rows but latent {latent.shape[0]}; one of each per key token")
    start, visible = causal_key_ranges(cq, ck)
    start, visible = start.to(q.device), visible.to(q.device)
    lens = [b - a for a, b in zip(ck, ck[1:])]
    scores = indexer_scores(q_index, w_index, k_index, start, visible, max(lens, default=0))  # [Tq, M]
    idx = topk_indices(scores, topk)  # [Tq, k] request-local positions
    rows = torch.where(idx >= 0, start[:, None] + idx, -1)  # [Tq, k] rows of latent
    out, lse = sparse_mla_attention_with_lse(q, latent, rows, softmax_scale=softmax_scale, value_dim=value_dim)
    res = (out,) + ((lse,) if return_lse else ()) + ((idx,) if return_indices else ())
    return res[0] if len(res) == 1 else res


# =========================================================================== DSA-CP plan
@dataclass(frozen=True)
class DSACPPlan:
    """Host-side DSA-CP plan for one batch (see :func:`dsa_cp_plan`).

    Per rank r: ``token_index[r]`` [T_r] global packed token ids,
    ``positions[r]`` [T_r] absolute positions, ``requests[r]`` [T_r] request
    ids, ``num_tokens[r]`` = T_r, ``max_visible[r]`` = max(pos) + 1 (0 if none).

    Global: ``size`` N, ``split``, ``seq_lens`` / ``context_lens`` [B],
    ``cu_seqlens`` [B+1], ``restore_index`` [T] (``cat(parts)[restore_index]``
    is request order), ``gather_rows`` [T] (row of token i in the padded
    rank-major all-gather buffer ``[N * max_tokens]``), ``cache_starts`` [B]
    (first cache row of each request), ``cache_rows`` [T] (cache row token i
    is written to: ``start + ctx + offset``), ``cache_size`` (rows needed).
    """

    size: int
    split: str
    seq_lens: tuple[int, ...]
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
    def max_tokens(self) -> int:
        """Largest T_r: the padded per-rank size of the all-gather."""
        return max(self.num_tokens)


def dsa_cp_plan(
    cu_seqlens: torch.Tensor | list[int],
    cp_size: int,
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
    cp_size: N ranks.
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
    cp_size = checks.integer("cp_size", cp_size, at_least=1)
    cu = checks.int_list("cu_seqlens", cu_seqlens)
    checks.cumulative("cu_seqlens", cu)
    seq = [b - a for a, b in zip(cu, cu[1:])]
    ctx = [0] * len(seq) if context_lens is None else checks.int_list("context_lens", context_lens)
    checks.nonnegative("context_lens", ctx, len(seq), "one per request")
    if cache_starts is None:
        cache_starts, acc = [], 0
        for c, n in zip(ctx, seq):
            cache_starts.append(acc)
            acc += c + n
    cache_starts = checks.int_list("cache_starts", cache_starts)
    checks.nonnegative("cache_starts", cache_starts, len(seq), "one per request")
    _check_disjoint(cache_starts, [c + n for c, n in zip(ctx, seq)])
    n_tok = cu[-1]
    req_of = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(seq, dtype=torch.int64))  # [T]
    pos_of = torch.arange(n_tok) - torch.tensor(cu[:-1], dtype=torch.int64)[req_of] + torch.tensor(
        ctx, dtype=torch.int64)[req_of] if n_tok else torch.zeros(0, dtype=torch.int64)  # [T]
    if split == "balanced":
        token_index = list(pcp_plan(cu, cp_size, context_lens=ctx).token_index)
    else:
        token_index = [torch.arange(r * n_tok // cp_size, (r + 1) * n_tok // cp_size) for r in range(cp_size)]
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
        size=cp_size,
        split=split,
        seq_lens=tuple(seq),
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


def dsa_cp_shard(x: torch.Tensor, plan: DSACPPlan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of a packed global tensor: [T, ...] -> [T_rank, ...].

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_shard
    >>> dsa_cp_shard(torch.arange(5), dsa_cp_plan([0, 5], 2), 1).tolist()
    [2, 3, 4]
    """
    rank = checks.rank("rank", rank, plan.size, "the plan's DSA-CP ranks")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != plan.restore_index.numel():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a packed [T={plan.restore_index.numel()}, ...] tensor (the plan's tokens); got {got}")
    return x[plan.token_index[rank].to(x.device)]


def dsa_cp_unshard(parts: list[torch.Tensor], plan: DSACPPlan) -> torch.Tensor:
    """Inverse of :func:`dsa_cp_shard`: per-rank [T_r, ...] -> global [T, ...] in request order."""
    if len(parts) != plan.size:
        raise ValueError(f"dsa_cp_unshard needs {plan.size} parts (one per rank); got {len(parts)}")
    for r, x in enumerate(parts):
        if x.shape[0] != plan.num_tokens[r]:
            raise ValueError(f"part {r} has {x.shape[0]} tokens; the plan gives rank {r} {plan.num_tokens[r]}")
    cat = torch.cat(list(parts))
    return cat[plan.restore_index.to(cat.device)]


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


@dataclass(frozen=True)
class DSACache:
    """The replicated DSA cache of a DSA-CP rank (same contents on every rank).

    latent: [S, Dqk] -- ``[latent 512 | rope 64]`` per token;
    index_k: [S, D_I] -- indexer key per token (None for a layer without an
    indexer, :func:`dsa_cp_sparse_attention`). Request b's token at
    position p lives at row ``plan.cache_starts[b] + p``; rows of cached
    context must already hold their entries. :func:`dsa_cp_attention` writes
    the new tokens' entries into these tensors in place (a cache write).
    """

    latent: torch.Tensor
    index_k: torch.Tensor | None


def dsa_cp_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    q_index: torch.Tensor,
    w_index: torch.Tensor,
    k_index: torch.Tensor,
    plan: DSACPPlan,
    *,
    group: Group,
    topk: int,
    softmax_scale: float,
    value_dim: int = 512,
    cache: DSACache | None = None,
    output: str = "token",
    return_lse: bool = False,
    return_indices: bool = False,
):
    """DSA with the batch's new tokens split over a DSA-CP group (prefill or decode).

    Arguments
    ---------
    q: [T_r, H, Dqk] -- absorbed queries of this rank's tokens, all heads.
    latent: [T_r, Dqk] -- their ``[latent | rope]`` cache entries.
    q_index: [T_r, H_I, D_I]; w_index: [T_r, H_I]; k_index: [T_r, D_I] --
        their indexer queries, head weights and keys.
        (All of them: ``dsa_cp_shard(x, plan, group.rank)`` of the batch.)
    plan: :func:`dsa_cp_plan` for ``group.size`` ranks.
    group: the DSA-CP group.
    topk, softmax_scale, value_dim: as :func:`dsa_attention`.
    cache: replicated :class:`DSACache` holding the cached context (prefix
        caching, chunked prefill, decode); the new tokens are written into
        it in place. ``None``: no context; a scratch cache is used.
    output: "token" -- out [T_r, H, Dv] of this rank's tokens
        (:func:`dsa_cp_unshard` restores request order); "head" -- one
        all-to-all returns the head-sharded layout out [T, H/N, Dv] of every
        token in request order (needs ``H % N == 0``).
    return_indices: also return the selection, this rank's cache rows
        [T_r, topk] (-1 padded; score desc, position asc), which a layer
        without an indexer reuses (:func:`dsa_cp_sparse_attention`).

    Returns
    -------
    out (see ``output``); with ``return_lse`` its lse (float32) of the
    same leading shape; with ``return_indices`` the selection. Equal to
    :func:`dsa_attention` on one device.

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_shard, dsa_cp_unshard, dsa_cp_attention
    >>> T, H = 9, 4
    >>> x = [torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16), torch.rand(T, 2), torch.randn(T, 16)]
    >>> plan = dsa_cp_plan([0, 4, 9], 2)
    >>> def rank_fn(g):
    ...     mine = [dsa_cp_shard(t, plan, g.rank) for t in x]
    ...     return dsa_cp_attention(*mine, plan, group=g, topk=3, softmax_scale=0.1, value_dim=32)
    >>> dsa_cp_unshard(cpattn.simulate(2, rank_fn), plan).shape
    torch.Size([9, 4, 32])
    """
    named = (("q", q), ("latent", latent), ("q_index", q_index), ("w_index", w_index), ("k_index", k_index))
    _check_cp(q, latent, named, plan, group, output)
    if cache is None:
        if any(plan.context_lens):
            raise ValueError("the plan has cached context (context_lens > 0) but cache is None; pass a DSACache")
        d = q.shape[-1]
        cache = DSACache(latent.new_zeros(plan.cache_size, d), k_index.new_zeros(plan.cache_size, k_index.shape[-1]))
    if cache.index_k is None:
        raise ValueError("cache.index_k is None but this layer has an indexer; give the cache indexer-key rows")
    _check_cache_rows(cache, plan)

    # 1. one all-gather of every token's [latent | indexer key] (bytes: dtypes kept exactly)
    _gather_into(group, plan, [latent, k_index], [cache.latent, cache.index_k])

    # 2. indexer + top-k over every key: local top-k is the global top-k
    dev, r, t_r = q.device, group.rank, q.shape[0]
    req = plan.requests[r].to(dev)
    start = torch.tensor(plan.cache_starts, dtype=torch.int64, device=dev)[req] if t_r else req  # [T_r]
    visible = plan.positions[r].to(dev) + 1  # [T_r] causal by absolute position
    scores = indexer_scores(q_index, w_index, cache.index_k, start, visible, plan.max_visible[r])  # [T_r, M]
    idx = topk_indices(scores, topk)  # [T_r, k]
    sel = torch.where(idx >= 0, start[:, None] + idx, -1)  # [T_r, k] cache rows

    # 3. sparse MLA over the replicated latent cache (4. and back to heads)
    res = _attend_cp(q, cache.latent, sel, plan, group, softmax_scale, value_dim, output, return_lse)
    res = res + ((sel,) if return_indices else ())
    return res[0] if len(res) == 1 else res


def dsa_cp_sparse_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    plan: DSACPPlan,
    *,
    group: Group,
    softmax_scale: float,
    value_dim: int = 512,
    cache: DSACache | None = None,
    output: str = "token",
    return_lse: bool = False,
):
    """DSA-CP attention over a given selection: a layer without an indexer (GLM-5's shared layers).

    The layer's latents are all-gathered into its replicated cache, laid
    out as the full layer's (the same plan, so the same rows), and each
    rank attends the rows ``indices`` it selected there. No indexer, no
    indexer keys, no more communication than the latents.

    Arguments
    ---------
    q: [T_r, H, Dqk]; latent: [T_r, Dqk] -- this rank's tokens.
    indices: [T_r, K] -- cache rows, -1 padded: ``dsa_cp_attention(...,
        return_indices=True)`` of an earlier layer over the same plan.
    plan, group, softmax_scale, value_dim, output, return_lse: as
        :func:`dsa_cp_attention`; cache: a :class:`DSACache` whose
        ``index_k`` may be None (holding cached context, written in place).

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_shard, dsa_cp_unshard, dsa_cp_attention
    >>> T, H = 9, 4
    >>> x = [torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16), torch.rand(T, 2), torch.randn(T, 16)]
    >>> lat2 = torch.randn(T, 48)
    >>> plan = dsa_cp_plan([0, 4, 9], 2)
    >>> def rank_fn(g):
    ...     mine = [dsa_cp_shard(t, plan, g.rank) for t in x]
    ...     _, sel = dsa_cp_attention(*mine, plan, group=g, topk=3, softmax_scale=0.1, value_dim=32,
    ...                               return_indices=True)
    ...     return dsa_cp_sparse_attention(mine[0], dsa_cp_shard(lat2, plan, g.rank), sel, plan, group=g,
    ...                                    softmax_scale=0.1, value_dim=32)
    >>> dsa_cp_unshard(cpattn.simulate(2, rank_fn), plan).shape
    torch.Size([9, 4, 32])
    """
    _check_cp(q, latent, (("q", q), ("latent", latent), ("indices", indices)), plan, group, output)
    if cache is None:
        if any(plan.context_lens):
            raise ValueError("the plan has cached context (context_lens > 0) but cache is None; pass a DSACache")
        cache = DSACache(latent.new_zeros(plan.cache_size, q.shape[-1]), None)
    _check_cache_rows(cache, plan)
    _gather_into(group, plan, [latent], [cache.latent])
    res = _attend_cp(q, cache.latent, indices, plan, group, softmax_scale, value_dim, output, return_lse)
    return res[0] if len(res) == 1 else res


def _check_cp(q, latent, named, plan, group, output) -> None:
    """Arguments of the DSA-CP functions: output kind, plan, per-rank token counts, latent width, head split."""
    if output not in OUTPUTS_CP:
        raise ValueError(f"output must be one of {OUTPUTS_CP}; got {output!r}")
    if not isinstance(plan, DSACPPlan):
        raise ValueError(f"plan must be a DSACPPlan from dsa_cp_plan(cu_seqlens, cp_size); got {type(plan).__name__}")
    if group.size != plan.size:
        raise ValueError(f"the plan is for {plan.size} ranks but the group has {group.size}; rebuild the plan")
    r, n = group.rank, group.size
    _, h, d = q.shape
    for name, x in named:
        if x.shape[0] != plan.num_tokens[r]:
            raise ValueError(
                f"rank {r} holds {plan.num_tokens[r]} tokens in the plan but {name} has {x.shape[0]}; "
                "pass dsa_cp_shard(x, plan, group.rank)"
            )
    if latent.shape[-1] != d or latent.dim() != 2:
        raise ValueError(f"latent must be [T_r, Dqk={d}]; got {tuple(latent.shape)}")
    if output == "head" and h % n:
        raise ValueError(f"output='head' needs H % N == 0; got H={h}, N={n}; use output='token'")


def _check_cache_rows(cache: DSACache, plan: DSACPPlan) -> None:
    rows = [cache.latent.shape[0]] + ([] if cache.index_k is None else [cache.index_k.shape[0]])
    if min(rows) < plan.cache_size:
        idx = "no" if cache.index_k is None else cache.index_k.shape[0]
        raise ValueError(
            f"cache holds {cache.latent.shape[0]} latent / {idx} index rows; the plan needs {plan.cache_size}"
        )


def _gather_into(group: Group, plan: DSACPPlan, pieces: list[torch.Tensor], caches: list[torch.Tensor]) -> None:
    """One all-gather of every token's pieces ([T_r, *] each, packed as bytes) written to its plan row of each cache."""
    dev, t_r = pieces[0].device, pieces[0].shape[0]
    msg = _pack(pieces)  # [T_r, bytes]
    msg = torch.nn.functional.pad(msg, (0, 0, 0, plan.max_tokens - t_r))  # [max_tokens, bytes]
    everything = group.all_gather(msg)  # [N * max_tokens, bytes], rank-major
    new = _unpack(everything[plan.gather_rows.to(dev)], pieces)  # each [T, *] request order
    rows = plan.cache_rows.to(dev)
    for cache, x in zip(caches, new):
        cache.index_copy_(0, rows, x.to(cache.dtype))  # cache write (in place)


def _attend_cp(q, latent_cache, sel, plan: DSACPPlan, group: Group, softmax_scale, value_dim, output,
               return_lse) -> tuple:
    """Sparse MLA of this rank's tokens over the replicated cache rows ``sel`` [T_r, k]; ``output="head"``:
    one all-to-all of [out | lse] per head slice back to the head-sharded layout. Returns (out,) or (out, lse)."""
    out, lse = sparse_mla_attention_with_lse(q, latent_cache, sel, softmax_scale=softmax_scale, value_dim=value_dim)
    if output == "token":
        return (out, lse) if return_lse else (out,)
    t_r, h, _ = q.shape
    n = group.size
    hl = h // n
    msg = _pack([out, lse[..., None]])  # [T_r, H, bytes]
    msg = torch.nn.functional.pad(msg, (0, 0, 0, 0, 0, plan.max_tokens - t_r))  # [max, H, bytes]
    msg = msg.view(plan.max_tokens, n, hl, -1).transpose(0, 1).contiguous()  # [N, max, H/N, bytes]
    got = group.all_to_all(msg, dim=0)  # [N(source), max, H/N, bytes]
    got = got.reshape(n * plan.max_tokens, hl, -1)[plan.gather_rows.to(q.device)]  # [T, H/N, bytes]
    out_h, lse_h = _unpack(got, [out, lse[..., None]])
    return (out_h, lse_h[..., 0]) if return_lse else (out_h,)


# =========================================================================== key-sharded (DCP) top-k
@dataclass(frozen=True)
class ShardedKeys:
    """One rank's share of a key-sharded (DCP) DSA cache.

    latent: [S_r, Dqk]; index_k: [S_r, D_I] -- this rank's rows;
    ids: [S_r] int64 -- global (request-local absolute) position of each row,
    ascending within each request; cu_seqlens: [B+1] -- request b's rows are
    ``cu_seqlens[b] : cu_seqlens[b+1]``. Build it with
    :func:`dcp_shard_keys`, or from any ownership rule.
    """

    latent: torch.Tensor
    index_k: torch.Tensor
    ids: torch.Tensor
    cu_seqlens: torch.Tensor


def _dcp_owned(seq_len: int, rank: int, size: int, interleave: int) -> torch.Tensor:
    """Positions of a sequence owned by ``rank`` under DCP, in local order (ascending position)."""
    t = torch.arange(seq_len, dtype=torch.int64)
    return t[dcp_owner(t, size, interleave) == rank]


def dcp_shard_keys(
    latent: torch.Tensor,
    index_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | list[int],
    rank: int,
    size: int,
    interleave: int = 1,
) -> ShardedKeys:
    """Rank ``rank``'s DCP share of a packed full cache (owner(t) = (t // I) % N).

    latent: [Tk, Dqk]; index_k: [Tk, D_I]; cu_seqlens_k: [B+1] per-request
    key counts; interleave: ``cp_kv_cache_interleave_size`` I.

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import dcp_shard_keys
    >>> dcp_shard_keys(torch.zeros(6, 8), torch.zeros(6, 4), [0, 6], 1, 2, interleave=2).ids.tolist()
    [2, 3]
    """
    size = checks.integer("size", size, at_least=1)
    rank = checks.rank("rank", rank, size, "the DCP group's ranks")
    interleave = checks.integer("interleave", interleave, at_least=1)
    cu = checks.int_list("cu_seqlens_k", cu_seqlens_k)
    checks.cumulative("cu_seqlens_k", cu, total=latent.shape[0], of=f"latent has {latent.shape[0]} rows")
    if index_k.shape[0] != latent.shape[0]:
        raise ValueError(f"index_k has {index_k.shape[0]} rows but latent {latent.shape[0]}; one of each per key token")
    ids, rows, cu_local = [], [], [0]
    for b in range(len(cu) - 1):
        own = _dcp_owned(cu[b + 1] - cu[b], rank, size, interleave)
        ids.append(own)
        rows.append(own + cu[b])
        cu_local.append(cu_local[-1] + own.numel())
    ids_t = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    rows_t = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)).to(latent.device)
    return ShardedKeys(latent[rows_t], index_k[rows_t], ids_t.to(latent.device),
                       torch.tensor(cu_local, dtype=torch.int64, device=latent.device))


def select_topk_candidates(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-select the top-k of candidate (score, id) pairs in the strict order (score desc, id asc).

    scores: [T, M]; ids: [T, M] int (-1 / -inf marks an empty candidate; ids
    of one row are distinct). Returns ids [T, k] int64 and their scores
    [T, k], -1 / -inf padded. Equals :func:`cpattn.ops.dsa.topk_indices` over
    the full score row whenever the candidates include that row's top-k.

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import select_topk_candidates
    >>> s = torch.tensor([[2.0, 5.0, 2.0, float("-inf")]]); i = torch.tensor([[7, 3, 1, -1]])
    >>> select_topk_candidates(s, i, 3)[0].tolist()
    [[3, 1, 7]]
    """
    s = scores.masked_fill(scores.isnan(), float("-inf"))
    s = torch.where(ids >= 0, s, float("-inf"))
    by_id = torch.sort(ids, dim=-1, stable=True).indices  # id ascending
    s1, i1 = s.gather(1, by_id), ids.gather(1, by_id)
    by_score = torch.sort(s1, dim=-1, descending=True, stable=True)  # score desc, ties keep id asc
    kk = min(k, s.shape[1])
    top_s = by_score.values[:, :kk]
    top_i = torch.where(top_s == float("-inf"), -1, i1.gather(1, by_score.indices[:, :kk])).long()
    pad = k - kk
    if pad:
        top_i = torch.nn.functional.pad(top_i, (0, pad), value=-1)
        top_s = torch.nn.functional.pad(top_s, (0, pad), value=float("-inf"))
    return top_i, top_s


def dsa_dcp_topk(
    q_index: torch.Tensor,
    w_index: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    keys: ShardedKeys,
    *,
    group: Group,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact global top-k over a key-sharded indexer cache.

    Arguments
    ---------
    q_index: [T, H_I, D_I]; w_index: [T, H_I] -- the same on every rank.
    positions: [T] int -- absolute position of each query (it sees keys
        with global id <= position).
    cu_seqlens_q: [B+1] -- queries of request b.
    keys: this rank's :class:`ShardedKeys`.
    group: the DCP group; topk: k.

    Returns
    -------
    global_ids: [T, topk] int64 -- the single-device selection (score desc,
    id asc; -1 padded), identical on every rank; local_rows: [T, topk]
    int64 -- row of ``keys`` holding each selected key if this rank owns it,
    else -1.

    One all-gather of ``T * topk`` (score, id) pairs per rank. The
    re-selection is what makes this exact: the union of the ranks' local
    top-k sets holds up to ``N * topk`` keys and is not the global top-k.
    Exactness also needs every rank to score a key bit-identically to the
    single device (true of the CPU kernel; grid-valued test inputs make it
    hold on any device).
    """
    dev = q_index.device
    t = q_index.shape[0]
    _check_topk_args(q_index, positions, cu_seqlens_q, keys)
    topk = checks.integer("topk", topk, at_least=1)
    cu_q = torch.as_tensor(checks.int_list("cu_seqlens_q", cu_seqlens_q), dtype=torch.int64, device=dev)
    req = torch.searchsorted(cu_q[1:], torch.arange(t, device=dev), right=True)  # [T] request of query
    cu_k = keys.cu_seqlens.to(dev).long()
    big = int(positions.max()) + 2 if positions.numel() else 1
    big = max(big, int(keys.ids.max()) + 2 if keys.ids.numel() else 1)
    req_k = torch.searchsorted(cu_k[1:], torch.arange(keys.ids.numel(), device=dev), right=True)  # [S_r]
    comp = req_k * big + keys.ids.long()  # [S_r] ascending: (request, id)
    if checks.values_checkable() and comp.numel() > 1:
        down = comp.diff() <= 0
        if bool(down.any()):
            i = int(down.nonzero()[0]) + 1
            raise ValueError(
                f"keys.ids must be strictly ascending within each request; got keys.ids[{i}] = {int(keys.ids[i])} "
                f"after keys.ids[{i - 1}] = {int(keys.ids[i - 1])}. Build the keys with dcp_shard_keys"
            )
    start = cu_k[req]  # [T]
    visible = torch.searchsorted(comp, req * big + positions.long(), right=True) - start  # [T] local prefix
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    scores = indexer_scores(q_index, w_index, keys.index_k, start, visible, max(lens, default=0))  # [T, M]
    local = topk_indices(scores, topk).long()  # [T, k] request-local rows
    live = local >= 0
    cand_s = torch.where(live, scores.gather(1, local.clamp(min=0)) if scores.shape[1] else
                         torch.zeros_like(local, dtype=scores.dtype), float("-inf"))  # [T, k]
    row = (start[:, None] + local).clamp(min=0)
    cand_i = torch.where(live, keys.ids.long()[row] if keys.ids.numel() else torch.zeros_like(local), -1)
    # exchange candidates: one all-gather of [score | id] bytes
    likes = [cand_s[..., None], cand_i[..., None]]
    msg = _pack(likes)  # [T, k, bytes]
    got = group.all_gather(msg, dim=0).view(group.size, t, topk, -1)  # [N, T, k, bytes]
    got = got.transpose(0, 1).reshape(t, group.size * topk, -1)  # [T, N*k, bytes]
    all_s, all_i = _unpack(got, likes)
    gids, _ = select_topk_candidates(all_s[..., 0], all_i[..., 0], topk)  # [T, k] global ids
    # selected keys this rank owns -> local rows
    target = req[:, None] * big + gids  # [T, k]
    if comp.numel():
        at = torch.searchsorted(comp, target).clamp(max=comp.numel() - 1)
        owned = (gids >= 0) & (comp[at] == target)
        rows = torch.where(owned, at, -1)
    else:
        rows = torch.full_like(gids, -1)
    return gids, rows


def _check_topk_args(q_index, positions, cu_seqlens_q, keys: ShardedKeys) -> None:
    """Arguments of the key-sharded top-k: query map, positions and the rank's ShardedKeys agree."""
    t = q_index.shape[0]
    cq = checks.int_list("cu_seqlens_q", cu_seqlens_q)
    checks.cumulative("cu_seqlens_q", cq, total=t, of=f"q_index has {t} queries", exact=True)
    checks.int_tensor("positions", positions, (t,), desc=f"[T={t}]")
    checks.within("positions", positions, 0, None, expected="an absolute position >= 0")
    s_r = keys.latent.shape[0]
    checks.int_tensor("keys.ids", keys.ids, (s_r,), desc=f"[S_r={s_r}] (one global id per row of keys.latent)")
    if keys.index_k.shape[0] != s_r:
        raise ValueError(f"keys.index_k has {keys.index_k.shape[0]} rows but keys.latent {s_r}; one of each per key")
    checks.cu_seqlens("keys.cu_seqlens", keys.cu_seqlens, total=s_r, of=f"keys.latent has {s_r} rows", exact=True)
    if keys.cu_seqlens.numel() != len(cq):
        raise ValueError(
            f"keys.cu_seqlens has {keys.cu_seqlens.numel()} entries, cu_seqlens_q {len(cq)}; both are [B+1] "
            "for the same B requests"
        )
    checks.within("keys.ids", keys.ids, 0, None, expected="a global key position >= 0")


def dsa_dcp_attention(
    q: torch.Tensor,
    q_index: torch.Tensor,
    w_index: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    keys: ShardedKeys,
    *,
    group: Group,
    topk: int,
    softmax_scale: float,
    value_dim: int = 512,
    output: str = "replicated",
    return_lse: bool = False,
    return_indices: bool = False,
):
    """Sparse MLA over a key-sharded (DCP) cache with the exact global top-k.

    Arguments
    ---------
    q: [T, H, Dqk] -- absorbed queries, the same on every rank.
    q_index, w_index, positions, cu_seqlens_q, keys, group, topk: as
        :func:`dsa_dcp_topk`. softmax_scale, value_dim: as :func:`dsa_attention`.
    output: "replicated" -- all-gather the partials, every rank gets out
        [T, H, Dv]; "head" -- one all-to-all of the partials per head slice,
        rank r gets heads ``r*H/N .. (r+1)*H/N - 1``: out [T, H/N, Dv].

    Returns
    -------
    out; with ``return_lse`` its lse (float32); with ``return_indices`` the
    global ids [T, topk]. Equal to :func:`dsa_attention` on the full cache.

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn.dsa import dcp_shard_keys, dsa_dcp_attention
    >>> T, H = 3, 4
    >>> lat, kI = torch.randn(T, 48), torch.randn(T, 16)
    >>> q, qI, w = torch.randn(T, H, 48), torch.randn(T, 2, 16), torch.rand(T, 2)
    >>> def rank_fn(g):
    ...     keys = dcp_shard_keys(lat, kI, [0, T], g.rank, g.size)
    ...     return dsa_dcp_attention(q, qI, w, torch.arange(T), [0, T], keys, group=g,
    ...                              topk=2, softmax_scale=0.1, value_dim=32)
    >>> cpattn.simulate(2, rank_fn)[0].shape
    torch.Size([3, 4, 32])
    """
    if output not in OUTPUTS_DCP:
        raise ValueError(f"output must be one of {OUTPUTS_DCP}; got {output!r}")
    if q.dim() != 3 or q.shape[0] != q_index.shape[0]:
        raise ValueError(f"q must be [T={q_index.shape[0]}, H, Dqk] (one row per query of q_index); got {tuple(q.shape)}")
    t, h, _ = q.shape
    n = group.size
    if output == "head" and h % n:
        raise ValueError(f"output='head' needs H % N == 0; got H={h}, N={n}; use output='replicated'")
    gids, rows = dsa_dcp_topk(q_index, w_index, positions, cu_seqlens_q, keys, group=group, topk=topk)
    # partial over the selected keys this rank owns, kept in float32 for the merge
    out, lse = sparse_mla_attention_with_lse(
        q.float() if q.dtype != torch.float64 else q, keys.latent, rows,
        softmax_scale=softmax_scale, value_dim=value_dim,
    )
    msg = _pack([out, lse[..., None]])  # [T, H, bytes]
    if output == "replicated":
        parts = group.all_gather(msg, dim=0).view(n, t, h, -1)  # [N, T, H, bytes]
    else:
        hl = h // n
        parts = group.all_to_all(msg.view(t, n, hl, -1).transpose(0, 1).contiguous(), dim=0)  # [N, T, H/N, bytes]
    outs, lses = _unpack(parts, [out, lse[..., None]])
    merged, mlse = merge_attn_states(outs, lses[..., 0])
    res = (merged.to(q.dtype),) + ((mlse,) if return_lse else ()) + ((gids,) if return_indices else ())
    return res[0] if len(res) == 1 else res


# =========================================================================== byte packing
def _pack(xs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of equal leading shape along a byte last dim (one message, dtypes kept)."""
    return torch.cat([x.contiguous().view(torch.uint8) for x in xs], dim=-1)


def _unpack(msg: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: split the byte last dim back into tensors shaped/typed like ``likes``."""
    outs, at = [], 0
    for x in likes:
        nb = x.shape[-1] * x.element_size()
        outs.append(msg[..., at : at + nb].contiguous().view(x.dtype))
        at += nb
    return outs
