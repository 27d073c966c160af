"""DeepSeek sparse attention (DSA) of a packed batch in float64, the formula as the reference model states it."""

from __future__ import annotations

import torch

NEG = float("-inf")


def dsa(q, latent, q_idx, w_idx, k_idx, cu_q, cu_k, topk, scale, dv):
    """float64 DSA of a packed batch; returns out [Tq, H, dv], lse [Tq, H], indices [Tq, topk].

    Request b: queries q[cu_q[b]:cu_q[b+1]] are the last Lq of its Lk keys.
    """
    cu_q, cu_k = [int(c) for c in cu_q], [int(c) for c in cu_k]
    tq, h, _ = q.shape
    out = torch.zeros(tq, h, dv, dtype=torch.float64)
    lse = torch.full((tq, h), NEG, dtype=torch.float64)
    idx_all = torch.full((tq, topk), -1, dtype=torch.int64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        pos = torch.arange(lk - lq, lk)  # absolute position of each query
        causal = torch.where(torch.arange(lk)[None, :] <= pos[:, None], 0.0, NEG).double()  # [Lq, Lk]
        qi, wi, ki = q_idx[q0:q1].double(), w_idx[q0:q1].double(), k_idx[k0:k1].double()
        index_scores = torch.einsum("ths,th->ts", torch.relu(torch.einsum("thd,sd->ths", qi, ki)), wi)
        index_scores = index_scores + causal
        kk = min(topk, lk)
        srt = torch.sort(index_scores, dim=-1, descending=True, stable=True)
        top = srt.indices[:, :kk]
        index_mask = torch.full((lq, lk), NEG, dtype=torch.float64).scatter(-1, top, 0.0)
        kv = latent[k0:k1].double()
        logits = torch.einsum("thd,sd->ths", q[q0:q1].double(), kv) * scale
        logits = logits + index_mask[:, None, :] + causal[:, None, :]
        lse[q0:q1] = torch.logsumexp(logits, dim=-1)
        out[q0:q1] = torch.einsum("ths,sd->thd", torch.softmax(logits, dim=-1), kv[:, :dv])
        idx_all[q0:q1, :kk] = torch.where(srt.values[:, :kk] == NEG, -1, top)
    return out, lse, idx_all
