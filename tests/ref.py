"""The tests' independent references: float64 oracles written plainly, and the named cases op tests run.

Nothing here imports cpattn. Oracles (all float64):

- :func:`attention`: dense attention with an explicit (request, position) mask;
- :func:`paged_attention`: a per-row loop over the visible keys of a paged cache;
- :func:`dsa`: DeepSeek sparse attention of a packed batch, the formula as the reference model states it;
- :func:`plain_error`: the error of a plain torch implementation in a low-precision dtype (the
  DESIGN.md §5 tolerance rule: ours may be at most twice that).

Cases, one frozen dataclass per kind (as FlashMLA's tests name their parameters):
:class:`AttnCase` (packed varlen attention) and :class:`PagedCase` (rows over a NaN-poisoned paged
cache), each with an ``id`` for pytest and a builder of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG = float("-inf")


def attention(q, k, v, q_req, k_req, q_pos=None, k_pos=None, *, scale=None, causal=True):
    """out [Tq, Hq, Dv] and lse [Tq, Hq] in float64.

    q: [Tq, Hq, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv]; q_req / k_req: [Tq] /
    [Tk] request id of each row; q_pos / k_pos: absolute positions. Query i
    sees key j iff same request and (not causal or k_pos[j] <= q_pos[i]).
    A row that sees nothing gets out 0, lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
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
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    hq, hkv = q.shape[1], k.shape[1]
    kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    mask = q_req[:, None] == k_req[None, :]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    s = s.masked_fill(~mask[None], float("-inf"))
    seen = mask.any(dim=1)
    p = torch.where(seen[None, :, None], torch.softmax(torch.where(seen[None, :, None], s, 0.0), -1), 0.0)
    out = torch.einsum("hqk,khd->qhd", p.to(dtype), vd)
    return (out.double() - ref).abs().max().item()


def paged_attention(q, k_cache, v_cache, block_table, req, lens, scale):
    """float64 out [T, Hq, Dv], lse [T, Hq] by a per-row loop over visible keys."""
    t, hq, _ = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(t, hq, v_cache.shape[-1], dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    for i in range(t):
        b, n = int(req[i]), int(lens[i])
        if b < 0 or n == 0:
            continue
        rows = [(int(block_table[b, j // bs]), j % bs) for j in range(n)]
        k = torch.stack([k_cache[x, y] for x, y in rows]).double()  # [n, Hkv, Dk]
        v = torch.stack([v_cache[x, y] for x, y in rows]).double()
        for h in range(hq):
            s = k[:, h // (hq // hkv)] @ q[i, h].double() * scale  # [n]
            lse[i, h] = torch.logsumexp(s, 0)
            out[i, h] = torch.softmax(s, 0) @ v[:, h // (hq // hkv)]
    return out, lse


def paged_cache(gen, lens_per_req, bs, hkv, dk, dv, dtype, spare_blocks=3, mla=False):
    """NaN-poisoned caches with each request's first lens keys written at shuffled blocks."""
    mb = max(1, max(-(-n // bs) for n in lens_per_req)) + 1  # one unused column
    nb = len(lens_per_req) * mb + spare_blocks
    perm = torch.randperm(nb, generator=gen)
    table = perm[: len(lens_per_req) * mb].view(len(lens_per_req), mb)
    k_cache = torch.full((nb, bs, hkv, dk), float("nan"), dtype=dtype)
    v_cache = k_cache[..., :dv] if mla else torch.full((nb, bs, hkv, dv), float("nan"), dtype=dtype)
    for b, n in enumerate(lens_per_req):
        for j in range(n):
            blk, off = int(table[b, j // bs]), j % bs
            k_cache[blk, off] = torch.randn(hkv, dk, generator=gen).to(dtype)
            if not mla:
                v_cache[blk, off] = torch.randn(hkv, dv, generator=gen).to(dtype)
    return k_cache, v_cache, table


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


# -- named cases ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnCase:
    """Packed varlen attention: request i has ``q_lens[i]`` queries after ``k_lens[i] - q_lens[i]`` earlier keys."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    hq: int
    hkv: int
    dqk: int
    dv: int
    causal: bool = True
    note: str = ""

    @property
    def id(self) -> str:
        return self.note or f"q{list(self.q_lens)}-k{list(self.k_lens)}-h{self.hq}/{self.hkv}-d{self.dqk}/{self.dv}"

    def cu(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cu_seqlens_q, cu_seqlens_k: [B+1] int32."""
        def cum(lens):
            return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

        return cum(self.q_lens), cum(self.k_lens)

    def inputs(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        """q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv], and the oracle's q_req, k_req, q_pos, k_pos."""
        g = torch.Generator().manual_seed(seed)
        lq, lk = self.q_lens, self.k_lens
        q = torch.randn(sum(lq), self.hq, self.dqk, generator=g).to(dtype)
        k = torch.randn(sum(lk), self.hkv, self.dqk, generator=g).to(dtype)
        v = torch.randn(sum(lk), self.hkv, self.dv, generator=g).to(dtype)
        q_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lq)])
        k_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lk)])
        # bottom-right: query j of request i sits at position lk - lq + j
        q_pos = torch.cat([torch.arange(n) + lk[i] - n for i, n in enumerate(lq)])
        k_pos = torch.cat([torch.arange(n) for n in lk])
        return q, k, v, q_req, k_req, q_pos, k_pos


@dataclass(frozen=True)
class PagedCase:
    """Rows over a paged cache: request b holds ``kv_lens[b]`` keys; row i is (request, visible keys)."""

    kv_lens: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]
    block_size: int
    hq: int
    hkv: int
    dk: int
    dv: int
    note: str = ""

    @property
    def id(self) -> str:
        return self.note or f"kv{list(self.kv_lens)}-rows{len(self.rows)}-bs{self.block_size}-h{self.hq}/{self.hkv}"

    def args(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        """(q [T, Hq, Dk], k_cache, v_cache (NaN-poisoned), block_table, req_indices [T], kv_lens [T] int32)."""
        gen = torch.Generator().manual_seed(seed)
        k_cache, v_cache, table = paged_cache(gen, list(self.kv_lens), self.block_size, self.hkv, self.dk, self.dv,
                                              dtype)
        q = torch.randn(len(self.rows), self.hq, self.dk, generator=gen).to(dtype)
        req = torch.tensor([r for r, _ in self.rows])
        lens = torch.tensor([n for _, n in self.rows], dtype=torch.int32)
        return q, k_cache, v_cache, table, req, lens
