"""Decode context parallel: ``dcp_plan`` + ``dcp_decode`` over a DCP-sharded paged cache (DESIGN.md §4.3).

Each of the N ranks of the DCP group stores 1/N of every sequence (tokens
dealt in runs of ``interleave_size``, see :mod:`cpattn.layout.dcp`) and its
own TP slice of the query heads. A decode step::

    q [T, Hl, D] --all_gather(heads)--> [T, N*Hl, D]
       --paged_attention_with_lse(local shard)--> partial (O_r, L_r) for all N*Hl heads
       --merge--> [T, Hl, Dv], each rank its own heads again

Merges: ``"ag_rs"`` all-gathers the LSEs [T, N*Hl], rescales the local
output by ``exp(L_r - L)`` and reduce-scatters it over heads; ``"a2a"`` sends
``[O | L]`` of head slice j to rank j in one all-to-all and merges the N
partials there; ``"ag"`` all-gathers ``[O | L]`` and every rank merges every
head. All move O(T * H * D) per rank, independent of context length.

Fewer collectives: DCP reuses TP ranks, where the hidden state is the same on
every rank of the group, so a rank can compute the group's query heads
itself (``query="local"``) instead of gathering them: one collective per
layer with ``"a2a"`` (own heads) or ``"ag"`` (all heads). With TP's output
projection after it, :func:`dcp_fold_weights` folds the merge's rescale into
the TP all-reduce (a linear map commutes with the weighted sum), leaving one
all-gather of T x H LSEs as the only extra collective.

Plan / run split (for graph capture): :func:`dcp_plan` does the host work
(validation, the token count) once per batch and returns a :class:`DCPMeta`
of device tensors; :func:`plan_tensors` builds those tensors from
``seq_lens`` / ``query_lens`` / ``block_table`` with tensor ops only, so a
captured program can refresh them. :func:`dcp_decode` itself touches only
device tensors of static shape: no ``.item()``, no ``.tolist()``, no
data-dependent shapes (the CPU attention kernel does host work *inside* its
op, which a graph either calls as one opaque op or, for decode-sized batches
under torch.compile on CPU, replaces by the op's sync-free decomposition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.layout.rows import request_of
from cpattn.ops import checks, merge_attn_states
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.ref import acc_dtype, lse_weights

MERGES = ("ag_rs", "a2a", "ag")
QUERIES = ("gather", "local")


@dataclass(frozen=True)
class DCPMeta:
    """Device tensors describing one DCP batch (the same object serves every rank).

    Static (Python ints, fixed per captured graph): ``dcp_size`` (N),
    ``interleave_size`` (I), ``block_size``, and the shapes: T =
    ``num_tokens`` query rows (padding included), B requests, ``max_blocks``.

    Tensors (refreshable in place, see :func:`plan_tensors`):

    - ``block_table``: [B, max_blocks] -- shared by every DCP rank.
    - ``seq_lens``: [B] tokens per request *including* this step's new ones;
      ``query_lens``: [B]; ``cu_seqlens_q``: [B+1].
    - ``req_indices``: [T] int64 request of each query row, -1 for padding.
    - ``positions``: [T] int64 absolute position of each query row, -1 for padding.
    - ``kv_lens``: [N, T] int32 -- local keys row t sees on rank r:
      ``local_len(positions[t] + 1, r)`` (0 for padding).
    - ``slot_mapping``: [N, T] int64 -- where rank r writes each new token's
      KV (-1: not its token); pass ``meta.slot_mapping[rank]`` to ``write_kv``.
    """

    dcp_size: int
    interleave_size: int
    block_size: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    req_indices: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T, the static number of query rows (padding included)."""
        return self.req_indices.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]


