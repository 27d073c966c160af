"""Plain reference math for the fast kernels: explicit mask, softmax over all keys.

Computed in float64 when the inputs are float64, else in float32. These are
the "ref.py" next to the fast paths: slow, obvious, and used by the CPU kernel
for float64 inputs and by anything that wants a second opinion.
"""

from __future__ import annotations

import torch


def acc_dtype(*xs: torch.dtype | torch.Tensor) -> torch.dtype:
    """Accumulation dtype of dtypes or tensors: float64 if any is float64, else float32.

    >>> acc_dtype(torch.bfloat16), acc_dtype(torch.zeros(1), torch.zeros(1, dtype=torch.float64))
    (torch.float32, torch.float64)
    """
    return torch.float64 if any(getattr(x, "dtype", x) == torch.float64 for x in xs) else torch.float32


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
    inputs), ``-inf`` with ``out = 0`` for a row that sees no key; a NaN
    score gives NaN. The masked product still multiplies hidden keys' values
    by 0 (0 * NaN = NaN): callers keep non-finite values out of the causal
    diagonal (see :func:`cpattn.ops.attention._causal`).
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
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]; NaN where a visible score is NaN
    live = lse != float("-inf")  # the row sees a key (only that may zero it: NaN must stay NaN)
    p = torch.exp(s - torch.where(live, lse, 0.0)[..., None])  # [Hq, Lq, Lk]
    out = torch.einsum("hqk,hkd->hqd", p, vf)
    out = torch.where(live[..., None], out, 0.0)
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact n-way merge of partial attention over disjoint key sets.

    outs: [N, T, H, D]; lses: [N, T, H]. Returns out [T, H, D] (outs' dtype)
    and lse [T, H] (float32, float64 for float64 input). Max-subtracted form:
    ``L = m + log(sum_i exp(L_i - m))``, ``O = sum_i exp(L_i - L) O_i``.

    An LSE of exactly -inf marks an empty partial: its output is ignored
    (it may hold garbage) and all empty gives (0, -inf). Nothing else is
    masked: a NaN LSE or output (NaN in the data) makes the row NaN, as on
    one device, even where its weight underflows to 0 (0 * NaN = NaN).
    """
    acc = acc_dtype(lses.dtype if lses.dtype == torch.float64 else outs.dtype)
    lses = lses.to(acc)
    w, total, lse = lse_weights(lses)  # [N, T, H], [T, H], [T, H]
    parts = torch.where((lses == float("-inf"))[..., None], 0.0, outs.to(acc))  # only empty partials are zeroed
    out = (w[..., None] * parts).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    return out.to(outs.dtype), lse.to(lse_dtype)


def lse_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LSE side of a merge: lses [N, ...] -> (w [N, ...], total [...], lse [...]).

    ``w_i = exp(L_i - m)`` with m the largest L_i, ``total = sum_i w_i``,
    ``lse = m + log(total)``. An empty partial (L_i = -inf) gets w 0; where
    every partial is empty, total is 0 and lse -inf. A NaN L_i makes m, every
    w and the lse of that row NaN (NaN is data, never "empty"); +inf does too.

    Example
    -------
    >>> import torch
    >>> inf, nan = float("inf"), float("nan")
    >>> [round(x, 6) for x in lse_weights(torch.tensor([[0.0, -inf, nan], [0.0, -inf, 1.0]]))[2].tolist()]
    [0.693147, -inf, nan]
    """
    empty = lses == float("-inf")
    m = lses.amax(dim=0)  # NaN if any L_i is NaN
    m = torch.where(m == float("-inf"), 0.0, m)  # all empty: any finite shift will do
    w = torch.exp(lses - m)  # 0 exactly where the partial is empty (m finite)
    total = w.sum(dim=0)
    lse = torch.where(empty.all(dim=0), float("-inf"), m + torch.log(total))
    return w, total, lse
