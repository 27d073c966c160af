"""Paged attention: ``paged_attention_with_lse`` (the writes are in :mod:`cpattn.ops.rows`).

Cache layout (DESIGN.md §3): ``[num_blocks, block_size, Hkv, D]``; a request's
local token i lives in block ``block_table[b, i // block_size]`` at offset
``i % block_size``; a slot is ``block * block_size + offset``.

``paged_attention_with_lse`` takes, per query row t, its request
``req_indices[t]`` and how many local keys it sees, ``kv_lens[t]``. That one
form covers decode, speculative decoding and chunked prefill under DCP, where
query j at absolute position p sees the local keys with index
``< local_len(p + 1, rank)`` -- not a shifted causal mask::

    N = 2, I = 1, q_len = 3 at positions 4, 5, 6 (rank 0 holds 0 2 4 6)
    local key      0 1 2 3
    q @ 4          1 1 1 0       local_len(5, 0) = 3
    q @ 5          1 1 1 0       local_len(6, 0) = 3
    q @ 6          1 1 1 1       local_len(7, 0) = 4

All shapes are static (T rows, a fixed block table), so the op can sit in a
captured graph. The CPU kernel walks each request's blocks in chunks of about
a megabyte, gathers a chunk, runs aten's CPU flash kernel on it with the GQA
query heads folded into the query dim (one pass over each KV head serves all
its query heads), and merges the chunk partials by LSE in float32. Small
batches (few visible keys per row, ``SMALL_ELEMS`` / ``SMALL_ROW_ELEMS``)
instead gather every row's keys at once and run two batched matmuls; under
torch.compile on CPU that path, at the block table's static width, is the
op's decomposition. float64 inputs, and devices without a fused kernel, run
the plain reference of :mod:`cpattn.ops.paged_ref`. A masked chunk whose
hidden keys hold a non-finite value, and a short chunk with non-finite
inputs, run exact masked math instead of the fused kernel, which would leak
or hide that NaN (docs/exactness.md).
"""

from __future__ import annotations

import torch

from cpattn.ops import checks, ref, registry
from cpattn.ops.attention import FLASH_MIN_KEYS
from cpattn.ops.paged_ref import paged_attention_ref

# Elements of K gathered per chunk by the CPU kernel (~1 MiB in float32):
# large enough to amortise the call, small enough to stay in cache.
CHUNK_ELEMS = 1 << 18
# Chunk partials are merged into the running state this many at a time.
MERGE_EVERY = 32
# The batched small path (one gather, two matmuls) beats the per-request flash loop only while the
# gathered keys stay small (`cpattn bench paged` measures the crossover): at most SMALL_ELEMS
# elements in all (rows x keys x kv heads x head dim) and SMALL_ROW_ELEMS per query row.
SMALL_ELEMS = 1 << 20
SMALL_ROW_ELEMS = 1 << 16


# ------------------------------------------------------------- paged_attention_with_lse
@registry.define("paged_attention_with_lse")
def _paged_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("paged_attention_with_lse", q)


@registry.fake("paged_attention_with_lse")
def _paged_fake(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale):
    t, hq, _ = q.shape
    lse_dtype = ref.acc_dtype(q)
    return q.new_empty(t, hq, v_cache.shape[-1]), q.new_empty(t, hq, dtype=lse_dtype)


def _is_prefix_view(v: torch.Tensor, k: torch.Tensor) -> bool:
    """True when v is k[..., :Dv] (the MLA latent cache): gather once, read values from it."""
    return (
        v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1] and v.dtype == k.dtype
    )


