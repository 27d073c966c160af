"""The lightning indexer of DeepSeek Sparse Attention: ``indexer_scores`` (DESIGN.md §4.4).

``I[t, s] = sum_h w[t,h] * relu(q_I[t,h] . k_I[key_start[t] + s])`` in
float32 for ``s < visible[t]``, ``-inf`` elsewhere. Packed varlen batches
describe each query's keys by where its request's keys start in ``k_I`` and
how many of them it sees (causal: ``pos + 1``); see
:func:`causal_key_ranges`. DeepSeek-V3.2 folds ``H_I**-0.5 * D_I**-0.5`` into
``w``; positive constants never change the selection.

Optional FP8: ``indexer_scores(..., fp8=True)`` simulates the e4m3 indexer of
the reference design (per-token key scales, per-token-per-head query scales,
folded into ``w``); ``k_scale`` with a float8 key cache
(:func:`fp8_index_cache`) scores FP8 tiles directly. The plain reference is
:func:`cpattn.ops.dsa_ref.indexer_scores`.
"""

from __future__ import annotations

import torch

from cpattn.ops import checks, dsa_ref, ref, registry

# elements of one fp32 work buffer in the chunked CPU kernel (64 MiB)
CHUNK_ELEMS = 1 << 24
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
        step = max(1, min(_ROWS, CHUNK_ELEMS // (h * min(run_keys, _KEY_TILE))))
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
            tile = max(1, min(_KEY_TILE, CHUNK_ELEMS // (n * h)))
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


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("indexer_scores", "cuda")
    def _indexer_cuda(q, w, k, key_start, visible, max_keys):
        return dsa_ref.indexer_scores(q, w, k, key_start, visible, max_keys)

    @registry.kernel("indexer_scores_fp8", "cuda")
    def _indexer_fp8_cuda(q, w, k, k_scale, key_start, visible, max_keys):
        return dsa_ref.indexer_scores(q, w, k.float() * k_scale.float()[:, None], key_start, visible, max_keys)


# --------------------------------------------------------------------------- public
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
    checks.same_device("q", q, k_scale=k_scale)
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


def _check_indexer(q, w, k, key_start, visible) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H_I, D_I]; got shape {tuple(q.shape)}")
    if w.shape != q.shape[:2]:
        raise ValueError(f"w must be [T, H_I] = {tuple(q.shape[:2])}; got {tuple(w.shape)}")
    if k.dim() != 2 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [S, D_I={q.shape[-1]}] (one indexer key per token); got {tuple(k.shape)}")
    for name, x in (("key_start", key_start), ("visible", visible)):
        checks.int_tensor(name, x, (q.shape[0],), desc=f"[T={q.shape[0]}]")
    checks.same_device("q", q, w=w, k=k, key_start=key_start, visible=visible)
