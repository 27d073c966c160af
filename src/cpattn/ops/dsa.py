"""DeepSeek Sparse Attention ops: lightning indexer, exact top-k, sparse MLA (DESIGN.md §4.4).

Three ops, each defined once in the registry (schema + fake + CPU kernel;
the plain references live in :mod:`cpattn.ops.dsa_ref`):

- ``indexer_scores``: ``I[t, s] = sum_h w[t,h] * relu(q_I[t,h] . k_I[key_start[t] + s])``
  in float32 for ``s < visible[t]``, ``-inf`` elsewhere. Packed varlen
  batches describe each query's keys by where its request's keys start in
  ``k_I`` and how many of them it sees (causal: ``pos + 1``); see
  :func:`causal_key_ranges`. DeepSeek-V3.2 folds ``H_I**-0.5 * D_I**-0.5``
  into ``w``; positive constants never change the selection.
- ``topk_indices``: the k best columns per row in one strict total order,
  score descending then column ascending, so ties are broken the same way
  on every device and every shard; ``-1`` pads rows with fewer than k
  visible keys.
- ``sparse_mla_attention_with_lse``: absorbed MLA ("MQA" form, one latent KV
  head) over the selected cache rows only: keys are the ``Dqk = 576`` dim
  ``[latent 512 | rope 64]`` entries, values their first ``value_dim = 512``
  dims; ``-1`` indices are ignored; returns the fp32 LSE for merging.

The softmax scale is always explicit and is the model's:
``qk_head_dim**-0.5 * mscale**2`` (DeepSeek-V3.2: ``qk_head_dim = 128 + 64 =
192``; with YaRN ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``), never
``576**-0.5``; :func:`mla_softmax_scale` computes it.

Optional FP8: ``indexer_scores(..., fp8=True)`` simulates the e4m3 indexer of
the reference design (per-token key scales, per-token-per-head query scales,
folded into ``w``); :func:`selection_mismatch` reports how often the selected
set differs from the fp32 one.
"""

from __future__ import annotations

import math

import torch

from cpattn.ops import checks, dsa_ref, ref, registry

# elements of one fp32 work buffer in the chunked CPU kernels (64 MiB)
_CHUNK_ELEMS = 1 << 24
# queries per indexer chunk (bounds the wasted upper triangle of a causal prefill)
_ROWS = 128
# keys per indexer tile: upcast to fp32 in a reused buffer (8192 x 128 fp32 = 4 MiB)
_KEY_TILE = 8192


# --------------------------------------------------------------------------- indexer_scores
@registry.define("indexer_scores")
def _indexer_op(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, key_start: torch.Tensor, visible: torch.Tensor, max_keys: int
) -> torch.Tensor:
    raise registry.no_kernel("indexer_scores", q)


@registry.fake("indexer_scores")
def _indexer_fake(q, w, k, key_start, visible, max_keys):
    return q.new_empty(q.shape[0], max_keys, dtype=ref.acc_dtype(q, w, k))