def plan_tensors(
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    dcp_size: int,
    interleave_size: int,
    block_size: int,
) -> dict[str, torch.Tensor]:
    """The tensors of a :class:`DCPMeta`, by tensor ops only (no host sync; capturable).

    seq_lens, query_lens: [B] int (B >= 1); block_table: [B, max_blocks];
    num_tokens: T >= sum(query_lens) (rows past the sum are padding).
    Returns a dict with ``cu_seqlens_q`` [B+1], ``req_indices`` [T],
    ``positions`` [T], ``kv_lens`` [N, T], ``slot_mapping`` [N, T].

    Example
    -------
    >>> import torch
    >>> t = plan_tensors(torch.tensor([5, 3]), torch.tensor([1, 2]), torch.zeros(2, 4, dtype=torch.long),
    ...                  num_tokens=4, dcp_size=2, interleave_size=1, block_size=4)
    >>> t["positions"].tolist(), t["kv_lens"].tolist()
    ([4, 1, 2, -1], [[3, 1, 2, 0], [2, 1, 1, 0]])
    """
    dev = block_table.device
    b = seq_lens.shape[0]
    seq = seq_lens.to(dev, torch.int64)
    ql = query_lens.to(dev, torch.int64)
    cu = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    cu[1:] = torch.cumsum(ql, 0)  # [B+1]
    rows = torch.arange(num_tokens, device=dev)  # [T]
    req = request_of(cu, rows)  # [T]: b with cu[b] <= row < cu[b+1]; B past the end
    valid = req < b
    rc = req.clamp(max=b - 1)
    pos = seq[rc] - ql[rc] + (rows - cu[rc])  # [T]: queries are the last q_len tokens
    pos = torch.where(valid, pos, -1)
    req = torch.where(valid, req, -1)
    kv_lens = dcp_local_lens(pos + 1, dcp_size, interleave_size).T.to(torch.int32)  # [N, T]; pos -1 -> 0
    slots = torch.stack([
        dcp_slot_mapping(pos, req, block_table, dcp_rank=r, dcp_size=dcp_size,
                         interleave_size=interleave_size, block_size=block_size)
        for r in range(dcp_size)
    ])  # [N, T]
    return {"cu_seqlens_q": cu, "req_indices": req, "positions": pos, "kv_lens": kv_lens, "slot_mapping": slots}


def _as_tensor(name, x, device):
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(checks.int_list(name, x), dtype=torch.int64)
    checks.int_tensor(name, x, dims=1, desc="[B] (or a list of ints)")
    return x.to(device, torch.int64)


