"""The chunked (WY / UT-transform) gated delta rule for one request, in pieces the op and the PCP scan share.

Per chunk i of C tokens (all heads at once; S the state at the chunk's start)::

    vn_i = u_i - w_i S                       the part of the values S does not predict   [C, Dv]
    o_i  = qd_i S + causal(attn_i, vn_i)     outputs                                     [C, Dv]
    S'   = end_i S + kd_i^T vn_i             the state after the chunk                   [Dk, Dv]

with u, w from the chunk's unit lower-triangular UT system, ``qd`` the queries decayed from the chunk's
start, ``kd`` the keys decayed to its end, ``attn`` the decayed causal q k^T and ``end`` the chunk's total
decay. So ``S' = T_i S + kd_i^T u_i`` with the chunk's transition ``T_i = end_i I - kd_i^T w_i`` [Dk, Dk].

The chunks are handled in *slabs* of a few chunks (``SLAB`` rows of heads x tokens): a slab's ``[C, C]``
temporaries stay in cache, which on a CPU is worth ~1.3x over the whole request at once.

- :func:`prepare`: one slab's u, w, kd^T, end, qd, attn, batched over its chunks (chunk-major
  ``[m, H, ...]``); :func:`slabs`: every slab of a request, in order.
- :func:`run`: outputs and final state from a start state, streaming the slabs (prepare a slab, loop its
  chunks, its outputs) -- the chunked op.
- :func:`run_slabs`: the same on slabs prepared before; :func:`final_state`: the final state alone (two small
  matmuls per chunk, no outputs); :func:`transition`: the product ``T_{M-1} ... T_0`` [H, Dk, Dk] (batched
  matmuls). The last two from a zero state are a segment's summary for the PCP scan
  (:mod:`cpattn.linear.scan`).

NaN: masks use ``masked_fill`` (never ``0 * x``); the intra-chunk product keeps a non-finite vn row j from
reaching the rows before j (:func:`causal_product`), on the CPU taken only when some vn entry is non-finite
(otherwise the plain matmul gives the same numbers; elsewhere always, as checking would sync the host).

Example
-------
>>> import torch
>>> q = k = torch.tensor([[[1.0, 0.0]]]); v = torch.tensor([[[2.0]]])   # [H=1, L=1, D]
>>> o, s = run(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 2, 1), 64)
>>> o.flatten().tolist(), s.flatten().tolist()
([2.0], [2.0, 0.0])
>>> sl = slabs(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), 64)
>>> transition(sl).abs().flatten().tolist(), final_state(sl, torch.zeros(1, 2, 1)).flatten().tolist()
([0.0, 0.0, 0.0, 1.0], [2.0, 0.0])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

SLAB = 16 * 4 * 64  # rows (heads x tokens) per slab: 16 chunks of 64 tokens at 4 heads


class Chunks(NamedTuple):
    """One slab's chunk tensors, chunk-major: m chunks, H heads, C tokens each (the request's last one padded)."""

    n: int  # real tokens of the slab
    u: torch.Tensor  # [m, H, C, Dv]
    w: torch.Tensor  # [m, H, C, Dk]
    kdt: torch.Tensor  # [m, H, Dk, C]: keys decayed to the chunk's end, transposed
    end: torch.Tensor  # [m, H]: the chunk's total decay
    qd: torch.Tensor  # [m, H, C, Dk]: queries decayed from the chunk's start
    attn: torch.Tensor  # [m, H, C, C]: decayed causal q k^T (zero above the diagonal)


def _slab_bounds(h: int, n: int, c: int) -> list[tuple[int, int]]:
    step = max(1, SLAB // (h * c)) * c  # tokens per slab, whole chunks
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk_size: int) -> Chunks:
    """q, k: [H, L, Dk]; v: [H, L, Dv]; g, beta: [H, L] (prepared: normalised, scaled, heads repeated; one
    dtype; L >= 1) -> the chunks of these L tokens (the last one padded)."""
    h, n, _ = k.shape
    c = chunk_size
    pad = -n % c
    if pad:  # padded tokens (k = 0, beta = 0, g = 0) leave the state unchanged; their outputs are dropped
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (n + pad) // c
    # chunk-major [m, H, C, D]: chunk i's tensors are contiguous [H, ...] blocks for the loop's matmuls
    q, k, v = (x.reshape(h, m, c, x.shape[-1]).transpose(0, 1).contiguous() for x in (q, k, v))
    g, beta = g.reshape(h, m, c).transpose(0, 1), beta.reshape(h, m, c).transpose(0, 1)
    cum = g.cumsum(-1)  # [m, H, C]: log of the decay from the chunk start through token i
    ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
    above, on_or_above = ~ones.tril(), ~ones.tril(-1)
    # [m, H, C, C]: the decay from token j to token i (j <= i), 0 above the diagonal; in place, one buffer each
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(above, float("-inf")).exp_()
    kt = k.transpose(-1, -2)
    kb = k * beta[..., None]
    # unit lower-triangular UT system (I + A) X = B, A = strict lower part of (beta k k^T) * decay
    ut = torch.matmul(kb, kt).mul_(decay).masked_fill_(on_or_above, 0.0)
    ut.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    ecum = cum.exp()
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False, unitriangular=True)  # [m, H, C, Dv]
    w = torch.linalg.solve_triangular(ut, k * (beta * ecum)[..., None], upper=False, unitriangular=True)
    attn = torch.matmul(q, kt).mul_(decay).masked_fill_(above, 0.0)
    kdt = (k * (cum[..., -1:] - cum).exp_()[..., None]).transpose(-1, -2).contiguous()
    return Chunks(n, u, w, kdt, ecum[..., -1].contiguous(), q * ecum[..., None], attn)


def slabs(q, k, v, g, beta, chunk_size: int) -> list[Chunks]:
    """Every slab of a request (arguments as :func:`prepare`; none for L = 0)."""
    return [prepare(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], chunk_size)
            for lo, hi in _slab_bounds(k.shape[0], k.shape[1], chunk_size)]


def _loop(ch: Chunks, s: torch.Tensor, starts: torch.Tensor | None = None, vn: torch.Tensor | None = None):
    """The state loop over a slab's chunks from s [H, Dk, Dv]; fills each chunk's start state and vn if given."""
    for i in range(ch.u.shape[0]):
        if starts is None:
            d = torch.baddbmm(ch.u[i], ch.w[i], s, alpha=-1)
        else:
            starts[i] = s
            d = torch.baddbmm(ch.u[i], ch.w[i], s, alpha=-1, out=vn[i])
        s = torch.baddbmm(s * ch.end[i, :, None, None], ch.kdt[i], d)
    return s


def causal_product(attn: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``attn @ vals`` for lower-triangular attn [..., C, C] where a non-finite value row j reaches rows >= j
    only (a plain matmul would spread it to every row through the zeros above the diagonal)."""
    bad = ~torch.isfinite(vals)  # [..., C, Dv]
    out = attn @ torch.where(bad, 0.0, vals)
    reach = bad.to(torch.int32).cumsum(dim=-2) > 0  # a bad row at or before this one, per column
    return out.masked_fill(reach, float("nan"))


