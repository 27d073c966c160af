"""Pack a model's per-layer KV into one row per token, and back: what moves between ranks.

A token's cache row over all L layers is ``[L, F]`` with
``F = Hkv*Dk (+ Hkv*Dv when values are separate) (+ D_I for DSA indexer keys)``,
so one message carries every layer (P/D block transfer, the PCP -> DCP
all-to-all). The MLA latent cache has no separate values (F = 576 in
DeepSeek-V3).

Example
-------
>>> import torch
>>> k, v = [torch.randn(3, 2, 4)], [torch.randn(3, 2, 4)]
>>> rows = pack_rows(k, v, None)
>>> rows.shape
torch.Size([3, 1, 16])
>>> kk, vv, ii = unpack_rows(rows, kv_heads=2, dk=4, dv=4, shared_v=False, index_dim=0)
>>> torch.equal(kk[0], k[0]) and torch.equal(vv[0], v[0]) and ii is None
True
"""

from __future__ import annotations

from typing import Any

import torch


def pack_rows(k: list[torch.Tensor], v: list[torch.Tensor | None], ik: list[torch.Tensor] | None) -> torch.Tensor:
    """k[l]: [T, Hkv, Dk]; v[l]: [T, Hkv, Dv] or None; ik[l]: [T, D_I] or None -> rows [T, L, F]."""
    per_layer = []
    for layer in range(len(k)):
        t = k[layer].shape[0]
        parts = [k[layer].reshape(t, -1)]  # [T, Hkv*Dk]
        if v[layer] is not None:
            parts.append(v[layer].reshape(t, -1))  # [T, Hkv*Dv]
        if ik is not None:
            parts.append(ik[layer].reshape(t, -1).to(k[layer].dtype))  # [T, D_I]
        per_layer.append(torch.cat(parts, dim=1))
    return torch.stack(per_layer, dim=1)  # [T, L, F]


def unpack_rows(rows: torch.Tensor, *, kv_heads: int, dk: int, dv: int, shared_v: bool, index_dim: int):
    """Inverse of :func:`pack_rows`: rows [T, L, F] -> (k list, v list (None entries), ik list or None)."""
    t, n_layers = rows.shape[0], rows.shape[1]
    nk, nv = kv_heads * dk, 0 if shared_v else kv_heads * dv
    k = [rows[:, layer, :nk].reshape(t, kv_heads, dk) for layer in range(n_layers)]
    v = [None if shared_v else rows[:, layer, nk : nk + nv].reshape(t, kv_heads, dv) for layer in range(n_layers)]
    ik = [rows[:, layer, nk + nv : nk + nv + index_dim] for layer in range(n_layers)] if index_dim else None
    return k, v, ik


def row_layout(cfg: Any) -> dict:
    """The keyword arguments of :func:`unpack_rows` for a model config (``kv_dims``, DSA ``index_head_dim``)."""
    hkv, dk, dv, shared = cfg.kv_dims
    index_dim = cfg.index_head_dim if hasattr(cfg, "index_topk") else 0
    return {"kv_heads": hkv, "dk": dk, "dv": dv, "shared_v": shared, "index_dim": index_dim}
