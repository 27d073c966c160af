"""Dense attention in float64 with an explicit (request, position) mask, and the plain low-precision baseline.

- :func:`attention`: the oracle every attention path is checked against;
- :func:`req_pos`: request id and absolute position of each packed token (the oracle's mask inputs);
- :func:`plain_error`: the error of a plain torch implementation in a low-precision dtype (the
  DESIGN.md §5 tolerance rule: ours may be at most twice that).
"""

from __future__ import annotations

import torch


def attention(q, k, v, q_req, k_req, q_pos=None, k_pos=None, *, scale=None, causal=True):
    """out [Tq, Hq, Dv] and lse [Tq, Hq] in float64.

    q: [Tq, Hq, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv]; q_req / k_req: [Tq] /
    [Tk] request id of each row; q_pos / k_pos: absolute positions. Query i
    sees key j iff same request and (not causal or k_pos[j] <= q_pos[i]).
    A row that sees nothing gets out 0, lse -inf.
    """
    return _dense(q.double(), k.double(), v.double(), q_req, k_req, q_pos, k_pos, scale, causal)


def _dense(q, k, v, q_req, k_req, q_pos, k_pos, scale, causal):
    """The masked softmax attention of :func:`attention`, computed in the inputs' dtype: (out, lse)."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = q_req[:, None] == k_req[None, :]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Tq]
    seen = mask.any(dim=1)  # [Tq]
    p = torch.where(seen[None, :, None], torch.softmax(torch.where(seen[None, :, None], s, 0.0), -1), 0.0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse.transpose(0, 1)


def req_pos(cu_seqlens, context_lens=None):
    """Request id and absolute position of each packed token: ([T], [T]) int64."""
    cu = [int(c) for c in cu_seqlens]
    ctx = context_lens or [0] * (len(cu) - 1)
    req = torch.cat([torch.full((b - a,), i, dtype=torch.int64) for i, (a, b) in enumerate(zip(cu, cu[1:]))] or [torch.zeros(0, dtype=torch.int64)])
    pos = torch.cat([torch.arange(b - a, dtype=torch.int64) + ctx[i] for i, (a, b) in enumerate(zip(cu, cu[1:]))] or [torch.zeros(0, dtype=torch.int64)])
    return req, pos


def plain_error(q, k, v, q_req, k_req, q_pos, k_pos, dtype, scale=None, causal=True):
    """Max abs error of a plain torch implementation run in ``dtype`` vs the float64 oracle.

    The "plain torch" baseline of DESIGN.md §5's tolerance rule: the same dense
    masked softmax, computed entirely in ``dtype``.
    """
    ref, _ = attention(q, k, v, q_req, k_req, q_pos, k_pos, scale=scale, causal=causal)
    out, _ = _dense(q.to(dtype), k.to(dtype), v.to(dtype), q_req, k_req, q_pos, k_pos, scale, causal)
    return (out.double() - ref).abs().max().item()
