"""The chunked (WY / UT-transform) form of the gated delta rule for one request, in pieces the op and the PCP scan share.

Per chunk i of C tokens (all heads at once; S the state at the chunk's start)::

    vn_i = u_i - w_i S                       the part of the values S does not predict   [C, Dv]
    o_i  = qd_i S + causal(attn_i, vn_i)     outputs                                     [C, Dv]
    S'   = end_i S + kd_i^T vn_i             the state after the chunk                   [Dk, Dv]

with u, w from the chunk's unit lower-triangular UT system, ``qd`` the queries decayed from the chunk's
start, ``kd`` the keys decayed to its end, ``attn`` the decayed causal q k^T and ``end`` the chunk's total
decay. So ``S' = T_i S + kd_i^T u_i`` with the chunk's transition ``T_i = end_i I - kd_i^T w_i`` [Dk, Dk].

- :func:`prepare`: every chunk's u, w, kd^T, end, qd, attn, batched over chunks (chunk-major ``[M, H, ...]``).
- :func:`states`: the sequential loop over chunks from a start state: each chunk's start state and vn (two
  batched matmuls per chunk), and the final state. :func:`final_state`: the final state alone.
- :func:`outputs`: every chunk's outputs at once from :func:`states`' results (batched matmuls).
- :func:`transition`: the product ``T_{M-1} ... T_0`` [H, Dk, Dk] (a tree of batched matmuls): with
  :func:`final_state` from zero, a segment's summary for the PCP scan (:mod:`cpattn.linear.scan`).

NaN: masks use ``where`` (never ``0 * x``); the intra-chunk product keeps a non-finite vn row j from reaching
the rows before j (:func:`causal_product`), taken only when some vn entry is non-finite (otherwise the plain
matmul is the same numbers).

Example
-------
>>> import torch
>>> q = k = torch.tensor([[[1.0, 0.0]]]); v = torch.tensor([[[2.0]]])   # [H=1, L=1, D]
>>> ch = prepare(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), 64)
>>> starts, vn, s = states(ch, torch.zeros(1, 2, 1))
>>> outputs(ch, starts, vn).flatten().tolist(), s.flatten().tolist()
([2.0], [2.0, 0.0])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Chunks(NamedTuple):
    """One request's chunk tensors, chunk-major: M chunks, H heads, C tokens each (the last one padded)."""

    n: int  # real tokens
    u: torch.Tensor  # [M, H, C, Dv]
    w: torch.Tensor  # [M, H, C, Dk]
    kdt: torch.Tensor  # [M, H, Dk, C]: keys decayed to the chunk's end, transposed
    end: torch.Tensor  # [M, H]: the chunk's total decay
    qd: torch.Tensor  # [M, H, C, Dk]: queries decayed from the chunk's start
    attn: torch.Tensor  # [M, H, C, C]: decayed causal q k^T (zero above the diagonal)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk_size: int) -> Chunks:
    """q, k: [H, L, Dk]; v: [H, L, Dv]; g, beta: [H, L] (prepared: normalised, scaled, heads repeated; one dtype)."""
    h, n, dk = k.shape
    dv, c = v.shape[-1], chunk_size
    if n == 0:
        e = k.new_empty
        return Chunks(0, e(0, h, c, dv), e(0, h, c, dk), e(0, h, dk, c), e(0, h), e(0, h, c, dk), e(0, h, c, c))
    pad = -n % c
    if pad:  # padded tokens (k = 0, beta = 0, g = 0) leave the state unchanged; their outputs are dropped
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (n + pad) // c
    # chunk-major [M, H, C, D]: chunk i's tensors are contiguous [H, ...] blocks for the loop's matmuls
    q, k, v = (x.reshape(h, m, c, x.shape[-1]).transpose(0, 1).contiguous() for x in (q, k, v))
    g, beta = g.reshape(h, m, c).transpose(0, 1).contiguous(), beta.reshape(h, m, c).transpose(0, 1).contiguous()
    cum = g.cumsum(-1)  # [M, H, C]: log of the decay from the chunk start through token i
    ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
    above, on_or_above = ~ones.tril(), ~ones.tril(-1)
    # [M, H, C, C]: the decay from token j to token i (j <= i), 0 above the diagonal; in place, one buffer each
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(above, float("-inf")).exp_()
    kt = k.transpose(-1, -2)
    kb = k * beta[..., None]
    # unit lower-triangular UT system (I + A) X = B, A = strict lower part of (beta k k^T) * decay
    ut = torch.matmul(kb, kt).mul_(decay).masked_fill_(on_or_above, 0.0)
    ut.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    ecum = cum.exp()
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False, unitriangular=True)  # [M, H, C, Dv]
    w = torch.linalg.solve_triangular(ut, k * (beta * ecum)[..., None], upper=False, unitriangular=True)
    attn = torch.matmul(q, kt).mul_(decay).masked_fill_(above, 0.0)
    kdt = (k * (cum[..., -1:] - cum).exp_()[..., None]).transpose(-1, -2).contiguous()
    return Chunks(n, u, w, kdt, ecum[..., -1].contiguous(), q * ecum[..., None], attn)