def dcp_plan(
    seq_lens: torch.Tensor | list[int],
    query_lens: torch.Tensor | list[int],
    block_table: torch.Tensor,
    *,
    dcp_size: int,
    interleave_size: int,
    block_size: int,
    num_tokens: int | None = None,
    check: bool = True,
) -> DCPMeta:
    """Plan a DCP decode (or mixed decode + chunked-prefill) step.

    Arguments
    ---------
    seq_lens: [B] tokens of each request after this step (cached + new).
    query_lens: [B] new (query) tokens of each request: 1 for plain decode,
        1 + k with k speculative tokens, more for a prefill chunk, 0 for an
        idle request. The queries are the last ``query_lens[b]`` positions.
    block_table: [B, max_blocks] int, shared by every DCP rank.
    dcp_size: N; interleave_size: I (``block_size % I == 0``); block_size: cache block size.
    num_tokens: T, the static row count (pad a captured batch up to its
        bucket size); default ``sum(query_lens)`` (one host sync).
    check: validate lengths against the block table on the host (syncs).

    Returns
    -------
    A :class:`DCPMeta` (identical on every rank).

    Example
    -------
    >>> import torch
    >>> meta = dcp_plan([5, 3], [1, 2], torch.zeros(2, 4, dtype=torch.long),
    ...                 dcp_size=2, interleave_size=1, block_size=4)
    >>> meta.num_tokens, meta.kv_lens[0].tolist()
    (3, [3, 1, 2])
    """
    checks.int_tensor("block_table", block_table, dims=2, desc="[B, max_blocks]")
    dcp_size = checks.integer("dcp_size", dcp_size, at_least=1)
    dev = block_table.device
    seq, ql = _as_tensor("seq_lens", seq_lens, dev), _as_tensor("query_lens", query_lens, dev)
    b = block_table.shape[0]
    if seq.shape != (b,) or ql.shape != (b,) or b < 1:
        raise ValueError(
            f"seq_lens {tuple(seq.shape)} and query_lens {tuple(ql.shape)} must both be [B] with B = "
            f"block_table rows = {b} >= 1 (pad an empty batch with one idle request)"
        )
    if block_size < 1 or interleave_size < 1 or block_size % interleave_size:
        raise ValueError(
            f"block_size ({block_size}) must be a positive multiple of interleave_size ({interleave_size})"
        )
    if num_tokens is None:
        num_tokens = int(ql.sum())
    num_tokens = checks.integer("num_tokens", num_tokens, at_least=0)
    if check:
        bad = (ql < 0) | (ql > seq)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"request {i}: query_lens[{i}] = {int(ql[i])}, seq_lens[{i}] = {int(seq[i])}; need "
                "0 <= query_lens <= seq_lens per request (seq_lens counts cached + new tokens)"
            )
        if int(ql.sum()) > num_tokens:
            raise ValueError(f"num_tokens = {num_tokens} is below sum(query_lens) = {int(ql.sum())}")
        need = int(dcp_local_lens(seq, dcp_size, interleave_size).max()) if b else 0
        if need > block_table.shape[1] * block_size:
            raise ValueError(
                f"a rank holds up to {need} tokens of one request but block_table addresses "
                f"{block_table.shape[1]} blocks x {block_size}; widen the block table"
            )
    t = plan_tensors(seq, ql, block_table, num_tokens=num_tokens, dcp_size=dcp_size,
                     interleave_size=interleave_size, block_size=block_size)
    return DCPMeta(dcp_size=dcp_size, interleave_size=interleave_size, block_size=block_size,
                   block_table=block_table, seq_lens=seq, query_lens=ql, **t)


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
        lses = group.all_gather(l[None], dim=0)  # [N, T, H]
        total = lse_weights(lses)[2]  # [T, H]: the merged LSE (NaN if any rank's is NaN)
        empty = l == float("-inf")  # only an empty partial is zeroed; NaN and underflow are not masked
        w = torch.where(empty, 0.0, torch.exp(l - total))  # [T, H]
        part = torch.where(empty[..., None], 0.0, o)  # an empty partial may hold garbage
        out = group.reduce_scatter(part * w[..., None], dim=1)  # [T, H/N, Dv]
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
    total = lse_weights(lses)[2]  # [T, H]
    empty = l == float("-inf")
    return torch.where(empty, 0.0, torch.exp(l - total)), total


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


