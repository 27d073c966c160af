"""``attention_with_lse``: packed variable-length attention returning the LSE.

Causal masks are bottom-right aligned. With ``Lq = 3`` new queries after
``Lk - Lq = 2`` earlier keys (1 = visible)::

        keys  0 1 2 3 4
    q0        1 1 1 0 0
    q1        1 1 1 1 0
    q2        1 1 1 1 1

Every kernel splits a causal request into an unmasked prefix block (keys
``0 .. Lk-Lq-1``) and a causal diagonal block (the last ``Lq`` keys), and
merges the two by LSE; queries that precede every key (``Lq > Lk``) see
nothing and get ``(0, -inf)``. The dense block is the device's fused kernel
(aten's CPU flash attention) or the plain reference of :mod:`cpattn.ops.ref`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpattn.ops import checks, ref, registry
from cpattn.ops.merge import merge_into

Block = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


@registry.define("attention_with_lse")
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("attention_with_lse", q)


@registry.fake("attention_with_lse")
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    t, hq, _ = q.shape
    lse_dtype = ref.acc_dtype(q)
    return q.new_empty(t, hq, v.shape[-1]), q.new_empty(t, hq, dtype=lse_dtype)


# aten's CPU flash kernel handles keys below its vector width in a scalar loop whose max ignores NaN:
# a row whose scores are all NaN (a NaN query, or only NaN keys) comes back as out 0, lse 0 when the
# block has fewer keys than that width (8 floats with AVX2). Blocks this short with a non-finite query
# or key run the plain reference instead (cheap: the block is tiny).
FLASH_MIN_KEYS = 32


def _flash_cpu_block(q, k, v, causal, scale):
    """Dense block on aten's CPU flash kernel. q [Hq,Lq,D], k/v [Hkv,Lk,D*] -> ([Hq,Lq,Dv], [Hq,Lq]).

    Unmasked GQA blocks fold each kv head's query heads into its rows, so the
    kernel reads every key once per kv head instead of once per query head
    (3-6x faster for decode, measured; the head order h = j*g + i is kept).
    """
    if k.shape[1] < FLASH_MIN_KEYS and not checks.all_finite(q, k):
        return ref.dense_block(q, k, v, causal, scale)
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:  # the kernel wants one head dim: pad values (MLA: 512 -> 576)
        v = torch.nn.functional.pad(v, (0, dqk - dv))
    elif dv > dqk:  # pad q and k with zeros: scores unchanged
        q = torch.nn.functional.pad(q, (0, dv - dqk))
        k = torch.nn.functional.pad(k, (0, dv - dqk))
    hq, lq, hkv = q.shape[0], q.shape[1], k.shape[0]
    fold = not causal and hq != hkv  # GQA: the g query heads of a kv head become g*Lq rows of one head
    if fold:
        q = q.reshape(hkv, (hq // hkv) * lq, q.shape[-1])  # [Hkv, g*Lq, D]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale
    )
    out, lse = out[0, ..., :dv], lse[0]  # [H, L, Dv], [H, L]
    if fold:
        out, lse = out.reshape(hq, lq, dv), lse.reshape(hq, lq)
    return out, lse


def varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    block: Block,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen attention on top of a dense ``block`` kernel (see module doc).

    q: [Tq, Hq, Dqk]; k: [Tk, Hkv, Dqk]; v: [Tk, Hkv, Dv];
    cu_seqlens_q / cu_seqlens_k: [B+1]. Returns out [Tq, Hq, Dv] (q's dtype)
    and lse [Tq, Hq] (float32; float64 for float64 inputs). Validates the
    cu_seqlens values before any block runs (it reads them on the host anyway).
    """
    tq, hq, _ = q.shape
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries, cu_seqlens_k has {len(ck)}; both must be [B+1]")
    checks.cumulative("cu_seqlens_q", cq, total=tq, of=f"q has {tq} tokens", start_zero=False)
    checks.cumulative("cu_seqlens_k", ck, total=k.shape[0], of=f"k has {k.shape[0]} tokens", start_zero=False)
    out = q.new_empty(tq, hq, v.shape[-1])  # rows no block writes are set to (0, -inf) below
    lse_dtype = ref.acc_dtype(q)
    lse = torch.empty((tq, hq), dtype=lse_dtype, device=q.device)
    written = 0  # rows [0, written) are final
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        hidden = max(lq - lk, 0) if causal else 0  # rows that precede every key
        if lq - hidden == 0 or lk == 0:
            hidden = lq
        _empty_rows(out, lse, written, q0 + hidden)  # gaps before, and rows that see no key
        written = q1
        if hidden == lq:
            continue
        qb = q[q0 + hidden : q1].transpose(0, 1)  # [Hq, Lq', D]
        kb, vb = k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)  # [Hkv, Lk, D]
        if not causal or qb.shape[1] == 1:  # one visible row sees every key: no mask needed
            o, l = block(qb, kb, vb, False, scale)
        else:
            o, l = _causal(qb, kb, vb, scale, block)
        out[q0 + hidden : q1] = o.transpose(0, 1).to(out.dtype)
        lse[q0 + hidden : q1] = l.transpose(0, 1).to(lse_dtype)
    _empty_rows(out, lse, written, tq)  # rows past cu_seqlens_q[-1]
    return out, lse


