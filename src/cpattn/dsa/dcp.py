"""DSA over a key-sharded (DCP) cache: each rank's local top-k candidates, one all-gather, the exact global
top-k re-selected in the strict order (score desc, id asc) (:func:`global_topk`), sparse MLA over the owned
keys merged by LSE."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.comm.pack import pack_bytes, unpack_bytes
from cpattn.layout.dcp import dcp_owner
from cpattn.layout.rows import cu_seqlens, request_of
from cpattn.dcp.decode import dcp_merge
from cpattn.ops import checks
from cpattn.ops.dsa import indexer_scores, sparse_mla_attention_with_lse, topk_indices

OUTPUTS_DCP = ("replicated", "head")


@dataclass(frozen=True)
class ShardedKeys:
    """One rank's share of a key-sharded (DCP) DSA cache.

    latent: [S_r, Dqk]; k_index: [S_r, D_I] -- this rank's rows;
    ids: [S_r] int64 -- global (request-local absolute) position of each row,
    ascending within each request; cu_seqlens: [B+1] -- request b's rows are
    ``cu_seqlens[b] : cu_seqlens[b+1]``. Build it with
    :func:`dcp_shard_keys`, or from any ownership rule.
    """

    latent: torch.Tensor
    k_index: torch.Tensor
    ids: torch.Tensor
    cu_seqlens: torch.Tensor


def _dcp_owned(seq_len: int, rank: int, size: int, interleave_size: int) -> torch.Tensor:
    """Positions of a sequence owned by ``rank`` under DCP, in local order (ascending position)."""
    t = torch.arange(seq_len, dtype=torch.int64)
    return t[dcp_owner(t, size, interleave_size) == rank]


def dcp_shard_keys(
    latent: torch.Tensor,
    k_index: torch.Tensor,
    cu_seqlens_k: torch.Tensor | list[int],
    rank: int,
    size: int,
    interleave_size: int = 1,
) -> ShardedKeys:
    """Rank ``rank``'s DCP share of a packed full cache (owner(t) = (t // I) % N).

    latent: [Tk, Dqk]; k_index: [Tk, D_I]; cu_seqlens_k: [B+1] per-request
    key counts; interleave_size: ``cp_kv_cache_interleave_size`` I.

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import dcp_shard_keys
    >>> dcp_shard_keys(torch.zeros(6, 8), torch.zeros(6, 4), [0, 6], 1, 2, interleave_size=2).ids.tolist()
    [2, 3]
    """
    size = checks.integer("size", size, at_least=1)
    rank = checks.rank("rank", rank, size, "the DCP group's ranks")
    interleave_size = checks.integer("interleave_size", interleave_size, at_least=1)
    cu = checks.int_list("cu_seqlens_k", cu_seqlens_k)
    checks.cumulative("cu_seqlens_k", cu, total=latent.shape[0], of=f"latent has {latent.shape[0]} rows")
    if k_index.shape[0] != latent.shape[0]:
        raise ValueError(f"k_index has {k_index.shape[0]} rows but latent {latent.shape[0]}; one of each per key token")
    ids, rows = [], []
    for b in range(len(cu) - 1):
        own = _dcp_owned(cu[b + 1] - cu[b], rank, size, interleave_size)
        ids.append(own)
        rows.append(own + cu[b])
    ids_t = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    rows_t = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)).to(latent.device)
    return ShardedKeys(latent[rows_t], k_index[rows_t], ids_t.to(latent.device),
                       torch.tensor(cu_seqlens(o.numel() for o in ids), dtype=torch.int64, device=latent.device))


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


def exchange_topk(cand_s: torch.Tensor, cand_i: torch.Tensor, topk: int, *, group: Group):
    """The exact global top-k from every rank's local candidates: one all-gather of ``[score | id]`` bytes
    (exact bits), then :func:`select_topk_candidates` over the N*k candidates of each query.

    cand_s: [T, k] scores (-inf: none); cand_i: [T, k] int64 global ids (-1: none); the same T queries
    on every rank. Returns (ids [T, topk] int64, scores [T, topk]), identical on every rank. Static
    shapes, no host sync (capturable); a one-rank group skips the collective.

    >>> import torch, cpattn
    >>> def rank(g):  # rank 0 holds ids 0, 2 and rank 1 holds ids 1, 3 of one query's keys
    ...     s = torch.tensor([[1.0, 3.0]]) if g.rank == 0 else torch.tensor([[2.0, 3.0]])
    ...     return exchange_topk(s, torch.tensor([[0, 2]]) + g.rank, 3, group=g)[0].tolist()
    >>> cpattn.simulate(2, rank)
    [[[2, 3, 1]], [[2, 3, 1]]]
    """
    if group.size > 1:
        t = cand_s.shape[0]
        likes = [cand_s[..., None], cand_i.long()[..., None]]
        got = group.all_gather(pack_bytes(likes)[None], dim=0)  # [N, T, k, bytes]
        got = got.transpose(0, 1).reshape(t, -1, got.shape[-1])  # [T, N*k, bytes]
        all_s, all_i = unpack_bytes(got, likes)
        cand_s, cand_i = all_s[..., 0], all_i[..., 0]
    return select_topk_candidates(cand_s, cand_i, topk)


def global_topk(scores: torch.Tensor, to_global: Callable[[torch.Tensor], torch.Tensor], topk: int, *,
                group: Group) -> torch.Tensor:
    """The exact global top-k of key-sharded scores: this rank's local top-k, then :func:`exchange_topk`.

    The one key-sharded top-k: :func:`dsa_dcp_topk` (packed keys, any ownership) and
    :func:`cpattn.dsa.paged.sharded_topk` (a paged DCP shard, static shapes) score their own
    keys their own way and select through it.

    scores: [T, M] this rank's scores of its own keys (-inf: not visible; NaN counts as -inf), the same T
    queries on every rank; to_global: local columns [T, k] (>= 0, < M) -> their global ids [T, k] int,
    ascending with the column within a row (so the local tie order, column asc, is the global one, id asc);
    topk: k. Returns global ids [T, topk] int64 (score desc, id asc; -1 padded), identical on every rank.
    One all-gather of ``T * topk`` (score, id) pairs; static shapes, no host sync.

    >>> import torch, cpattn
    >>> s = torch.tensor([[1.0, 3.0, 2.0, 3.0]])  # one query's scores of global keys 0..3
    >>> def rank(g):  # rank r holds keys r, r + 2 (columns 0, 1)
    ...     return global_topk(s[:, g.rank::2], lambda j: 2 * j + g.rank, 3, group=g).tolist()
    >>> cpattn.simulate(2, rank)
    [[[1, 3, 2]], [[1, 3, 2]]]
    """
    local = topk_indices(scores, topk).long()  # [T, k] local columns, -1 padded
    live, at = local >= 0, local.clamp(min=0)
    if scores.shape[1]:
        cand_s = torch.where(live, scores.gather(1, at), float("-inf"))  # [T, k] in the scores' dtype
        cand_i = torch.where(live, to_global(at).long(), -1)  # [T, k]
    else:  # no key on this rank
        cand_s, cand_i = torch.full(local.shape, float("-inf"), dtype=scores.dtype, device=scores.device), local
    return exchange_topk(cand_s, cand_i, topk, group=group)[0]


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

    Example
    -------
    Two ranks, keys interleaved one by one (rank 0 holds ids 0, 2, 4):

    >>> import torch
    >>> from cpattn import simulate
    >>> from cpattn.dsa import dcp_shard_keys, dsa_dcp_topk
    >>> g = torch.Generator().manual_seed(0)
    >>> latent, k_index = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    >>> q, w = torch.randn(1, 2, 4, generator=g), torch.rand(1, 2, generator=g)
    >>> def rank_fn(group):
    ...     keys = dcp_shard_keys(latent, k_index, [0, 6], group.rank, 2)
    ...     ids, rows = dsa_dcp_topk(q, w, torch.tensor([5]), [0, 1], keys, group=group, topk=3)
    ...     return ids.tolist(), rows.tolist()
    >>> simulate(2, rank_fn)
    [([[2, 4, 3]], [[1, 2, -1]]), ([[2, 4, 3]], [[-1, -1, 1]])]
    """
    dev = q_index.device
    t = q_index.shape[0]
    _check_topk_args(q_index, positions, cu_seqlens_q, keys)
    topk = checks.integer("topk", topk, at_least=1)
    cu_q = torch.as_tensor(checks.int_list("cu_seqlens_q", cu_seqlens_q), dtype=torch.int64, device=dev)
    req = request_of(cu_q, torch.arange(t, device=dev))  # [T] request of query
    cu_k = keys.cu_seqlens.to(dev).long()
    big = int(positions.max()) + 2 if positions.numel() else 1
    big = max(big, int(keys.ids.max()) + 2 if keys.ids.numel() else 1)
    req_k = request_of(cu_k, torch.arange(keys.ids.numel(), device=dev))  # [S_r]
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
    scores = indexer_scores(q_index, w_index, keys.k_index, start, visible, max(lens, default=0))  # [T, M]
    ids = keys.ids.long()
    last = max(ids.numel() - 1, 0)
    gids = global_topk(scores, lambda j: ids[(start[:, None] + j).clamp(max=last)], topk, group=group)  # [T, k]
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
    if keys.k_index.shape[0] != s_r:
        raise ValueError(f"keys.k_index has {keys.k_index.shape[0]} rows but keys.latent {s_r}; one of each per key")
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
    v_head_dim: int = 512,
    output: str = "replicated",
    return_lse: bool = False,
    return_indices: bool = False,
):
    """Sparse MLA over a key-sharded (DCP) cache with the exact global top-k.

    Arguments
    ---------
    q: [T, H, Dqk] -- absorbed queries, the same on every rank.
    q_index, w_index, positions, cu_seqlens_q, keys, group, topk: as
        :func:`dsa_dcp_topk`. softmax_scale, v_head_dim: as :func:`dsa_attention`.
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
    ...                              topk=2, softmax_scale=0.1, v_head_dim=32)
    >>> cpattn.simulate(2, rank_fn)[0].shape
    torch.Size([3, 4, 32])
    """
    if output not in OUTPUTS_DCP:
        raise ValueError(f"output must be one of {OUTPUTS_DCP}; got {output!r}")
    if q.dim() != 3 or q.shape[0] != q_index.shape[0]:
        raise ValueError(f"q must be [T={q_index.shape[0]}, H, Dqk] (one row per query of q_index); got {tuple(q.shape)}")
    h, n = q.shape[1], group.size
    if output == "head" and h % n:
        raise ValueError(f"output='head' needs H % N == 0; got H={h}, N={n}; use output='replicated'")
    gids, rows = dsa_dcp_topk(q_index, w_index, positions, cu_seqlens_q, keys, group=group, topk=topk)
    # partial over the selected keys this rank owns, kept in float32 for the merge
    out, lse = sparse_mla_attention_with_lse(
        q.float() if q.dtype != torch.float64 else q, keys.latent, rows,
        softmax_scale=softmax_scale, v_head_dim=v_head_dim,
    )
    # the DCP merge: one all-gather of [out | lse] (every head) or one all-to-all per head slice
    merged, mlse = dcp_merge(out, lse, group=group, merge="ag" if output == "replicated" else "a2a")
    res = (merged.to(q.dtype),) + ((mlse.to(lse.dtype),) if return_lse else ()) + ((gids,) if return_indices else ())
    return res[0] if len(res) == 1 else res