@dataclass(frozen=True)
class DCPContext:
    """A DCP-sharded paged cache of earlier tokens, usable as ``pcp_prefill(context=...)``.

    Every new token of request b sees all ``context_lens[b]`` cached tokens
    (non-causally); rank r holds its DCP share of them.

    Fields
    ------
    k_cache: [num_blocks, block_size, Hkv, Dk]; v_cache: [.., .., Hkv, Dv]
        (MLA: the latent cache and ``latent[..., :512]``) -- this rank's shard.
    block_table: [B, max_blocks]; context_lens: [B] cached tokens per request.
    interleave_size: I of the DCP layout.
    group: the DCP group; None means the group ``attend`` is called with.
    shard: how the query rows differ across the group --
        "tokens": each rank holds different tokens with all heads (a PCP group
        that is also the DCP group): queries are all-gathered by token, each
        rank attends all of them against its shard, and an all-to-all brings
        every rank its own tokens' N partials to merge;
        "heads": every rank holds the same tokens and its own TP heads (as in
        :func:`dcp_decode`).
    merge: "ag_rs" or "a2a", for ``shard="heads"``.

    Example
    -------
    >>> # ctx = DCPContext(kc, vc, block_table, context_lens, interleave_size=16)
    >>> # out = pcp_prefill(q, k, v, plan, group=g, context=ctx)
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    interleave_size: int
    group: Group | None = None
    shard: str = "tokens"
    merge: str = "a2a"

    def attend(self, q: torch.Tensor, cu_q: torch.Tensor, scale: float, group: Group):
        """Partial attention of q [Tq, Hq, Dk] (request b: rows cu_q[b]:cu_q[b+1]) over the cached context.

        Returns out [Tq, Hq, Dv] float32 and lse [Tq, Hq] float32, merged over the DCP group.
        """
        g = self.group if self.group is not None else group
        if self.shard not in ("tokens", "heads"):
            raise ValueError(f"shard must be 'tokens' or 'heads'; got {self.shard!r}")
        dev = q.device
        checks.int_tensor("context_lens", self.context_lens, dims=1, desc="[B]")
        checks.int_tensor("block_table", self.block_table, dims=2, desc="[B, max_blocks]")
        checks.cu_seqlens("cu_q", cu_q, total=q.shape[0], of=f"q has {q.shape[0]} rows", exact=True)
        cu = cu_q.to(dev, torch.int64)
        ctx = self.context_lens.to(dev, torch.int64)
        if cu.shape[0] != ctx.shape[0] + 1:
            raise ValueError(f"cu_q has {cu.shape[0]} entries but context_lens covers {ctx.shape[0]} requests")
        if self.block_table.shape[0] != ctx.shape[0]:
            raise ValueError(
                f"block_table has {self.block_table.shape[0]} rows but context_lens covers {ctx.shape[0]} "
                "requests; give every request one row"
            )
        checks.within("context_lens", ctx, 0, None, expected="a count of cached tokens >= 0")
        local = dcp_local_lens(ctx, g.size, self.interleave_size)[:, g.rank]  # [B] keys every new token sees here
        self._check_fits(ctx, local, g.rank)
        if self.shard == "heads":
            req = _rows_to_requests(cu, q.shape[0])
            kv_lens = torch.where(req >= 0, local[req.clamp(min=0)], 0)
            return dcp_attend_heads(q, self.k_cache, self.v_cache, self.block_table, req, kv_lens,
                                    group=g, merge=self.merge, softmax_scale=scale)
        return self._attend_tokens(q, cu, local, scale, g)

    def _check_fits(self, ctx: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Every request's cached tokens on this rank fit its block-table row (one host read)."""
        reach = self.block_table.shape[1] * self.k_cache.shape[1]
        far = local > reach
        if checks.values_checkable() and bool(far.any()):
            b = int(far.nonzero()[0])
            raise ValueError(
                f"context_lens[{b}] = {int(ctx[b])} puts {int(local[b])} cached tokens on DCP rank {rank}, but a "
                f"block_table row addresses {self.block_table.shape[1]} x {self.k_cache.shape[1]} = {reach} slots; "
                "widen the block table"
            )

    def _attend_tokens(self, q, cu, local, scale, g):
        n, t = g.size, q.shape[0]
        cus = g.all_gather(cu[None], dim=0)  # [N, B+1]: every rank's request boundaries
        t_max = int(cus[:, -1].max())  # host sync: prefill runs eagerly
        dv = self.v_cache.shape[-1]
        acc = acc_dtype(q)
        if t_max == 0:
            return q.new_zeros(t, q.shape[1], dv, dtype=acc), torch.full((t, q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        q_pad = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, t_max - t))  # [t_max, Hq, Dk]
        q_all = g.all_gather(q_pad, dim=0)  # [N*t_max, Hq, Dk]
        req = torch.cat([_rows_to_requests(cus[j], t_max) for j in range(n)])  # [N*t_max]
        kv_lens = torch.where(req >= 0, local[req.clamp(min=0)], 0)
        o, l = paged_attention_with_lse(q_all, self.k_cache, self.v_cache, self.block_table, req, kv_lens,
                                        softmax_scale=scale)  # [N*t_max, Hq, Dv], [N*t_max, Hq]
        buf = torch.cat([o.to(acc), l.to(acc)[..., None]], dim=-1)  # [N*t_max, Hq, Dv+1]
        got = g.all_to_all(buf, dim=0).view(n, t_max, q.shape[1], dv + 1)  # partials of my tokens from each rank
        out, lse = merge_attn_states(got[..., :dv], got[..., dv])
        return out[:t], lse[:t]


def _rows_to_requests(cu: torch.Tensor, t: int) -> torch.Tensor:
    """Request of each of t rows given cu [B+1]; -1 for rows past cu[-1]. -> [t] int64."""
    b = cu.shape[0] - 1
    rows = torch.arange(t, device=cu.device)
    req = request_of(cu, rows)
    return torch.where(req < b, req, -1)
