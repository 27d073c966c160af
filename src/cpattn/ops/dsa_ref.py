"""Plain reference math of the DSA ops (lightning indexer, top-k, sparse MLA).

Slow and obvious, computed in float64 for float64 inputs and float32
otherwise: every query is scored against every key row, masks are built
explicitly, top-k is a stable sort. The fast CPU kernels in
:mod:`cpattn.ops.dsa` must agree with these; the CUDA registration uses
them as they are.
"""

from __future__ import annotations

import torch

from cpattn.ops.ref import acc_dtype




def indexer_scores(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, key_start: torch.Tensor, visible: torch.Tensor, max_keys: int
) -> torch.Tensor:
    """``I[t, s] = sum_h w[t,h] * relu(q[t,h] . k[key_start[t] + s])`` for ``s < visible[t]``, else -inf.

    q: [T, H, D]; w: [T, H]; k: [S, D]; key_start, visible: [T] int.
    Returns [T, max_keys] float32 (float64 for float64 inputs).
    """
    acc = acc_dtype(q, w, k)
    t = q.shape[0]
    cols = torch.arange(max_keys, device=q.device)  # [M]
    rows = key_start.long()[:, None] + cols[None, :]  # [T, M] row of k for (t, s)
    seen = cols[None, :] < visible.long()[:, None]  # [T, M]
    kk = k.to(acc)[rows.clamp(0, max(k.shape[0] - 1, 0))] if k.shape[0] else k.new_zeros(t, max_keys, k.shape[-1]).to(acc)
    logits = torch.einsum("thd,tsd->ths", q.to(acc), kk).relu()  # [T, H, M]
    scores = torch.einsum("th,ths->ts", w.to(acc), logits)  # [T, M]
    return scores.masked_fill(~seen, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k columns per row in the strict order (score desc, column asc); -1 pads.

    scores: [T, S] (-inf marks an invisible key, NaN counts as -inf).
    Returns [T, k] int32.
    """
    s = scores.double().masked_fill(scores.isnan(), float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True)  # ties keep ascending column
    kk = min(k, s.shape[-1])
    idx = order.indices[:, :kk]
    idx = torch.where(order.values[:, :kk] == float("-inf"), -1, idx)
    out = torch.full((s.shape[0], k), -1, dtype=torch.int32, device=s.device)
    out[:, :kk] = idx.to(torch.int32)
    return out


def sparse_mla_attention_with_lse(
    q: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, softmax_scale: float, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the cache rows ``indices[t]`` (``-1`` ignored).

    q: [T, H, Dqk]; latent: [S, Dqk] (values are ``latent[:, :v_head_dim]``);
    indices: [T, K]. Returns out [T, H, v_head_dim] in q's dtype and lse
    [T, H] (float32; float64 for float64 inputs); a row without any index
    gets out 0 and lse -inf. Each query gathers its own rows and zeroes the
    unselected slots, so a NaN reaches exactly the queries that selected it.
    """
    acc = acc_dtype(q, latent)
    t, h, _ = q.shape
    valid = indices >= 0  # [T, K]
    rows = torch.where(valid, indices.long(), 0)
    if latent.shape[0]:
        kv = latent.to(acc)[rows]  # [T, K, Dqk]
    else:
        kv = latent.new_zeros(*rows.shape, latent.shape[-1]).to(acc)
    kv = torch.where(valid[..., None], kv, 0.0)  # a -1 slot reads nothing
    s = torch.einsum("thd,tkd->thk", q.to(acc), kv) * softmax_scale  # [T, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, H]
    live = lse != float("-inf")  # only a query with no index is zeroed: NaN stays NaN
    p = torch.exp(s - torch.where(live, lse, 0.0)[..., None])  # [T, H, K]
    out = torch.einsum("thk,tkd->thd", p, kv[..., :v_head_dim])
    out = torch.where(live[..., None], out, 0.0)
    return out.to(q.dtype), lse
