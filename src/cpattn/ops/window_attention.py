"""``window_attention_with_lse``: sliding-window attention over a paged ring buffer, with sinks.

A sliding-window layer (DeepSeek-V4: the last 128 tokens) needs only the
last few keys of each request, so they live in a ring: position p is kept in
ring slot ``p % R`` (``R = block_table.shape[1] * block_size``), and slot s in
block ``block_table[b, s // block_size]`` at offset ``s % block_size``. Row t
of request ``req_indices[t]`` attends the positions ``[kv_starts[t],
kv_ends[t])`` (negative positions are skipped; ``kv_ends - kv_starts <= R``)::

    window 4, ring R = 6, a query at position 9 (start 6, end 10)
    position     4 5 6 7 8 9
    ring slot    4 5 0 1 2 3
    visible      . . 1 1 1 1

With ``sinks`` [Hq] (DeepSeek-V4, gpt-oss), head h's softmax has one more
logit ``sinks[h]`` whose value is zero: the result is the merge of the
window's partial with the partial ``(out 0, lse sinks[h])``, and the
returned LSE includes it. That partial must enter a row's merges exactly
once (see :mod:`cpattn.v4.attention` for the rule). Padding rows
(``req_indices < 0``) get ``(0, -inf)`` with or without sinks; a live row
with no visible key and a sink gets ``(0, sink)``.

The CPU kernel works in row chunks; float64 inputs stay in float64. A
chunk of one request's rows whose ranges together span at most the ring
(a prefill's consecutive queries, a request's 1 + k decode rows) gathers
the union of their ranges once and masks each row to its band (``W``
times fewer rows gathered for a long chunk); other chunks, and any chunk
whose union holds a non-finite key or value, gather each row's own keys.
Under torch.compile on CPU the per-row gather at the ring's static width
is the op's decomposition (no host sync). Slots outside a row's range are
never read into a result (NaN there is harmless).
"""

from __future__ import annotations

import torch

from cpattn.ops import checks, registry
from cpattn.ops.ref import acc_dtype

# elements gathered per chunk of rows by the CPU kernel (rows x keys x kv heads x head dim)
CHUNK_ELEMS = 1 << 20


def window_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_indices: torch.Tensor, kv_starts: torch.Tensor, kv_ends: torch.Tensor, softmax_scale: float,
    sinks: torch.Tensor | None, width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on rows whose ranges hold at most ``width`` positions: one gather, two matmuls.

    Shapes as :func:`window_attention_with_lse`. No host sync: ``width`` is
    static (the kernel passes the widest range, the decomposition the ring).
    """
    acc = acc_dtype(q.dtype)
    t, hq, dk = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dv, g = v_cache.shape[-1], hq // hkv
    ring = block_table.shape[1] * bs
    pos = kv_starts.long()[:, None] + torch.arange(width, device=q.device)  # [T, Wd]
    live = req_indices >= 0  # [T]
    seen = (pos >= 0) & (pos < kv_ends.long()[:, None]) & live[:, None]  # [T, Wd]
    slot = pos.clamp(min=0) % ring
    blocks = block_table[req_indices.long().clamp(min=0)].long()  # [T, n]
    blk = blocks.gather(1, torch.div(slot, bs, rounding_mode="floor"))  # [T, Wd]
    seen = seen & (blk >= 0)
    flat = blk.clamp(0, nb - 1) * bs + slot % bs  # [T, Wd]
    k = k_cache.reshape(-1, hkv, dk)[flat].to(acc)  # [T, Wd, Hkv, Dk]
    v = v_cache.reshape(-1, hkv, dv)[flat].to(acc)  # [T, Wd, Hkv, Dv]
    k = torch.where(seen[..., None, None], k, 0.0)  # unseen slots may hold NaN
    v = torch.where(seen[..., None, None], v, 0.0)
    s = torch.einsum("tkgd,tlkd->tkgl", q.to(acc).view(t, hkv, g, dk), k) * softmax_scale  # [T, Hkv, G, Wd]
    s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1).reshape(t, hq)  # [T, Hq]
    if sinks is not None:  # one more logit per head, value 0; padding rows stay (0, -inf)
        lse = torch.where(live[:, None], torch.logaddexp(lse, sinks.to(acc)[None, :]), lse)
    fin = torch.isfinite(lse)
    p = torch.exp(s - torch.where(fin, lse, 0.0).view(t, hkv, g, 1))  # [T, Hkv, G, Wd]
    out = torch.einsum("tkgl,tlkd->tkgd", p, v).reshape(t, hq, dv)
    out = torch.where(fin[..., None] | torch.isnan(lse)[..., None], out, 0.0)
    return out.to(q.dtype), lse


def band_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, req: int,
    kv_starts: torch.Tensor, kv_ends: torch.Tensor, softmax_scale: float, sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The op on rows of one live request ``req`` whose ranges' union spans at most the ring: one gather of
    the union, each row masked to its own band. None when the union holds a non-finite key or value or an
    unallocated block (the per-row path then keeps NaN to the rows that see it). Host reads: CPU kernel only.
    """
    acc = acc_dtype(q.dtype)
    t, hq, dk = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dv, g = v_cache.shape[-1], hq // hkv
    ring = block_table.shape[1] * bs
    lo, hi = int(kv_starts.min()), int(kv_ends.max())
    pos = torch.arange(lo, max(hi, lo), device=q.device)  # [U] the union of the rows' ranges
    slot = pos % ring
    blk = block_table[req].long()[torch.div(slot, bs, rounding_mode="floor")]  # [U]
    if bool((blk < 0).any()) or bool((blk >= nb).any()):
        return None
    flat = blk * bs + slot % bs
    k = k_cache.reshape(-1, hkv, dk)[flat].to(acc)  # [U, Hkv, Dk]
    v = v_cache.reshape(-1, hkv, dv)[flat].to(acc)  # [U, Hkv, Dv]
    if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        return None
    seen = (pos[None, :] >= kv_starts.long()[:, None]) & (pos[None, :] < kv_ends.long()[:, None])  # [T, U]
    s = torch.einsum("tkgd,lkd->tkgl", q.to(acc).view(t, hkv, g, dk), k) * softmax_scale  # [T, Hkv, G, U]
    s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1).reshape(t, hq)  # [T, Hq]
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(acc)[None, :])
    fin = torch.isfinite(lse)
    p = torch.exp(s - torch.where(fin, lse, 0.0).view(t, hkv, g, 1))
    out = torch.einsum("tkgl,lkd->tkgd", p, v).reshape(t, hq, dv)
    out = torch.where(fin[..., None], out, 0.0)
    return out.to(q.dtype), lse


