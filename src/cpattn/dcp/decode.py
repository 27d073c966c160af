"""The DCP decode step: local partials over this rank's shard, then one of three merges (see the package
docstring)."""

from __future__ import annotations

import torch

from cpattn.comm.group import Group
from cpattn.ops import merge_attn_states
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.ref import acc_dtype, lse_weights
from cpattn.dcp.plan import DCPMeta

MERGES = ("ag_rs", "a2a", "ag")
QUERIES = ("gather", "local")


def dcp_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention of every head in q over its own KV shard; no communication.

    q: [T, H, Dk] (whatever heads the caller holds); caches: this rank's shard
    [num_blocks, block_size, Hkv, D*]; req_indices, kv_lens: [T] (this rank's
    local lengths). Returns o [T, H, Dv] and lse [T, H], float32 (float64 for
    float64 q): the partial ``(O_r, L_r)`` that :func:`dcp_merge` combines.

    Example
    -------
    >>> import torch
    >>> kc = vc = torch.randn(1, 4, 1, 8)
    >>> o, l = dcp_partials(torch.randn(2, 3, 8), kc, vc, torch.tensor([[0]]), torch.tensor([0, 0]),
    ...                     torch.tensor([4, 0], dtype=torch.int32), softmax_scale=0.3)
    >>> o.shape, l[1].tolist()
    (torch.Size([2, 3, 8]), [-inf, -inf, -inf])
    """
    acc = acc_dtype(q)
    o, l = paged_attention_with_lse(q, k_cache, v_cache, block_table, req_indices, kv_lens,
                                    softmax_scale=softmax_scale)  # [T, H, Dv], [T, H]
    return o.to(acc), l.to(acc)


def dcp_merge(o: torch.Tensor, l: torch.Tensor, *, group: Group, merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partials of the same heads exactly: one collective, or two for ``ag_rs``.

    o: [T, H, Dv], l: [T, H] -- this rank's partial over its shard (float32),
    for the same H heads on every rank (H divisible by N for "ag_rs" / "a2a").

    merge:
      - "a2a": one all-to-all of ``[O | L]`` per head slice, N-way merge of
        the slice this rank keeps: returns this rank's H/N heads;
      - "ag_rs": all-gather the LSEs, rescale the local output by
        ``exp(L_r - L)``, reduce-scatter over heads: this rank's H/N heads;
      - "ag": one all-gather of ``[O | L]``, N-way merge of every head:
        returns all H heads, the same on every rank (for a replicated model
        that then needs no output gather).

    Returns out [T, H', Dv] and lse [T, H'] in o's dtype (H' = H/N or H).

    Example
    -------
    >>> import torch, cpattn
    >>> o, l = torch.randn(2, 1, 4, 3), torch.randn(2, 1, 4)  # rank r's partial is o[r], l[r]
    >>> outs = cpattn.simulate(2, lambda g: dcp_merge(o[g.rank], l[g.rank], group=g, merge="ag")[0])
    >>> want, _ = merge_attn_states(o, l)
    >>> bool(torch.allclose(outs[0], want, atol=1e-6)) and bool(torch.equal(outs[0], outs[1]))
    True
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}; got {merge!r}")
    n, r, h = group.size, group.rank, o.shape[1]
    t, dv = o.shape[0], o.shape[-1]
    if merge == "ag":
        buf = torch.cat([o, l[..., None]], dim=-1)  # [T, H, Dv+1]
        got = group.all_gather(buf[None], dim=0)  # [N, T, H, Dv+1]
        return merge_attn_states(got[..., :dv], got[..., dv])
    hl = h // n
    if merge == "ag_rs":
        w, total = dcp_fold_weights(l, group=group)  # [T, H] each: the LSE all-gather
        out = group.reduce_scatter(rescaled(o, l, w), dim=1)  # [T, H/N, Dv]
        return out, total[:, r * hl : (r + 1) * hl]
    buf = torch.cat([o, l[..., None]], dim=-1)  # [T, H, Dv+1]
    got = group.all_to_all(buf, dim=1)  # [T, H, Dv+1]: slice j = rank j's partial of my heads
    got = got.view(t, n, hl, dv + 1).movedim(1, 0)  # [N, T, H/N, Dv+1]
    return merge_attn_states(got[..., :dv], got[..., dv])


def dcp_fold_weights(l: torch.Tensor, *, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's rescale, to fold into a linear reduction that follows (TP's output projection).

    With every head's partial ``(O_r, L_r)`` on rank r, the merged output is
    ``O = sum_r w_r * O_r`` with ``w_r = exp(L_r - L)``. A linear map W (the
    row-parallel ``o_proj``, no bias before the sum) commutes with that sum:
    ``O @ W = sum_r (w_r * O_r) @ W``, so the TP all-reduce that follows
    ``o_proj`` anyway performs the merge: each rank projects its rescaled
    partial of *all* the group's heads, and the only extra collective is this
    all-gather of the LSEs (T x H floats). Exact up to float rounding.

    l: [T, H] this rank's LSEs. Returns w [T, H] (0 where this rank's partial
    is empty) and the merged lse [T, H].

    Example
    -------
    >>> import torch, cpattn
    >>> o, l = torch.randn(2, 1, 4, 3), torch.randn(2, 1, 4)
    >>> def rank(g):
    ...     w, _ = dcp_fold_weights(l[g.rank], group=g)
    ...     return g.all_reduce(o[g.rank] * w[..., None])  # the reduction the projection does anyway
    >>> got = cpattn.simulate(2, rank)[0]
    >>> bool(torch.allclose(got, merge_attn_states(o, l)[0], atol=1e-6))
    True
    """
    lses = group.all_gather(l[None], dim=0)  # [N, T, H]
    total = lse_weights(lses)[2]  # [T, H]: the merged LSE (NaN if any rank's is NaN)
    empty = l == float("-inf")  # only an empty partial gets weight 0; NaN and underflow are not masked
    return torch.where(empty, 0.0, torch.exp(l - total)), total