def _causal(qb, kb, vb, scale, block):
    """Row i of q [Hq, Lq, D] sees keys ``0 .. Lk-Lq+i`` of k/v [Hkv, Lk, D*] (Lq <= Lk) -> (o, l).

    A masked kernel still multiplies the zero weight of a key it hides by
    that key's value (0 * NaN = NaN), so a non-finite key or value inside
    the causal diagonal would reach rows that cannot see it. Rows are then
    cut at every such key: each slice's diagonal hides only finite keys.
    Costs one pass over the diagonal's keys and values (O(Lq), not O(Lq^2)).
    """
    lq = qb.shape[1]
    prefix = kb.shape[1] - lq  # keys every row sees
    kd, vd = kb[:, prefix:], vb[:, prefix:]  # [Hkv, Lq, D*]: the diagonal's keys
    # a finite sum per key proves every element of that key finite (NaN / inf would make it non-finite):
    # one cheap reduction instead of an elementwise isfinite over the whole diagonal
    if bool(torch.isfinite(kd.sum(dim=2).sum(dim=0) + vd.sum(dim=2).sum(dim=0)).all()):
        return _causal_rows(qb, kb, vb, scale, block)
    finite = torch.isfinite(kd).all(dim=2).all(dim=0) & torch.isfinite(vd).all(dim=2).all(dim=0)  # [Lq]
    if bool(finite.all()):  # the sum overflowed, not the data
        return _causal_rows(qb, kb, vb, scale, block)
    cuts = [0, *(i for i in (~finite).nonzero().view(-1).tolist() if i > 0), lq]
    parts = [_causal_rows(qb[:, a:b], kb[:, : prefix + b], vb[:, : prefix + b], scale, block)
             for a, b in zip(cuts, cuts[1:])]
    acc = ref.acc_dtype(qb.dtype)
    return torch.cat([o.to(acc) for o, _ in parts], dim=1), torch.cat([l.to(acc) for _, l in parts], dim=1)


def _causal_rows(qb, kb, vb, scale, block):
    """Causal diagonal block plus the unmasked prefix block, merged by LSE (see :func:`_causal`)."""
    lq = qb.shape[1]
    if lq == 1:
        return block(qb, kb, vb, False, scale)
    prefix = kb.shape[1] - lq
    o, l = block(qb, kb[:, prefix:], vb[:, prefix:], True, scale)
    if prefix > 0:
        op, lp = block(qb, kb[:, :prefix], vb[:, :prefix], False, scale)
        o, l = o.to(ref.acc_dtype(o.dtype)), l.to(ref.acc_dtype(o.dtype))
        merge_into(o, l, op, lp)
    return o, l


def _empty_rows(out: torch.Tensor, lse: torch.Tensor, start: int, stop: int) -> None:
    """Rows [start, stop) see no key: out 0, lse -inf."""
    if stop > start:
        out[start:stop] = 0
        lse[start:stop] = float("-inf")


@registry.kernel("attention_with_lse", "cpu")
def _attention_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    # float64 runs the plain reference; other dtypes the fused flash kernel
    block = ref.dense_block if q.dtype == torch.float64 else _flash_cpu_block
    return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, block)


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("attention_with_lse", "cuda")
    def _attention_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
        # cuBLAS matmuls in fp32 with an explicit mask; a fused varlen kernel
        # (flash-attn's varlen API) is the obvious next step.
        return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, ref.dense_block)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention that also returns the log-sum-exp.

    Arguments
    ---------
    q: [Tq, Hq, Dqk] -- queries of B requests, packed token-major.
    k: [Tk, Hkv, Dqk] -- keys; ``Hq % Hkv == 0``, query head h reads kv head
        ``h // (Hq // Hkv)`` (GQA/MQA).
    v: [Tk, Hkv, Dv] -- values; Dv may differ from Dqk (MLA: 576 vs 512).
    cu_seqlens_q, cu_seqlens_k: [B+1] int32/int64 -- request b owns
        ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and the matching keys.
    causal: bottom-right aligned mask (query i of Lq sees keys 0 .. Lk-Lq+i).
    softmax_scale: defaults to ``Dqk ** -0.5``.

    Returns
    -------
    out: [Tq, Hq, Dv] in q's dtype; lse: [Tq, Hq] natural log, float32
    (float64 for float64 inputs). A row with no visible key gets out 0 and
    lse -inf. A NaN in a key or value reaches exactly the rows that see that
    key (their heads reading its kv head), as in the float64 oracle; keys a
    row cannot see never reach it, whatever they hold.

    Raises
    ------
    ValueError naming the argument: cu_seqlens not integer, not ``[B+1]``,
    negative, decreasing, or ending past q's / k's tokens; mismatched shapes;
    a tensor on another device than q.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops import attention_with_lse
    >>> q, k, v = torch.randn(5, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    >>> cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
    >>> out, lse = attention_with_lse(q, k, v, cu_q, cu_k, causal=True)
    >>> out.shape, lse.shape
    (torch.Size([5, 4, 16]), torch.Size([5, 4]))
    """
    check_qkv(q, k, v)
    checks.same_device("q", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    # the values (monotone, within q / k) are checked by the kernel driver, which reads them anyway
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)} but cu_seqlens_k has "
            f"{tuple(cu_seqlens_k.shape)}; both must be [B+1] for the same B requests"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return torch.ops.cpattn.attention_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate packed q [Tq,Hq,Dqk], k [Tk,Hkv,Dqk], v [Tk,Hkv,Dv]; raise ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed [tokens, heads, head_dim]; got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [tokens, kv_heads]")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != k head_dim {k.shape[-1]}; they must match")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) for GQA"
        )


def check_cu_seqlens(name: str, cu: torch.Tensor) -> None:
    """Validate the shape and dtype of a ``[B+1]`` int32/int64 cumulative-length tensor (no host read)."""
    checks.cu_seqlens(name, cu, check_values=False)