@registry.define("window_attention_with_lse")
def _window_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_indices: torch.Tensor, kv_starts: torch.Tensor, kv_ends: torch.Tensor, softmax_scale: float,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("window_attention_with_lse", q)


@registry.fake("window_attention_with_lse")
def _window_fake(q, k_cache, v_cache, block_table, req_indices, kv_starts, kv_ends, softmax_scale, sinks):
    t, hq, _ = q.shape
    return q.new_empty(t, hq, v_cache.shape[-1]), q.new_empty(t, hq, dtype=acc_dtype(q.dtype))


@registry.kernel("window_attention_with_lse", "cpu")
def _window_cpu(q, k_cache, v_cache, block_table, req_indices, kv_starts, kv_ends, softmax_scale, sinks):
    t, hq, _ = q.shape
    ring = block_table.shape[1] * k_cache.shape[1]
    span = (kv_ends.long() - kv_starts.long().clamp(min=0)).clamp(min=0)
    width = int(span.max()) if t else 0  # host sync: fine inside a CPU kernel
    if width > ring:
        r = int(span.argmax())
        raise ValueError(
            f"row {r} attends {width} positions but the ring holds {ring} (block_table width x block_size); "
            "a row's range must fit in the ring"
        )
    out = q.new_empty(t, hq, v_cache.shape[-1])
    lse = torch.empty(t, hq, dtype=acc_dtype(q.dtype), device=q.device)
    row = max(width, 1) * k_cache.shape[2] * max(k_cache.shape[3], v_cache.shape[3])
    step = max(1, CHUNK_ELEMS // row)
    starts = kv_starts.long().clamp(min=0)  # gather from the first non-negative position
    ends = torch.maximum(kv_ends.long(), starts)  # an empty range stays empty
    band = max(step, width)  # rows per chunk of the band path: the union then spans at most 2 x width
    for a in range(0, t, band):
        b = min(a + band, t)
        reqs = req_indices[a:b]
        one_req = bool((reqs == reqs[0]).all()) and int(reqs[0]) >= 0
        if one_req and int(ends[a:b].max()) - int(starts[a:b].min()) <= ring:
            got = band_rows(q[a:b], k_cache, v_cache, block_table, int(reqs[0]), starts[a:b], ends[a:b],
                            softmax_scale, sinks)
            if got is not None:
                out[a:b], lse[a:b] = got
                continue
        for c in range(a, b, step):
            d = min(c + step, b)
            out[c:d], lse[c:d] = window_rows(q[c:d], k_cache, v_cache, block_table, req_indices[c:d], starts[c:d],
                                             kv_ends[c:d], softmax_scale, sinks, width)
    return out, lse


@registry.decomposition("window_attention_with_lse")
def _window_traced(q, k_cache, v_cache, block_table, req_indices, kv_starts, kv_ends, softmax_scale, sinks):
    # every row gathers the whole ring width: static shapes, no host sync
    ring = block_table.shape[1] * k_cache.shape[1]
    return window_rows(q, k_cache, v_cache, block_table, req_indices, kv_starts.clamp(min=0), kv_ends,
                       softmax_scale, sinks, ring)


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("window_attention_with_lse", "cuda")
    def _window_cuda(q, k_cache, v_cache, block_table, req_indices, kv_starts, kv_ends, softmax_scale, sinks):
        ring = block_table.shape[1] * k_cache.shape[1]
        return window_rows(q, k_cache, v_cache, block_table, req_indices, kv_starts.clamp(min=0), kv_ends,
                           softmax_scale, sinks, ring)


def window_attention_with_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_ends: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over position ranges of a paged ring buffer, with optional sinks.

    Arguments
    ---------
    q: [T, Hq, Dk] -- query rows of any number of requests.
    k_cache: [NB, BS, Hkv, Dk]; v_cache: [NB, BS, Hkv, Dv] -- the rings (may be
        the same tensor: DeepSeek-V4's K = V head). Query head h reads kv head
        ``h // (Hq // Hkv)``.
    block_table: [B, n] int -- request b's ring is ``n * BS`` slots; position p
        is in slot ``p % (n * BS)``.
    req_indices: [T] int -- request of each row; < 0 marks a padding row.
    kv_starts, kv_ends: [T] int -- row t attends positions ``[max(0, start), end)``
        (a sliding window of W: ``start = pos - W + 1``, ``end = pos + 1``).
    softmax_scale: defaults to ``Dk ** -0.5``.
    sinks: [Hq] float or None -- per-head attention-sink logits (see module doc).

    Returns
    -------
    out: [T, Hq, Dv] in q's dtype; lse: [T, Hq] float32 (float64 for float64 q),
    the sink included. Rows that see nothing (and have no sink) get (0, -inf).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.window_attention import window_attention_with_lse
    >>> ring = torch.randn(2, 4, 1, 8)  # one request, ring of 8 slots
    >>> q = torch.randn(2, 2, 8)
    >>> pos = torch.tensor([9, 10])  # window 4: positions 6..9 and 7..10
    >>> out, lse = window_attention_with_lse(q, ring, ring, torch.tensor([[1, 0]]), torch.tensor([0, 0]),
    ...                                      pos - 3, pos + 1, sinks=torch.zeros(2))
    >>> out.shape, lse.shape
    (torch.Size([2, 2, 8]), torch.Size([2, 2]))
    """
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, Hq, Dk] tensor; got {q.dtype} {tuple(q.shape)}")
    checks.same_device("q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, req_indices=req_indices,
                       kv_starts=kv_starts, kv_ends=kv_ends, sinks=sinks)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.dtype != q.dtype:
            raise ValueError(f"{name} must be [NB, BS, Hkv, D] in q's dtype {q.dtype}; got {c.dtype} {tuple(c.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must share [NB, BS, Hkv] and "
            f"k_cache's head dim must equal q's ({q.shape[-1]})"
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if block_table.dim() != 2 or block_table.is_floating_point():
        raise ValueError(
            f"block_table must be an int [B, n] tensor; got {block_table.dtype} {tuple(block_table.shape)}"
        )
    for name, x in (("req_indices", req_indices), ("kv_starts", kv_starts), ("kv_ends", kv_ends)):
        if x.shape != (q.shape[0],) or x.is_floating_point():
            raise ValueError(f"{name} must be an int [T={q.shape[0]}] tensor; got {x.dtype} {tuple(x.shape)}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float [Hq={q.shape[1]}] tensor; got {sinks.dtype} {tuple(sinks.shape)}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return registry.call("window_attention_with_lse", q, k_cache, v_cache, block_table, req_indices, kv_starts,
                         kv_ends, scale, sinks)