def states(ch: Chunks, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``start`` [H, Dk, Dv]: each chunk's start state [M, H, Dk, Dv], its vn [M, H, C, Dv], the final state."""
    m = ch.u.shape[0]
    starts = start.new_empty(m, *start.shape)
    vn = torch.empty_like(ch.u)
    s = start
    for i in range(m):
        starts[i] = s
        torch.baddbmm(ch.u[i], ch.w[i], s, alpha=-1, out=vn[i])
        s = torch.baddbmm(s * ch.end[i, :, None, None], ch.kdt[i], vn[i])
    return starts, vn, s


def final_state(ch: Chunks, start: torch.Tensor) -> torch.Tensor:
    """The state after the request's tokens from ``start`` [H, Dk, Dv] (:func:`states` without storing)."""
    s = start
    for i in range(ch.u.shape[0]):
        vn = torch.baddbmm(ch.u[i], ch.w[i], s, alpha=-1)
        s = torch.baddbmm(s * ch.end[i, :, None, None], ch.kdt[i], vn)
    return s


def causal_product(attn: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``attn @ vals`` for lower-triangular attn [..., C, C] where a non-finite value row j reaches rows >= j
    only (a plain matmul would spread it to every row through the zeros above the diagonal)."""
    bad = ~torch.isfinite(vals)  # [..., C, Dv]
    out = attn @ torch.where(bad, 0.0, vals)
    reach = bad.to(torch.int32).cumsum(dim=-2) > 0  # a bad row at or before this one, per column
    return out.masked_fill(reach, float("nan"))


def outputs(ch: Chunks, starts: torch.Tensor, vn: torch.Tensor) -> torch.Tensor:
    """o [H, n, Dv] from :func:`states`' per-chunk start states and vn (all chunks at once)."""
    m, h, c, dv = vn.shape
    o = ch.qd @ starts  # [M, H, C, Dv]: what each chunk's start state gives its queries
    if bool(torch.isfinite(vn).all()):  # the plain product is the masked one when nothing is non-finite
        o = torch.baddbmm(o.view(m * h, c, dv), ch.attn.view(m * h, c, c), vn.view(m * h, c, dv)).view(m, h, c, dv)
    else:
        o = o + causal_product(ch.attn, vn)
    return o.transpose(0, 1).reshape(h, m * c, dv)[:, :ch.n]


def transition(ch: Chunks) -> torch.Tensor:
    """``T_{M-1} ... T_0`` [H, Dk, Dk], ``T_i = end_i I - kd_i^T w_i``: the start state's map through the
    request's tokens (identity for no tokens). A tree of batched matmuls, later chunks on the left."""
    m, h, dk, _ = ch.kdt.shape
    if m == 0:
        return torch.eye(dk, dtype=ch.u.dtype, device=ch.u.device).expand(h, dk, dk).clone()
    t = -(ch.kdt @ ch.w)  # [M, H, Dk, Dk]
    t.diagonal(dim1=-2, dim2=-1).add_(ch.end[..., None])
    while t.shape[0] > 1:
        even = t.shape[0] // 2 * 2
        pairs = t[1:even:2] @ t[0:even:2]
        t = torch.cat([pairs, t[even:]]) if even < t.shape[0] else pairs
    return t[0]


def run(ch: Chunks, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [H, n, Dv] and final state of the request from ``start`` [H, Dk, Dv]."""
    if ch.u.shape[0] == 0:
        return ch.u.new_zeros(ch.u.shape[1], 0, ch.u.shape[-1]), start
    starts, vn, s = states(ch, start)
    return outputs(ch, starts, vn), s