def rescaled(o: torch.Tensor, l: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * O_r`` with an empty partial (lse -inf, whose output may hold garbage) zeroed: [T, H, Dv].

    o: [T, H, Dv], l: [T, H] this rank's partial; w: [T, H] from :func:`dcp_fold_weights`. Summed over
    the group (a reduce-scatter, or the all-reduce after a linear projection) it is the merged output.
    """
    return torch.where((l == float("-inf"))[..., None], 0.0, o) * w[..., None]


def dcp_attend_heads(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    group: Group,
    merge: str,
    softmax_scale: float,
    query: str = "gather",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DCP core: (gather query heads,) attend the local shard, merge partials (:func:`dcp_merge`).

    q: ``query="gather"``: [T, Hl, Dk] this rank's heads (gathered first, one
    collective); ``query="local"``: [T, N*Hl, Dk] the whole group's heads, the
    same on every rank (no query collective). Every rank holds the same T rows.
    k_cache / v_cache: this rank's shard [num_blocks, block_size, Hkv, D*];
    req_indices, kv_lens: [T] (this rank's visible local lengths).
    Returns out and lse, float32 (float64 for float64 q): [T, Hl, Dv] / [T, Hl]
    for merges "ag_rs" and "a2a", [T, N*Hl, Dv] / [T, N*Hl] for "ag".
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}; got {merge!r}")
    if query not in QUERIES:
        raise ValueError(f"query must be one of {QUERIES}; got {query!r}")
    n = group.size
    heads = q.shape[1] * (n if query == "gather" else 1)
    hkv = k_cache.shape[2]
    if heads % hkv or heads % n:
        raise ValueError(
            f"{heads} query heads of the DCP group ({n} ranks, query={query!r}) must be a multiple of the "
            f"cache's {hkv} kv heads and of the group size; ranks of one DCP group must hold the same kv heads "
            "(GQA: tp // num_kv_heads must be a multiple of dcp_size)"
        )
    q_all = group.all_gather(q, dim=1) if query == "gather" else q  # [T, N*Hl, Dk], head h of rank j at j*Hl + h
    o, l = dcp_partials(q_all, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale=softmax_scale)
    return dcp_merge(o, l, group=group, merge=merge)


def collectives_per_call(query: str, merge: str) -> int:
    """Collectives one :func:`dcp_decode` call makes (per layer): the query gather, then the merge's.

    >>> [collectives_per_call(q, m) for q in QUERIES for m in MERGES]
    [3, 2, 2, 2, 1, 1]
    """
    if query not in QUERIES or merge not in MERGES:
        raise ValueError(f"query must be one of {QUERIES} and merge one of {MERGES}; got {query!r}, {merge!r}")
    return (query == "gather") + (2 if merge == "ag_rs" else 1)


def _split_cache(kv_cache, v_head_dim):
    if isinstance(kv_cache, torch.Tensor):  # MLA: one latent cache, values are its first dims
        if v_head_dim is None or not 0 < v_head_dim <= kv_cache.shape[-1]:
            raise ValueError(f"an MLA latent cache [..., {kv_cache.shape[-1]}] needs v_head_dim in "
                             f"1..{kv_cache.shape[-1]} (its first dims are the values: 512 for DeepSeek); "
                             f"got {v_head_dim}")
        return kv_cache, kv_cache[..., :v_head_dim]
    if len(kv_cache) != 2:
        raise ValueError(
            f"kv_cache must be (k_cache, v_cache) or one MLA latent cache tensor; got a "
            f"{type(kv_cache).__name__} of {len(kv_cache)} items"
        )
    return kv_cache[0], kv_cache[1]


def dcp_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    meta: DCPMeta,
    *,
    group: Group,
    merge: str = "ag_rs",
    query: str = "gather",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    v_head_dim: int | None = None,
):
    """Attention of this step's query tokens over a DCP-sharded paged KV cache.

    Write the step's new KV first (``write_kv(k_cache, v_cache, k, v,
    meta.slot_mapping[group.rank])``): each query then sees every earlier
    token and itself, so decode, speculative decoding (1 + k queries) and
    chunked-prefill requests can share one batch.

    Arguments
    ---------
    q: [T, Hl, Dk] -- this rank's TP query heads for the T rows of ``meta``
        (padding rows included; their output is 0); with ``query="local"``
        [T, N*Hl, Dk], every head of the DCP group, the same on every rank.
    kv_cache: ``(k_cache, v_cache)`` with k_cache [num_blocks, block_size, Hkv, Dk],
        v_cache [.., .., Hkv, Dv] -- this rank's shard. GQA: all N*Hl gathered
        heads share the cache's Hkv heads (gathered head h reads kv head
        ``h // (N*Hl // Hkv)``), so ranks of a DCP group must hold the same
        kv heads. MLA: pass the latent cache [num_blocks, block_size, 1, 576]
        alone with ``v_head_dim``: its first ``v_head_dim`` dims (512 in
        DeepSeek's models) are the values, and q is
        the absorbed query [T, Hl, 576].
    meta: from :func:`dcp_plan` with ``dcp_size == group.size``.
    group: the DCP group (simulated or torch.distributed).
    merge: "ag_rs" (all-gather LSE + reduce-scatter), "a2a" (one all-to-all)
        or "ag" (one all-gather of ``[O | L]``; every rank gets every head).
    query: "gather" (q is this rank's heads, all-gathered first) or "local"
        (the hidden state is replicated over the DCP group, as when DCP reuses
        TP ranks, so each rank computed the group's heads itself: no query
        collective). Collectives per call: :func:`collectives_per_call`
        ("local" + "a2a" or "ag": one).
    softmax_scale: defaults to ``Dk ** -0.5``; MLA passes the model's scale.

    Returns
    -------
    out: [T, Hl, Dv] in q's dtype ([T, N*Hl, Dv] for merge "ag"); with
    ``return_lse`` also lse [T, Hl] (or [T, N*Hl]) float32.

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn.dcp import dcp_plan, dcp_decode
    >>> meta = dcp_plan([40], [1], torch.tensor([[0, 1]]), dcp_size=2, interleave_size=1, block_size=16)
    >>> kc, vc = torch.randn(2, 16, 1, 32), torch.randn(2, 16, 1, 32)
    >>> q = torch.randn(1, 4, 32)
    >>> outs = cpattn.simulate(2, lambda g: dcp_decode(q[:, 2 * g.rank:2 * g.rank + 2], (kc, vc), meta, group=g))
    >>> outs[0].shape
    torch.Size([1, 2, 32])
    >>> local = cpattn.simulate(2, lambda g: dcp_decode(q, (kc, vc), meta, group=g, query="local", merge="a2a"))
    >>> bool(torch.allclose(torch.cat(local, 1), torch.cat(outs, 1), atol=1e-6))
    True
    """
    if not isinstance(meta, DCPMeta):
        raise ValueError(f"meta must be a DCPMeta from dcp_plan(seq_lens, query_lens, block_table, ...); got "
                         f"{type(meta).__name__}")
    k_cache, v_cache = _split_cache(kv_cache, v_head_dim)
    if group.size != meta.dcp_size:
        raise ValueError(f"meta was planned for dcp_size={meta.dcp_size} but the group has {group.size} ranks")
    if q.dim() != 3 or q.shape[0] != meta.num_tokens:
        raise ValueError(
            f"q must be [T={meta.num_tokens}, Hl, Dk] (T from the plan, padding included); got {tuple(q.shape)}"
        )
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"cache block_size {k_cache.shape[1]} differs from the plan's {meta.block_size}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = dcp_attend_heads(
        q, k_cache, v_cache, meta.block_table, meta.req_indices, meta.kv_lens[group.rank],
        group=group, merge=merge, softmax_scale=scale, query=query,
    )
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
