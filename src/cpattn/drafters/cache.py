"""A drafter's own KV cache: one dense buffer per draft layer, written by row and read through a key range.

The draft runs replicated on every rank (logical PCP size 1), so its cache
is plain: ``[R + 1, L + 1, Hkv, D]`` per layer for R requests of up to L
positions, where request row R and position column L are scratch (padding
rows write there; nothing reads them). A step writes each new row at
``(req, pos)`` and each query reads its request's keys at positions
``lo <= p < hi`` -- a range given per query row, so the same function does
causal rows (``hi = pos + 1``), a non-causal block (every block row sees the
whole block) and a query that sees nothing (``lo = hi = 0``: output 0).
Everything is tensor indexing with static shapes: the step that calls it
can be captured (no host sync, no data-dependent shape).

Rolling back is free: a request's valid length lives with the caller, rows
past it are never read (every read is range-limited) and are overwritten
by the next step that reaches them.

Example
-------
>>> k = new_cache(1, requests=2, max_len=4, heads=1, dim=2)
>>> write(k[0], torch.tensor([0, 0]), torch.tensor([0, 1]), torch.ones(2, 1, 2))
>>> q = torch.ones(2, 1, 2)                                     # [N, Hq, D]
>>> lo, hi = torch.tensor([0, 0]), torch.tensor([2, 0])         # the second row sees no key
>>> attend(q, k[0], k[0], torch.tensor([0, 0]), lo, hi, 1.0).tolist()
[[[1.0, 1.0]], [[0.0, 0.0]]]
"""

from __future__ import annotations

import torch


def new_cache(num_layers: int, *, requests: int, max_len: int, heads: int, dim: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_layers, requests + 1, max_len + 1, heads, dim]`` zeros (the last request / position: scratch)."""
    return torch.zeros(num_layers, requests + 1, max_len + 1, heads, dim, dtype=dtype, device=device)


def write(buf: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` [N, H, D] at ``buf[req[n], pos[n]]`` (buf: [R + 1, L + 1, H, D]; padding rows point at
    the scratch request R or scratch position L). The one side effect of a draft step."""
    buf.index_put_((req, pos), rows.to(buf.dtype))


def attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req: torch.Tensor, lo: torch.Tensor,
           hi: torch.Tensor, scale: float, *, v_head_dim: int | None = None) -> torch.Tensor:
    """Softmax attention of each query row over its request's cached keys at positions ``[lo, hi)``.

    q: [N, Hq, D] query rows; k_buf, v_buf: [R + 1, L + 1, Hkv, D(v)] (Hq a
    multiple of Hkv: query head h reads KV head ``h // (Hq // Hkv)``); req:
    [N] the cache row of each query row; lo, hi: [N] its visible key range.
    v_head_dim: values are ``v_buf[..., :v_head_dim]`` (the MLA latent row
    serves as key and value). A row that sees no key gives 0. Computed in
    float32 (or wider). Returns [N, Hq, Dv] in q's dtype.
    """
    hq = q.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    k = k_buf[req].to(acc)  # [N, L + 1, Hkv, D]
    v = v_buf[req].to(acc)
    if v_head_dim is not None:
        v = v[..., :v_head_dim]
    group = hq // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # [N, L + 1, Hq, D]
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("nhd,nkhd->nhk", q.to(acc), k) * scale  # [N, Hq, L + 1]
    p = torch.arange(k.shape[1], device=q.device)  # [L + 1]
    seen = (p[None, :] >= lo[:, None]) & (p[None, :] < hi[:, None])  # [N, L + 1]
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(acc).min)  # finite even for a row that sees nothing
    w = torch.exp(s - m)  # 0 where masked
    w = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    return torch.einsum("nhk,nkhd->nhd", w, v).to(q.dtype)  # [N, Hq, Dv]


def step_attention(cache: torch.Tensor, batch: dict):
    """The attention a one-layer draft step hands its layer: ``attend(q, k, v, scale)`` writes the step's rows
    ``k``, ``v`` [N, Hkv, D] into ``cache`` [2, R + 1, L + 1, Hkv, D] at ``(batch["req"], batch["pos"])``,
    then returns :func:`attend` of ``q`` [N, Hq, D] over keys ``batch["lo"] <= p < batch["hi"]`` ([N, Hq, D]).

    >>> cache = new_cache(2, requests=1, max_len=2, heads=1, dim=2)
    >>> one = torch.tensor([0])
    >>> batch = {"req": one, "pos": one, "lo": one, "hi": one + 1}
    >>> step_attention(cache, batch)(torch.ones(1, 1, 2), torch.ones(1, 1, 2), 2 * torch.ones(1, 1, 2), 1.0).tolist()
    [[[2.0, 2.0]]]
    """

    def attend_rows(q, k, v, scale):
        write(cache[0], batch["req"], batch["pos"], k)
        write(cache[1], batch["req"], batch["pos"], v)
        return attend(q, cache[0], cache[1], batch["req"], batch["lo"], batch["hi"], scale)

    return attend_rows
