"""DSA-CP attention: token-sharded queries over a replicated cache of ``[latent | rope | indexer key]`` rows
(one all-gather), so local top-k is the global top-k; the output token- or head-sharded (one all-to-all)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.comm.pack import pack_bytes, unpack_bytes
from cpattn.dsa.cp_plan import DSACPPlan
from cpattn.ops.dsa import indexer_scores, sparse_mla_attention_with_lse, topk_indices

OUTPUTS_CP = ("token", "head")


@dataclass(frozen=True)
class DSACache:
    """The replicated DSA cache of a DSA-CP rank (same contents on every rank).

    latent: [S, Dqk] -- ``[latent 512 | rope 64]`` per token;
    k_index: [S, D_I] -- indexer key per token (None for a layer without an
    indexer, :func:`dsa_cp_sparse_attention`). Request b's token at
    position p lives at row ``plan.cache_starts[b] + p``; rows of cached
    context must already hold their entries. :func:`dsa_cp_attention` writes
    the new tokens' entries into these tensors in place (a cache write).
    """

    latent: torch.Tensor
    k_index: torch.Tensor | None


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
    v_head_dim: int = 512,
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
        (All of them: ``pcp_shard(x, plan, group.rank)`` of the batch.)
    plan: :func:`dsa_cp_plan` for ``group.size`` ranks.
    group: the DSA-CP group.
    topk, softmax_scale, v_head_dim: as :func:`dsa_attention`.
    cache: replicated :class:`DSACache` holding the cached context (prefix
        caching, chunked prefill, decode); the new tokens are written into
        it in place. ``None``: no context; a scratch cache is used.
    output: "token" -- out [T_r, H, Dv] of this rank's tokens
        (:func:`pcp_unshard` restores request order); "head" -- one
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
    >>> from cpattn import pcp_shard, pcp_unshard
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_attention
    >>> T, H = 9, 4
    >>> x = [torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16), torch.rand(T, 2), torch.randn(T, 16)]
    >>> plan = dsa_cp_plan([0, 4, 9], 2)
    >>> def rank_fn(g):
    ...     mine = [pcp_shard(t, plan, g.rank) for t in x]
    ...     return dsa_cp_attention(*mine, plan, group=g, topk=3, softmax_scale=0.1, v_head_dim=32)
    >>> pcp_unshard(cpattn.simulate(2, rank_fn), plan).shape
    torch.Size([9, 4, 32])
    """
    named = (("q", q), ("latent", latent), ("q_index", q_index), ("w_index", w_index), ("k_index", k_index))
    _check_cp(q, latent, named, plan, group, output)
    if cache is None:
        if any(plan.context_lens):
            raise ValueError("the plan has cached context (context_lens > 0) but cache is None; pass a DSACache")
        d = q.shape[-1]
        cache = DSACache(latent.new_zeros(plan.cache_size, d), k_index.new_zeros(plan.cache_size, k_index.shape[-1]))
    if cache.k_index is None:
        raise ValueError("cache.k_index is None but this layer has an indexer; give the cache indexer-key rows")
    _check_cache_rows(cache, plan)

    # 1. one all-gather of every token's [latent | indexer key] (bytes: dtypes kept exactly)
    _gather_into(group, plan, [latent, k_index], [cache.latent, cache.k_index])

    # 2. indexer + top-k over every key: local top-k is the global top-k
    dev, r, t_r = q.device, group.rank, q.shape[0]
    req = plan.requests[r].to(dev)
    start = torch.tensor(plan.cache_starts, dtype=torch.int64, device=dev)[req] if t_r else req  # [T_r]
    visible = plan.positions[r].to(dev) + 1  # [T_r] causal by absolute position
    scores = indexer_scores(q_index, w_index, cache.k_index, start, visible, plan.max_visible[r])  # [T_r, M]
    idx = topk_indices(scores, topk)  # [T_r, k]
    sel = torch.where(idx >= 0, start[:, None] + idx, -1)  # [T_r, k] cache rows

    # 3. sparse MLA over the replicated latent cache (4. and back to heads)
    res = _attend_cp(q, cache.latent, sel, plan, group, softmax_scale, v_head_dim, output, return_lse)
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
    v_head_dim: int = 512,
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
    plan, group, softmax_scale, v_head_dim, output, return_lse: as
        :func:`dsa_cp_attention`; cache: a :class:`DSACache` whose
        ``k_index`` may be None (holding cached context, written in place).

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn import pcp_shard, pcp_unshard
    >>> from cpattn.dsa import dsa_cp_plan, dsa_cp_attention
    >>> T, H = 9, 4
    >>> x = [torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16), torch.rand(T, 2), torch.randn(T, 16)]
    >>> lat2 = torch.randn(T, 48)
    >>> plan = dsa_cp_plan([0, 4, 9], 2)
    >>> def rank_fn(g):
    ...     mine = [pcp_shard(t, plan, g.rank) for t in x]
    ...     _, sel = dsa_cp_attention(*mine, plan, group=g, topk=3, softmax_scale=0.1, v_head_dim=32,
    ...                               return_indices=True)
    ...     return dsa_cp_sparse_attention(mine[0], pcp_shard(lat2, plan, g.rank), sel, plan, group=g,
    ...                                    softmax_scale=0.1, v_head_dim=32)
    >>> pcp_unshard(cpattn.simulate(2, rank_fn), plan).shape
    torch.Size([9, 4, 32])
    """
    _check_cp(q, latent, (("q", q), ("latent", latent), ("indices", indices)), plan, group, output)
    if cache is None:
        if any(plan.context_lens):
            raise ValueError("the plan has cached context (context_lens > 0) but cache is None; pass a DSACache")
        cache = DSACache(latent.new_zeros(plan.cache_size, q.shape[-1]), None)
    _check_cache_rows(cache, plan)
    _gather_into(group, plan, [latent], [cache.latent])
    res = _attend_cp(q, cache.latent, indices, plan, group, softmax_scale, v_head_dim, output, return_lse)
    return res[0] if len(res) == 1 else res


def _check_cp(q, latent, named, plan, group, output) -> None:
    """Arguments of the DSA-CP functions: output kind, plan, per-rank token counts, latent width, head split."""
    if output not in OUTPUTS_CP:
        raise ValueError(f"output must be one of {OUTPUTS_CP}; got {output!r}")
    if not isinstance(plan, DSACPPlan):
        raise ValueError(f"plan must be a DSACPPlan from dsa_cp_plan(cu_seqlens, dsa_cp_size); got "
                         f"{type(plan).__name__}")
    if group.size != plan.dsa_cp_size:
        raise ValueError(f"the plan is for {plan.dsa_cp_size} ranks but the group has {group.size}; rebuild the plan")
    r, n = group.rank, group.size
    _, h, d = q.shape
    for name, x in named:
        if x.shape[0] != plan.num_tokens[r]:
            raise ValueError(
                f"rank {r} holds {plan.num_tokens[r]} tokens in the plan but {name} has {x.shape[0]}; "
                "pass pcp_shard(x, plan, group.rank)"
            )
    if latent.shape[-1] != d or latent.dim() != 2:
        raise ValueError(f"latent must be [T_r, Dqk={d}]; got {tuple(latent.shape)}")
    if output == "head" and h % n:
        raise ValueError(f"output='head' needs H % N == 0; got H={h}, N={n}; use output='token'")


def _check_cache_rows(cache: DSACache, plan: DSACPPlan) -> None:
    rows = [cache.latent.shape[0]] + ([] if cache.k_index is None else [cache.k_index.shape[0]])
    if min(rows) < plan.cache_size:
        idx = "no" if cache.k_index is None else cache.k_index.shape[0]
        raise ValueError(
            f"cache holds {cache.latent.shape[0]} latent / {idx} index rows; the plan needs {plan.cache_size}"
        )


def _gather_into(group: Group, plan: DSACPPlan, pieces: list[torch.Tensor], caches: list[torch.Tensor]) -> None:
    """One all-gather of every token's pieces ([T_r, *] each, packed as bytes) written to its plan row of each cache."""
    dev, t_r = pieces[0].device, pieces[0].shape[0]
    msg = pack_bytes(pieces)  # [T_r, bytes]
    msg = torch.nn.functional.pad(msg, (0, 0, 0, plan.max_tokens - t_r))  # [max_tokens, bytes]
    everything = group.all_gather(msg)  # [N * max_tokens, bytes], rank-major
    new = unpack_bytes(everything[plan.gather_rows.to(dev)], pieces)  # each [T, *] request order
    rows = plan.cache_rows.to(dev)
    for cache, x in zip(caches, new):
        cache.index_copy_(0, rows, x.to(cache.dtype))  # cache write (in place)


