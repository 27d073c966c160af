"""Plain reference math for the fast kernels: explicit mask, softmax over all keys.

Computed in float64 when the inputs are float64, else in float32. These are
the "ref.py" next to the fast paths: slow, obvious, and used by the CPU kernel
for float64 inputs and by anything that wants a second opinion.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request block with its log-sum-exp.

    Arguments
    ---------
    q: [Hq, Lq, Dqk]; k: [Hkv, Lk, Dqk]; v: [Hkv, Lk, Dv]; Hq % Hkv == 0 and
    query head h reads kv head ``h // (Hq // Hkv)``.
    causal: top-left aligned square mask (query i sees keys 0..i); callers
    pass ``Lq == Lk`` when causal.

    Returns
    -------
    out: [Hq, Lq, Dv] in q's dtype; lse: [Hq, Lq] float32 (float64 for float64
    inputs), ``-inf`` with ``out = 0`` for a row that sees no key.
    """
    acc = acc_dtype(q.dtype)
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    group = hq // hkv
    qf = q.to(acc)  # [Hq, Lq, D]
    kf = k.to(acc).repeat_interleave(group, dim=0)  # [Hq, Lk, D]
    vf = v.to(acc).repeat_interleave(group, dim=0)  # [Hq, Lk, Dv]
    s = torch.einsum("hqd,hkd->hqk", qf, kf) * scale  # [Hq, Lq, Lk]
    if causal:
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])  # [Hq, Lq, Lk]
    out = torch.einsum("hqk,hkd->hqd", p, vf)
    out = torch.where(finite[..., None], out, 0.0)
    lse = torch.where(finite, lse, float("-inf"))
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact n-way merge of partial attention over disjoint key sets.

    outs: [N, T, H, D]; lses: [N, T, H]. Returns out [T, H, D] (outs' dtype)
    and lse [T, H] (float32, float64 for float64 input). Max-subtracted form:
    ``L = m + log(sum_i exp(L_i - m))``, ``O = sum_i exp(L_i - L) O_i``.
    NaN and +inf LSEs count as -inf; all -inf gives (0, -inf).
    """
    acc = acc_dtype(lses.dtype if lses.dtype == torch.float64 else outs.dtype)
    w, total, lse = lse_weights(lses.to(acc))  # [N, T, H], [T, H], [T, H]
    parts = torch.where(w[..., None] > 0, outs.to(acc), 0.0)  # empty partials may hold garbage
    out = (w[..., None] * parts).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    return out.to(outs.dtype), lse.to(lse_dtype)


def lse_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LSE side of a merge: lses [N, ...] -> (w [N, ...], total [...], lse [...]).

    ``w_i = exp(L_i - m)`` with m the largest finite L_i, ``total = sum_i w_i``,
    ``lse = m + log(total)``. NaN and +inf count as -inf (w 0); where every
    partial is empty, total is 0 and lse -inf (never NaN).
    """
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lses - m)  # 0 where the partial is empty
    total = w.sum(dim=0)
    live = total > 0
    lse = torch.where(live, m + torch.log(torch.where(live, total, 1.0)), float("-inf"))
    return w, total, lse