def _runs(reqs: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal request ids: [(row_start, row_end, req)]."""
    runs, start = [], 0
    for i in range(1, len(reqs) + 1):
        if i == len(reqs) or reqs[i] != reqs[start]:
            runs.append((start, i, reqs[start]))
            start = i
    return runs


def _flash(q, k, v, mask, scale):
    """aten CPU flash attention on [1, H, L, D] views; mask [L_q, L_k] additive or None."""
    attn_mask = None if mask is None else mask[None, None]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=attn_mask, scale=scale
    )


def _paged_request(q, k_cache, v_cache, blocks, row_lens, lmin, lmax, scale, shared_v):
    """One request's rows: q [nq, Hq, Dk] over its blocks -> out [nq, Hq, Dv] fp32, lse [nq, Hq] fp32."""
    nq, hq, dk = q.shape
    _, bs, hkv, _ = k_cache.shape
    dv, g = v_cache.shape[-1], hq // hkv
    # fold query heads of one kv head into the query dim: rows ordered (g, j)
    qf = q.view(nq, hkv, g, dk).permute(1, 2, 0, 3).reshape(1, hkv, g * nq, dk)  # [1, Hkv, G*nq, Dk]
    if dv > dk:  # the flash kernel wants one head dim: pad q and k (scores unchanged)
        qf = torch.nn.functional.pad(qf, (0, dv - dk))
    lens_f = row_lens.repeat(g)  # [G*nq], matches the (g, j) row order
    chunk = max(bs, CHUNK_ELEMS // (hkv * dk) // bs * bs)
    state_o = state_l = None
    parts_o, parts_l = [], []
    for c0 in range(0, lmax, chunk):
        c1 = min(c0 + chunk, lmax)
        ids = blocks[c0 // bs : (c1 + bs - 1) // bs]
        kc = k_cache.index_select(0, ids).flatten(0, 1)[: c1 - c0]  # [Lc, Hkv, Dk]
        if shared_v:
            vc = kc  # MLA: the values are the first Dv dims of the latent
        else:
            vc = v_cache.index_select(0, ids).flatten(0, 1)[: c1 - c0]  # [Lc, Hkv, Dv]
            if dv < dk:
                vc = torch.nn.functional.pad(vc, (0, dk - dv))
        if dv > dk:
            kc = torch.nn.functional.pad(kc, (0, dv - dk))
        k4, v4 = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]  # [1, Hkv, Lc, D]
        # the fused kernel is exact on finite data; it hides an all-NaN row of a short chunk, and leaks a
        # key hidden by the mask into the row (-inf + NaN, 0 * NaN): such chunks run exact masked math
        short = c1 - c0 < FLASH_MIN_KEYS and not checks.all_finite(qf, kc)
        if c1 <= lmin:  # every row sees the whole chunk
            if short:
                every = torch.ones(qf.shape[2], c1 - c0, dtype=torch.bool, device=q.device)  # [G*nq, Lc]
                o, l = _masked_exact(qf, k4, v4, every, scale)
            else:
                o, l = _flash(qf, k4, v4, None, scale)
        else:
            key = torch.arange(c0, c1, device=q.device)  # [Lc]
            seen = key[None, :] < lens_f[:, None]  # [G*nq, Lc]
            hid = max(lmin - c0, 0)  # keys from here on are hidden from some row
            if short or not checks.all_finite(kc[hid:], vc[hid:]):
                o, l = _masked_exact(qf, k4, v4, seen, scale)
            else:
                zero = torch.zeros((), dtype=qf.dtype, device=q.device)
                mask = torch.where(seen, zero, torch.full_like(zero, float("-inf")))
                o, l = _flash(qf, k4, v4, mask, scale)
            some = seen.any(dim=1)  # [G*nq]: a row that sees nothing here is an empty partial
            l = torch.where(some, l, float("-inf"))
            o = torch.where(some[:, None], o, 0.0)
        parts_o.append(o[0, ..., :dv].float())  # [Hkv, G*nq, Dv]
        parts_l.append(l[0].float())  # [Hkv, G*nq]
        if len(parts_o) >= MERGE_EVERY:
            state_o, state_l = _fold(state_o, state_l, parts_o, parts_l)
    state_o, state_l = _fold(state_o, state_l, parts_o, parts_l)
    out = state_o.view(hkv, g, nq, dv).permute(2, 0, 1, 3).reshape(nq, hq, dv)  # [nq, Hq, Dv]
    lse = state_l.view(hkv, g, nq).permute(2, 0, 1).reshape(nq, hq)  # [nq, Hq]
    return out, lse


def _masked_exact(qf, k4, v4, seen, scale):
    """Masked attention without the fused kernel: q [1, H, R, D], k/v [1, H, Lc, D], seen [R, Lc].

    A hidden key's score is replaced by -inf and its value by 0 per row, so
    NaN or inf there never reaches the row; a visible one reaches it as in
    the float64 oracle. Rows go in batches to bound the [H, rows, Lc, D]
    value buffer. Returns out [1, H, R, D] and lse [1, H, R], float32.
    """
    _, h, r, d = qf.shape
    lc = k4.shape[2]
    k, v = k4[0].float(), v4[0].float()  # [H, Lc, D]
    step = max(1, CHUNK_ELEMS * 4 // max(1, h * lc * d))
    outs, lses = [], []
    for a in range(0, r, step):
        b = min(a + step, r)
        vis = seen[a:b]  # [n, Lc]
        s = torch.matmul(qf[0, :, a:b].float(), k.transpose(1, 2)) * scale  # [H, n, Lc]
        s = s.masked_fill(~vis, float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [H, n]
        p = torch.exp(s - torch.where(l != float("-inf"), l, 0.0)[..., None])  # [H, n, Lc]
        vv = torch.where(vis[None, :, :, None], v[:, None], 0.0)  # [H, n, Lc, D]
        outs.append(torch.einsum("hnl,hnld->hnd", p, vv))
        lses.append(l)
    return torch.cat(outs, dim=1)[None], torch.cat(lses, dim=1)[None]


def _fold(state_o, state_l, parts_o, parts_l):
    """Merge buffered chunk partials (and the running state) into a new state; empties the buffers."""
    if state_o is not None:
        parts_o.insert(0, state_o)
        parts_l.insert(0, state_l)
    o, l = ref.merge(torch.stack(parts_o), torch.stack(parts_l))
    parts_o.clear()
    parts_l.clear()
    return o, l


def _paged_small(q, k_cache, v_cache, block_table, req_indices, kv_lens, scale, n_blk=None):
    """Every row at once: gather each row's first ``n_blk`` blocks, two batched matmuls.

    q [T, Hq, Dk] -> out [T, Hq, Dv] (q's dtype), lse [T, Hq] float32. For
    decode-sized batches, where per-call overhead dominates; keys past a
    row's kv_len are masked (NaN there never reaches the result). ``n_blk``
    None reads ``max(kv_lens)`` on the host (the eager kernel); an int keeps
    every shape static (the traced decomposition passes the table's width).
    """
    t, hq, dk = q.shape
    _, bs, hkv, _ = k_cache.shape
    dv, g = v_cache.shape[-1], hq // hkv
    if n_blk is None:
        n_blk = -(-int(kv_lens.max()) // bs) if t else 0  # host sync: fine inside a CPU kernel
    length = n_blk * bs
    # unused table entries (-1, or any id past the cache) are clamped into range; their keys are masked
    blocks = block_table[req_indices.long().clamp(min=0), :n_blk].long().clamp(0, k_cache.shape[0] - 1)  # [T, n_blk]
    seen = (torch.arange(length, device=q.device) < kv_lens[:, None]) & (req_indices >= 0)[:, None]  # [T, L]
    k = k_cache[blocks].reshape(t, length, hkv, dk).permute(0, 2, 3, 1).float()  # [T, Hkv, Dk, L]
    v = v_cache[blocks].reshape(t, length, hkv, dv).transpose(1, 2).float()  # [T, Hkv, L, Dv]
    v = v.masked_fill(~seen[:, None, :, None], 0.0)  # unseen slots may hold NaN: 0 * NaN is NaN
    s = torch.matmul(q.view(t, hkv, g, dk).float(), k) * scale  # [T, Hkv, G, L]
    s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, Hkv, G]; -inf for a row that sees nothing
    p = torch.exp(s - torch.where(lse != float("-inf"), lse, 0.0)[..., None])  # 0 where unseen; NaN stays NaN
    out = torch.matmul(p, v)  # [T, Hkv, G, Dv]
    return out.reshape(t, hq, dv).to(q.dtype), lse.reshape(t, hq)


def _small(q, k_cache, v_cache, keys: int, per_row_limit: bool = True) -> bool:
    """True when every row gathering ``keys`` keys stays within the small-path limits (q not float64)."""
    row = keys * k_cache.shape[2] * max(k_cache.shape[3], v_cache.shape[3])  # elements one row gathers
    fits = q.shape[0] * row <= SMALL_ELEMS and (row <= SMALL_ROW_ELEMS or not per_row_limit)
    return q.dtype != torch.float64 and fits


def _traceable(q, k_cache, v_cache, block_table, *rest) -> bool:
    # in a compiled program every row gathers the table's whole width; inductor fuses the gather,
    # mask and softmax, so only the total size matters (`cpattn bench paged`)
    return _small(q, k_cache, v_cache, block_table.shape[1] * k_cache.shape[1], per_row_limit=False)


@registry.decomposition("paged_attention_with_lse", when=_traceable)
def _paged_traced(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale):
    # the small path over the whole block-table width: static shapes, no host sync, no validation
    return _paged_small(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale,
                        n_blk=block_table.shape[1])


@registry.kernel("paged_attention_with_lse", "cpu")
def _paged_cpu(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale):
    t, hq, _ = q.shape
    bs = k_cache.shape[1]
    addressable = block_table.shape[1] * bs  # keys one row of the block table can reach
    lmax = int(kv_lens.max()) if t else 0  # host sync: fine inside a CPU kernel
    if lmax > addressable:
        raise ValueError(
            f"kv_lens asks for {lmax} keys but a block_table row addresses only "
            f"{block_table.shape[1]} blocks x {bs}; widen the block table"
        )
    if q.dtype == torch.float64:  # the reference is the float64 kernel
        return paged_attention_ref(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale)
    n_blk = -(-lmax // bs)
    if _small(q, k_cache, v_cache, n_blk * bs):  # one batched gather + two matmuls beat the loop below
        return _paged_small(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale, n_blk=n_blk)
    dv = v_cache.shape[-1]
    out = q.new_zeros(t, hq, dv)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    shared_v = _is_prefix_view(v_cache, k_cache)
    reqs, lens = req_indices.tolist(), kv_lens.tolist()  # host work is fine inside a CPU kernel
    for r0, r1, b in _runs(reqs):
        run_lens = lens[r0:r1]
        lmax = max(run_lens)
        if b < 0 or lmax <= 0:
            continue  # padding rows / nothing visible: (0, -inf)
        blocks = block_table[b].long()
        if lmax > blocks.numel() * k_cache.shape[1]:
            raise ValueError(
                f"kv_lens asks for {lmax} keys of request {b} but its block_table row addresses only "
                f"{blocks.numel()} blocks x {k_cache.shape[1]}; widen the block table"
            )
        o, l = _paged_request(
            q[r0:r1], k_cache, v_cache, blocks, kv_lens[r0:r1].long(), max(min(run_lens), 0), lmax,
            softmax_scale, shared_v,
        )
        out[r0:r1], lse[r0:r1] = o.to(out.dtype), l
    return out, lse


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("paged_attention_with_lse", "cuda")
    def _paged_cuda(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale):
        # plain torch, no host sync (capturable); a fused paged kernel is the next step
        return paged_attention_ref(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale)


def paged_attention_with_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over a paged KV cache, with the log-sum-exp.

    Arguments
    ---------
    q: [T, Hq, Dk] -- query rows of any number of requests (several rows per
        request for speculative decoding or chunked prefill).
    k_cache: [num_blocks, block_size, Hkv, Dk]; v_cache: [num_blocks, block_size, Hkv, Dv]
        -- ``Hq % Hkv == 0``, query head h reads kv head ``h // (Hq // Hkv)``.
        For MLA pass the latent cache and its value view:
        ``k_cache = latent [.., 1, 576]``, ``v_cache = latent[..., :512]``.
    block_table: [B, max_blocks] int -- request b's local index i is in block
        ``block_table[b, i // block_size]``.
    req_indices: [T] int -- request of each row (< B); < 0 marks a padding row.
    kv_lens: [T] int -- row t sees local keys ``0 .. kv_lens[t]-1`` of its
        request (under DCP: ``local_len(position + 1, rank)``); at most
        ``max_blocks * block_size``. The blocks a row reads must be ids of
        this cache; table entries past them are never read (any value).
    softmax_scale: defaults to ``Dk ** -0.5`` (MLA callers pass the model's).

    Returns
    -------
    out: [T, Hq, Dv] in q's dtype; lse: [T, Hq] natural log, float32 (float64
    for float64 q). Rows that see no key get out 0, lse -inf. Cache slots past
    ``kv_lens`` (other ranks' tokens, unused blocks) are never read into a
    result; a NaN in a key or value a row sees makes that row (its heads
    reading that kv head) NaN, as on one device.

    Raises
    ------
    ValueError naming the first bad row: a request past the block table, a
    negative kv_len or one beyond the table, a read block outside the cache
    (value checks are skipped while tracing or capturing); a tensor on
    another device than q.

    Example
    -------
    >>> import torch
    >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    >>> q = torch.randn(3, 8, 64)
    >>> bt = torch.tensor([[2, 0], [3, 1]])
    >>> out, lse = paged_attention_with_lse(q, kc, vc, bt, torch.tensor([0, 0, 1]), torch.tensor([20, 21, 5]))
    >>> out.shape, lse.shape
    (torch.Size([3, 8, 64]), torch.Size([3, 8]))
    """
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, Hq, Dk] tensor; got {q.dtype} {tuple(q.shape)}")
    checks.same_device("q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, req_indices=req_indices,
                       kv_lens=kv_lens)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D]; got shape {tuple(c.shape)}")
        if c.dtype != q.dtype:
            raise ValueError(f"{name} dtype {c.dtype} differs from q's {q.dtype}; cast one of them")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share [blocks, block_size, Hkv]")
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != k_cache head_dim {k_cache.shape[-1]}; they must match")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]}) for GQA")
    checks.int_tensor("block_table", block_table, dims=2, desc="[B, max_blocks]")
    for name, x in (("req_indices", req_indices), ("kv_lens", kv_lens)):
        checks.int_tensor(name, x, (q.shape[0],), desc=f"[T={q.shape[0]}]")
    checks.paged_rows(block_table, req_indices, kv_lens, num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return registry.call("paged_attention_with_lse", q, k_cache, v_cache, block_table, req_indices, kv_lens, scale)