def _attend_cp(q, latent_cache, sel, plan: DSACPPlan, group: Group, softmax_scale, v_head_dim, output,
               return_lse) -> tuple:
    """Sparse MLA of this rank's tokens over the replicated cache rows ``sel`` [T_r, k]; ``output="head"``:
    one all-to-all of [out | lse] per head slice back to the head-sharded layout. Returns (out,) or (out, lse)."""
    out, lse = sparse_mla_attention_with_lse(q, latent_cache, sel, softmax_scale=softmax_scale, v_head_dim=v_head_dim)
    if output == "token":
        return (out, lse) if return_lse else (out,)
    t_r, h, _ = q.shape
    n = group.size
    hl = h // n
    msg = pack_bytes([out, lse[..., None]])  # [T_r, H, bytes]
    msg = torch.nn.functional.pad(msg, (0, 0, 0, 0, 0, plan.max_tokens - t_r))  # [max, H, bytes]
    msg = msg.view(plan.max_tokens, n, hl, -1).transpose(0, 1).contiguous()  # [N, max, H/N, bytes]
    got = group.all_to_all(msg, dim=0)  # [N(source), max, H/N, bytes]
    got = got.reshape(n * plan.max_tokens, hl, -1)[plan.gather_rows.to(q.device)]  # [T, H/N, bytes]
    out_h, lse_h = unpack_bytes(got, [out, lse[..., None]])
    return (out_h, lse_h[..., 0]) if return_lse else (out_h,)

