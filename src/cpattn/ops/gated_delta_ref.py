"""Float64 sequential oracles of :mod:`cpattn.ops.gated_delta`: the recurrence written plainly, token by token.

Per request, value head h and token t, in matrix form (DESIGN.md §4.13)::

    A_t = exp(g_t) * (I - beta_t k_t k_t^T)          [Dk, Dk]
    S_t = A_t @ S_{t-1} + beta_t * outer(k_t, v_t)    [Dk, Dv]
    o_t = S_t^T @ q_t

with q, k L2-normalised (``x / sqrt(|x|^2 + 1e-6)``) when asked and q times
``scale``; key head ``h // (Hv // Hk)`` serves value head h. The causal conv
is the explicit sum over its K taps. Nothing here is shared with the fast
ops: these are the tests' and the PCP scan's oracles.

Example
-------
>>> import torch
>>> q = k = torch.tensor([[[1.0, 0.0]]]); v = torch.tensor([[[2.0]]])
>>> o, s = gated_delta(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), [0, 1], torch.zeros(1, 1, 2, 1), scale=1.0,
...                    use_qk_l2norm=False)
>>> o.flatten().tolist()
[2.0]
"""

from __future__ import annotations

import torch


def gated_delta(q, k, v, g, beta, cu_seqlens, initial_state, *, scale: float, use_qk_l2norm: bool = True):
    """o [T, Hv, Dv] and final states [B, Hv, Dk, Dv], both float64 (shapes as the op's)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    cu = [int(c) for c in cu_seqlens]
    t, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    out = torch.zeros(t, hv, dv, dtype=torch.float64)
    finals = []
    eye = torch.eye(dk, dtype=torch.float64)
    for b in range(len(cu) - 1):
        heads = []
        for h in range(hv):
            s = initial_state[b, h].double().clone()  # [Dk, Dv]
            for i in range(cu[b], cu[b + 1]):
                qt, kt = q[i, h * hk // hv], k[i, h * hk // hv]
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                qt = qt * scale
                a = torch.exp(g[i, h]) * (eye - beta[i, h] * torch.outer(kt, kt))
                s = a @ s + beta[i, h] * torch.outer(kt, v[i, h])
                out[i, h] = s.T @ qt
            heads.append(s)
        finals.append(torch.stack(heads) if heads else torch.zeros(0, dk, dv, dtype=torch.float64))
    final = torch.stack(finals) if finals else torch.zeros(0, hv, dk, dv, dtype=torch.float64)
    return out, final


def causal_conv1d(x, weight, bias, cu_seqlens, conv_state, *, silu: bool = True):
    """y [T, C] and new conv states [B, K-1, C], float64: each request's inputs preceded by its conv state."""
    x, weight = x.double(), weight.double()
    cu = [int(c) for c in cu_seqlens]
    kw = weight.shape[1]
    ys, states = [], []
    for b in range(len(cu) - 1):
        ext = torch.cat([conv_state[b].double(), x[cu[b]:cu[b + 1]]])  # [K-1 + n, C]
        for i in range(kw - 1, ext.shape[0]):
            y = sum(weight[:, j] * ext[i - (kw - 1) + j] for j in range(kw))
            if bias is not None:
                y = y + bias.double()
            ys.append(y * torch.sigmoid(y) if silu else y)
        states.append(ext[ext.shape[0] - (kw - 1):])
    y = torch.stack(ys) if ys else torch.zeros(0, x.shape[1], dtype=torch.float64)
    return y, torch.stack(states)
