"""Paged attention in float64 by a per-row loop over the visible keys, and NaN-poisoned paged caches."""

from __future__ import annotations

import torch

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