def _run_slab(ch: Chunks, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A slab's outputs [H, n, Dv] and the state after it, from s."""
    m, h, c, _ = ch.u.shape
    dv = s.shape[-1]
    starts, vn = s.new_empty(m, *s.shape), torch.empty(m, h, c, dv, dtype=s.dtype, device=s.device)
    s = _loop(ch, s, starts, vn)
    o = ch.qd @ starts  # [m, H, C, Dv]: what each chunk's start state gives its queries
    # the plain product is the masked one when nothing is non-finite (checked on the CPU only: a host sync)
    if vn.device.type == "cpu" and bool(torch.isfinite(vn).all()):
        o = torch.baddbmm(o.view(m * h, c, dv), ch.attn.view(m * h, c, c), vn.view(m * h, c, dv)).view(m, h, c, dv)
    else:
        o = o + causal_product(ch.attn, vn)
    return o.transpose(0, 1).reshape(h, m * c, dv)[:, :ch.n], s


def run_slabs(sl: list[Chunks], start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [H, n, Dv] and final state [H, Dk, Dv] from ``start`` over slabs prepared before."""
    outs, s = [], start
    for ch in sl:
        o, s = _run_slab(ch, s)
        outs.append(o)
    h, dv = start.shape[0], start.shape[-1]
    return (torch.cat(outs, dim=1) if outs else start.new_zeros(h, 0, dv)), s


def run(q, k, v, g, beta, start: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's outputs [H, L, Dv] and final state from ``start`` [H, Dk, Dv] (arguments as :func:`prepare`;
    L may be 0), a slab at a time."""
    outs, s = [], start
    for lo, hi in _slab_bounds(k.shape[0], k.shape[1], chunk_size):
        o, s = _run_slab(prepare(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], chunk_size), s)
        outs.append(o)
    return (torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape[0], 0, start.shape[-1])), s


def final_state(sl: list[Chunks], start: torch.Tensor) -> torch.Tensor:
    """The state after the slabs' tokens from ``start`` [H, Dk, Dv] (no outputs)."""
    s = start
    for ch in sl:
        s = _loop(ch, s)
    return s


def transition(sl: list[Chunks]) -> torch.Tensor:
    """``T_{M-1} ... T_0`` [H, Dk, Dk] over every chunk of the slabs, ``T_i = end_i I - kd_i^T w_i``: the start
    state's map through the tokens (identity for none). Batched: each slab's ``T_i`` at once, then a tree of
    products, later chunks on the left."""
    if not sl:
        raise ValueError("transition needs at least one slab; a request without tokens maps S to S")
    ts = []
    for ch in sl:
        t = -(ch.kdt @ ch.w)  # [m, H, Dk, Dk]
        t.diagonal(dim1=-2, dim2=-1).add_(ch.end[..., None])
        ts.append(t)
    t = torch.cat(ts) if len(ts) > 1 else ts[0]
    while t.shape[0] > 1:
        even = t.shape[0] // 2 * 2
        pairs = t[1:even:2] @ t[0:even:2]
        t = torch.cat([pairs, t[even:]]) if even < t.shape[0] else pairs
    return t[0]