def _runs(key_start: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [t0, t1) of consecutive queries sharing one key_start (one request)."""
    runs, t0 = [], 0
    for t in range(1, len(key_start) + 1):
        if t == len(key_start) or key_start[t] != key_start[t0]:
            runs.append((t0, t))
            t0 = t
    return runs


@registry.kernel("indexer_scores", "cpu")
def _indexer_cpu(q, w, k, key_start, visible, max_keys):
    return _indexer_tiles(q, w, k, None, key_start, visible, max_keys)


def _indexer_tiles(q, w, k, k_scale, key_start, visible, max_keys):
    """The CPU indexer: key-major tiles upcast to the accumulation dtype one at a time.

    q: [T, H, D]; w: [T, H]; k: [S, D] in any float dtype (bf16, fp16, float8 e4m3 with
    ``k_scale`` [S] > 0, fp32, fp64). Each tile of <= ``_KEY_TILE`` keys is converted to fp32
    (fp64 for fp64 inputs) in a small reused buffer, so bf16 and FP8 caches run at the fp32
    speed and nothing of size S is ever materialised in fp32. Per tile and row chunk: the
    logits (one decode query: ``tile @ q.T`` [L, H], keys as rows, the fast orientation for a
    skinny query; prefill rows: ``q_rows @ tile.T`` [n*H, L]), ReLU, the weighted sum over
    heads, then ``* k_scale`` (a positive per-key factor commutes with ReLU). Returns
    [T, max_keys] with -inf past ``visible``.
    """
    acc = ref.acc_dtype(q, w, k)
    t_all, h, d = q.shape
    out = torch.full((t_all, max_keys), float("-inf"), dtype=acc, device=q.device)
    starts, vis = key_start.tolist(), visible.tolist()  # ranges checked by the public wrapper
    for t0, t1 in _runs(starts):
        run_keys = max(vis[t0:t1])
        if run_keys == 0:
            continue
        # row chunks of <= _ROWS queries: each scores only up to its own last visible key,
        # so a causal prefill computes about the triangle, not the square
        step = max(1, min(_ROWS, _CHUNK_ELEMS // (h * min(run_keys, _KEY_TILE))))
        for a in range(t0, t1, step):
            b = min(a + step, t1)
            n_keys = max(vis[a:b])
            if n_keys == 0:
                continue
            n = b - a
            q_rows = q[a:b].to(acc).reshape(n * h, d)  # [n*H, D]
            if n == 1:
                q_rows = q_rows.T.contiguous()  # [D, H]: one query scores keys as rows
            w_rows = w[a:b].to(acc)  # [n, H]
            tile = max(1, min(_KEY_TILE, _CHUNK_ELEMS // (n * h)))
            buf = torch.empty(min(tile, n_keys), d, dtype=acc, device=q.device)  # reused upcast tile
            base = starts[t0]
            for j in range(0, n_keys, tile):
                m = min(tile, n_keys - j)
                kt = buf[:m]
                _upcast(kt, k[base + j : base + j + m])  # [m, D] in fp32 (bf16, fp16, fp8 ...)
                if n == 1:  # decode: [m, D] @ [D, H], the fast orientation for a skinny query
                    s = torch.mv(torch.mm(kt, q_rows).relu_(), w_rows[0])[None]  # [1, m]
                else:  # prefill rows: [n*H, D] @ [D, m], then the head sum as one bmm
                    logits = torch.mm(q_rows, kt.T).relu_().view(n, h, m)  # [n, H, m]
                    s = torch.bmm(w_rows[:, None, :], logits)[:, 0]  # [n, m]
                if k_scale is not None:
                    s = s * k_scale[base + j : base + j + m].to(acc)[None]
                out[a:b, j : j + m] = s
            cols = torch.arange(n_keys, device=q.device)
            out[a:b, :n_keys].masked_fill_(cols[None, :] >= visible[a:b, None], float("-inf"))
    return out


def _upcast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst [m, D] (fp32 / fp64) <- src [m, D]; float8 e4m3 through a 256-entry table (one gather is
    several times faster than the elementwise fp8 conversion on CPUs without AVX2)."""
    if src.dtype != torch.float8_e4m3fn:
        dst.copy_(src)
        return
    lut = _FP8_LUT.get(dst.dtype)
    if lut is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        lut = _FP8_LUT.setdefault(dst.dtype, codes.to(dst.dtype))  # [256] value of each byte
    idx = src.view(torch.uint8).reshape(-1).to(torch.int32)
    torch.index_select(lut.to(dst.device), 0, idx, out=dst.view(-1))


_FP8_LUT: dict[torch.dtype, torch.Tensor] = {}


@registry.define("indexer_scores_fp8")
def _indexer_fp8_op(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, key_start: torch.Tensor,
    visible: torch.Tensor, max_keys: int
) -> torch.Tensor:
    raise registry.no_kernel("indexer_scores_fp8", q)


@registry.fake("indexer_scores_fp8")
def _indexer_fp8_fake(q, w, k, k_scale, key_start, visible, max_keys):
    return q.new_empty(q.shape[0], max_keys, dtype=ref.acc_dtype(q, w))


@registry.kernel("indexer_scores_fp8", "cpu")
def _indexer_fp8_cpu(q, w, k, k_scale, key_start, visible, max_keys):
    return _indexer_tiles(q, w, k, k_scale, key_start, visible, max_keys)


# --------------------------------------------------------------------------- topk_indices
@registry.define("topk_indices")
def _topk_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    raise registry.no_kernel("topk_indices", scores)


@registry.fake("topk_indices")
def _topk_fake(scores, k):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


@registry.kernel("topk_indices", "cpu")
def _topk_cpu(scores, k):
    t, n = scores.shape
    kk = min(k, n)
    out = torch.full((t, k), -1, dtype=torch.int32, device=scores.device)
    if kk == 0 or t == 0:
        return out
    s = scores.masked_fill(scores.isnan(), float("-inf"))  # [T, S]
    thr = torch.topk(s, kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [T, 1] k-th best
    above = s > thr
    tied = s == thr
    need = kk - above.sum(-1, keepdim=True)  # ties to take, lowest column first
    take = above | (tied & (tied.cumsum(-1) <= need))  # exactly kk per row
    idx = take.nonzero()[:, 1].view(t, kk)  # [T, kk] ascending column
    vals = s.gather(1, idx)
    order = torch.sort(vals, dim=-1, descending=True, stable=True)  # score desc, column asc
    idx = idx.gather(1, order.indices)
    out[:, :kk] = torch.where(order.values == float("-inf"), -1, idx).to(torch.int32)
    return out


# --------------------------------------------------------------------------- sparse MLA
@registry.define("sparse_mla_attention_with_lse")
def _sparse_op(
    q: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, softmax_scale: float, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("sparse_mla_attention_with_lse", q)


@registry.fake("sparse_mla_attention_with_lse")
def _sparse_fake(q, latent, indices, softmax_scale, value_dim):
    t, h, _ = q.shape
    return q.new_empty(t, h, value_dim), q.new_empty(t, h, dtype=ref.acc_dtype(q, latent))


@registry.kernel("sparse_mla_attention_with_lse", "cpu")
def _sparse_cpu(q, latent, indices, softmax_scale, value_dim):
    acc = ref.acc_dtype(q, latent)
    t_all, h, d = q.shape
    kk = indices.shape[1]
    out = q.new_zeros(t_all, h, value_dim)
    lse = torch.full((t_all, h), float("-inf"), dtype=acc, device=q.device)
    if t_all == 0 or kk == 0 or latent.shape[0] == 0:
        return out, lse
    step = max(1, _CHUNK_ELEMS // (kk * max(d, h)))
    for a in range(0, t_all, step):
        b = min(a + step, t_all)
        idx = indices[a:b].long()  # [n, K]
        valid = idx >= 0
        kv = latent.index_select(0, idx.clamp(min=0).flatten()).view(b - a, kk, d).to(acc)  # [n, K, D]
        all_valid = bool(valid.all())
        if not all_valid:
            kv = torch.where(valid[..., None], kv, 0.0)  # unselected rows may hold NaN
        s = torch.bmm(q[a:b].to(acc), kv.transpose(1, 2)).mul_(softmax_scale)  # [n, H, K]
        if not all_valid:
            s.masked_fill_(~valid[:, None, :], float("-inf"))
        # one exp pass: p = exp(s - max), lse = max + log(sum p); NaN in a selected row stays NaN
        mx = s.amax(-1)  # [n, H]
        live = mx != float("-inf")  # only a query without any index is zeroed
        p = torch.exp(s.sub_(torch.where(live, mx, 0.0)[..., None]))  # [n, H, K]
        total = p.sum(-1)  # [n, H]
        o = torch.bmm(p.div_(total[..., None]), kv[..., :value_dim])  # [n, H, Dv]
        out[a:b] = torch.where(live[..., None], o, 0.0).to(q.dtype)
        lse[a:b] = torch.where(live, mx + torch.log(total), float("-inf"))
    return out, lse


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("indexer_scores", "cuda")
    def _indexer_cuda(q, w, k, key_start, visible, max_keys):
        return dsa_ref.indexer_scores(q, w, k, key_start, visible, max_keys)

    @registry.kernel("indexer_scores_fp8", "cuda")
    def _indexer_fp8_cuda(q, w, k, k_scale, key_start, visible, max_keys):
        return dsa_ref.indexer_scores(q, w, k.float() * k_scale.float()[:, None], key_start, visible, max_keys)

    @registry.kernel("topk_indices", "cuda")
    def _topk_cuda(scores, k):
        return dsa_ref.topk_indices(scores, k)

    @registry.kernel("sparse_mla_attention_with_lse", "cuda")
    def _sparse_cuda(q, latent, indices, softmax_scale, value_dim):
        return dsa_ref.sparse_mla_attention_with_lse(q, latent, indices, softmax_scale, value_dim)


# --------------------------------------------------------------------------- public wrappers
def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    key_start: torch.Tensor,
    visible: torch.Tensor,
    max_keys: int | None = None,
    *,
    fp8: bool = False,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning-indexer scores of packed queries against their requests' keys.

    Arguments
    ---------
    q: [T, H_I, D_I] -- indexer queries (RoPE applied, NeoX half-split style).
    w: [T, H_I] -- per-query head weights (any positive constant folded in).
    k: [S, D_I] -- indexer keys of every request, one row per token.
    key_start: [T] int -- row of ``k`` holding key 0 of query t's request.
    visible: [T] int -- keys query t sees: ``k[key_start[t] : key_start[t] + visible[t]]``
        (causal: ``pos_t + 1``, capped by the request's key count).
    max_keys: width of the result (>= max(visible)); given by the plan so
        shapes are static; ``None`` reads ``visible.max()`` (host sync).
        A ValueError names the first query whose range breaks
        ``0 <= key_start``, ``0 <= visible <= max_keys``,
        ``key_start + visible <= S`` (not checked while tracing or capturing).
    fp8: quantize q (per token and head) and k (per token) to float8 e4m3
        and dequantize before scoring, as the reference FP8 indexer does.
    k_scale: [S] float32 > 0 -- with ``k`` a float8 e4m3 *cache* (from
        :func:`fp8_index_cache`): key s is ``k[s] * k_scale[s]`` (one scale per
        128-dim block = per key for D_I = 128, as DeepSeek-V3.2's indexer key
        cache). The kernel reads FP8 tiles and upcasts them; q stays as given.

    bf16 / fp16 / FP8 keys are upcast tile by tile (fp32 accumulation), so
    they score at the fp32 speed; the result is always fp32 (fp64 for fp64).

    Returns
    -------
    scores: [T, max_keys] float32 (float64 for float64 inputs); column s is
    the request-local key index; ``-inf`` where ``s >= visible[t]``.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import indexer_scores, causal_key_ranges
    >>> q, w, k = torch.randn(5, 4, 16), torch.rand(5, 4), torch.randn(5, 16)
    >>> start, vis = causal_key_ranges([0, 2, 5], [0, 2, 5])
    >>> indexer_scores(q, w, k, start, vis).shape
    torch.Size([5, 3])
    """
    _check_indexer(q, w, k, key_start, visible)
    if max_keys is None:
        max_keys = int(visible.max()) if visible.numel() else 0
    max_keys = checks.integer("max_keys", max_keys, at_least=0)
    checks.key_ranges(key_start, visible, num_keys=k.shape[0], max_keys=max_keys)
    if k.dtype == torch.float8_e4m3fn or k_scale is not None:
        if k.dtype != torch.float8_e4m3fn or k_scale is None or k_scale.shape != k.shape[:1]:
            raise ValueError(
                f"an FP8 key cache is k float8_e4m3fn [S, D_I] with k_scale [S]; got k {k.dtype} "
                f"{tuple(k.shape)}, k_scale {None if k_scale is None else tuple(k_scale.shape)}; build both "
                "with fp8_index_cache(k)"
            )
        return torch.ops.cpattn.indexer_scores_fp8(q, w, k, k_scale, key_start, visible, int(max_keys))
    if fp8:
        q8, q_scale = fp8_quantize(q)  # [T, H, D], [T, H]
        k8, k_scale = fp8_quantize(k)  # [S, D], [S]
        q = q8.float()
        w = w.float() * q_scale  # relu(a x) = a relu(x) for a > 0
        k = k8.float() * k_scale[:, None]
    return torch.ops.cpattn.indexer_scores(q, w, k, key_start, visible, int(max_keys))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best columns of each row: score descending, then column ascending.

    Arguments
    ---------
    scores: [T, S] -- ``-inf`` marks an invisible key (NaN counts as -inf).
    k: number of keys to keep (``index_topk``, 2048 in DeepSeek-V3.2).

    Returns
    -------
    indices: [T, k] int32, in the strict order above; ``-1`` fills the tail
    of rows with fewer than k visible keys. The order is total, so the
    result is the same on every device and equals a re-selection from any
    superset of candidates (what the key-sharded top-k relies on).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import topk_indices
    >>> topk_indices(torch.tensor([[1.0, 3.0, 3.0, float("-inf")]]), 4).tolist()
    [[1, 2, 0, -1]]
    """
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating [T, S] tensor; got {scores.dtype} {tuple(scores.shape)}")
    k = checks.integer("k", k, at_least=1)
    return torch.ops.cpattn.topk_indices(scores, k)


def sparse_mla_attention_with_lse(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    value_dim: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the top-k selected cache rows only.

    Arguments
    ---------
    q: [T, H, Dqk] -- absorbed queries ``[q_nope @ W_UK | q_rope]`` (Dqk = 576).
    latent_cache: [S, Dqk], [S, 1, Dqk] or paged [num_blocks, block_size, (1,) Dqk]
        -- one latent KV head; row s is ``[latent 512 | rope key 64]`` and its
        value is ``row[:value_dim]``. A paged cache is indexed by slot
        (``block_id * block_size + offset``).
    indices: [T, K] int -- cache rows each query attends; ``-1`` is ignored.
        Rows of one query must be distinct; any other value outside the
        cache is a ValueError naming the first one (not checked while tracing
        or capturing).
    softmax_scale: the model's scale (``qk_head_dim**-0.5 * mscale**2``, see
        :func:`mla_softmax_scale`), never ``Dqk**-0.5``. Required.
    value_dim: value width (512 for DeepSeek).

    Returns
    -------
    out: [T, H, value_dim] in q's dtype; lse: [T, H] float32 (float64 for
    float64 inputs). A query without any index gets out 0, lse -inf. Rows of
    the cache a query did not select never reach it (they may hold NaN); a
    NaN in a row it selected makes its output NaN, as in the dense oracle.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import sparse_mla_attention_with_lse
    >>> q, cache = torch.randn(3, 4, 48), torch.randn(10, 48)
    >>> idx = torch.tensor([[0, 5, -1], [1, 2, 3], [-1, -1, -1]])
    >>> out, lse = sparse_mla_attention_with_lse(q, cache, idx, softmax_scale=0.1, value_dim=32)
    >>> out.shape, lse[2].tolist()
    (torch.Size([3, 4, 32]), [-inf, -inf, -inf, -inf])
    """
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, H, Dqk] tensor; got {q.dtype} {tuple(q.shape)}")
    d = q.shape[-1]
    if latent_cache.shape[-1] != d:
        raise ValueError(
            f"latent_cache rows have {latent_cache.shape[-1]} dims but q has {d}; both must be the "
            "absorbed [latent | rope] width (576 for DeepSeek)"
        )
    if latent_cache.dim() not in (2, 3, 4) or (latent_cache.dim() == 4 and latent_cache.shape[2] != 1):
        raise ValueError(
            f"latent_cache must be [S, Dqk], [S, 1, Dqk], [num_blocks, block_size, Dqk] or "
            f"[num_blocks, block_size, 1, Dqk] (one latent head); got shape {tuple(latent_cache.shape)}"
        )
    cache = latent_cache.reshape(-1, d)  # [S, Dqk]: flat rows / slots
    checks.int_tensor("indices", indices, dims=2, desc=f"[T={q.shape[0]}, K]")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be an integer tensor [T={q.shape[0]}, K]; got {indices.dtype} {tuple(indices.shape)}")
    value_dim = checks.integer("value_dim", value_dim)
    if not 0 < value_dim <= d:
        raise ValueError(f"value_dim must be in 1..{d}; got {value_dim}")
    if softmax_scale is None or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be the model's positive scale; got {softmax_scale}")
    rows = cache.shape[0]
    checks.within("indices", indices, -1, rows,
                  expected=f"-1 (no key) or a row of latent_cache in 0..{rows - 1} ({rows} rows)",
                  fix="For a paged cache a row is block_id * block_size + offset")
    return torch.ops.cpattn.sparse_mla_attention_with_lse(q, cache, indices, float(softmax_scale), int(value_dim))


# --------------------------------------------------------------------------- helpers
def causal_key_ranges(
    cu_seqlens_q: torch.Tensor | list[int], cu_seqlens_k: torch.Tensor | list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key map of a packed causal batch (bottom-right aligned, as attention_with_lse).

    Request b's queries ``q[cu_q[b]:cu_q[b+1]]`` have keys
    ``k[cu_k[b]:cu_k[b+1]]``; query i of ``Lq`` sees keys ``0 .. Lk - Lq + i``.

    Returns key_start [T] and visible [T] (int64) for :func:`indexer_scores`.
    Both lists must hold integers, >= 0 and non-decreasing, with B+1 entries each.

    Example
    -------
    >>> from cpattn.ops.dsa import causal_key_ranges
    >>> [x.tolist() for x in causal_key_ranges([0, 2], [0, 5])]
    [[0, 0], [4, 5]]
    """
    cq = checks.int_list("cu_seqlens_q", cu_seqlens_q)
    ck = checks.int_list("cu_seqlens_k", cu_seqlens_k)
    checks.cumulative("cu_seqlens_q", cq, start_zero=False)
    checks.cumulative("cu_seqlens_k", ck, start_zero=False)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries, cu_seqlens_k {len(ck)}; both must be [B+1]")
    cq_t, ck_t = torch.tensor(cq, dtype=torch.int64), torch.tensor(ck, dtype=torch.int64)
    lq, lk = cq_t.diff(), ck_t.diff()  # [B]
    req = torch.repeat_interleave(torch.arange(lq.numel()), lq)  # [T] request of each query
    i = torch.arange(int(cq_t[-1]) - cq[0]) + cq[0] - cq_t[:-1][req]  # [T] index inside the request
    vis = torch.minimum((lk - lq)[req] + i + 1, lk[req]).clamp(min=0)
    return ck_t[:-1][req], vis


def mla_softmax_scale(qk_head_dim: int, rope_factor: float | None = None, mscale_all_dim: float | None = None) -> float:
    """The MLA/DSA softmax scale: ``qk_head_dim**-0.5``, times ``mscale**2`` under YaRN.

    ``mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`` when
    ``rope_factor > 1`` and ``mscale_all_dim`` is set. DeepSeek-V3.2:
    ``qk_head_dim = 192`` (128 nope + 64 rope), factor 40, mscale_all_dim 1.0.
    Never ``576**-0.5``: the absorbed width is not the model's head dim.

    Example
    -------
    >>> from cpattn.ops.dsa import mla_softmax_scale
    >>> round(mla_softmax_scale(192, 40, 1.0), 6)
    0.135234
    """
    scale = qk_head_dim**-0.5
    if rope_factor is not None and rope_factor > 1 and mscale_all_dim:
        m = 0.1 * mscale_all_dim * math.log(rope_factor) + 1.0
        scale *= m * m
    return scale


def fp8_index_cache(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 indexer key cache as DeepSeek-V3.2 keeps it: e4m3 keys and one fp32 scale per key.

    k: [S, D_I] (D_I = 128: one scale per 128-element block is one per key).
    Returns (k8 [S, D_I] float8_e4m3fn, k_scale [S] float32), ``k ~= k8 * k_scale``;
    pass both to :func:`indexer_scores` (``k=k8, k_scale=k_scale``). 1 + 4/D_I
    bytes per element instead of 2 (bf16).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import fp8_index_cache, indexer_scores
    >>> k8, s = fp8_index_cache(torch.randn(6, 16))
    >>> k8.dtype, s.shape
    (torch.float8_e4m3fn, torch.Size([6]))
    >>> q, w = torch.randn(1, 4, 16), torch.rand(1, 4)
    >>> one = torch.zeros(1, dtype=torch.long)
    >>> indexer_scores(q, w, k8, one, one + 6, k_scale=s).shape
    torch.Size([1, 6])
    """
    if k.dim() != 2:
        raise ValueError(f"k must be [S, D_I] indexer keys; got shape {tuple(k.shape)}")
    return fp8_quantize(k)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric float8 e4m3 quantization with one scale per row of the last dim.

    x: [..., D] -> (x8 [..., D] float8_e4m3fn, scale [...] float32) with
    ``x ~= x8.float() * scale[..., None]`` (scale = amax / 448).
    """
    amax = x.float().abs().amax(-1).clamp(min=1e-12)  # [...]
    scale = amax / 448.0
    x8 = (x.float() / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x8, scale


def selection_mismatch(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How two top-k selections ``[T, k]`` (``-1`` padded) differ, ignoring order.

    Returns ``{"rows_differ": fraction of rows whose sets differ,
    "recall": mean |a & b| / |b| over rows with a non-empty b}``.
    """
    if a.shape != b.shape:
        raise ValueError(f"selections differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    sa, sb = a.long().sort(-1).values, b.long().sort(-1).values
    differ = (sa != sb).any(-1)
    hits = ((a.long()[:, :, None] == b.long()[:, None, :]) & (b.long()[:, None, :] >= 0)).any(-1).sum(-1)
    n_b = (b >= 0).sum(-1)
    live = n_b > 0
    recall = (hits[live].double() / n_b[live].double()).mean().item() if live.any() else 1.0
    return {"rows_differ": differ.double().mean().item() if a.shape[0] else 0.0, "recall": recall}


def _check_indexer(q, w, k, key_start, visible) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H_I, D_I]; got shape {tuple(q.shape)}")
    if w.shape != q.shape[:2]:
        raise ValueError(f"w must be [T, H_I] = {tuple(q.shape[:2])}; got {tuple(w.shape)}")
    if k.dim() != 2 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [S, D_I={q.shape[-1]}] (one indexer key per token); got {tuple(k.shape)}")
    for name, x in (("key_start", key_start), ("visible", visible)):
        checks.int_tensor(name, x, (q.shape[0],), desc=f"[T={q.shape[0]}]")
