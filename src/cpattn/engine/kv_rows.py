"""One row per token holding its KV of every layer: what moves between ranks and engines.

Layer l contributes ``layouts[l].row_width`` columns (keys, values unless
they live in the keys, the DSA indexer key), so a token's row is
``[F]`` with ``F = sum_l row_width_l``; rows of T tokens are ``[T, F]`` in
the cache dtype. One message then carries every layer (the P/D block
transfer, the PCP -> DCP all-to-all, a pooled block ``[block_size, F]``).

Example
-------
>>> import torch
>>> from cpattn.models.family import KVLayout
>>> lay = (KVLayout(2, 4, 4),)
>>> k, v = [torch.randn(3, 2, 4)], [torch.randn(3, 2, 4)]
>>> rows = pack_rows(lay, k, v, [None])
>>> rows.shape
torch.Size([3, 16])
>>> kk, vv, ii = unpack_rows(lay, rows)
>>> torch.equal(kk[0], k[0]) and torch.equal(vv[0], v[0]) and ii[0] is None
True
"""

from __future__ import annotations

import torch

from cpattn.models.family import KVLayout


def row_width(layouts: tuple[KVLayout, ...]) -> int:
    """F: the columns of one token's row over all layers."""
    return sum(lay.row_width for lay in layouts)


def pack_rows(layouts: tuple[KVLayout, ...], k: list[torch.Tensor], v: list[torch.Tensor | None],
              k_index: list[torch.Tensor | None]) -> torch.Tensor:
    """Per-layer k [T, Hkv, Dk], v [T, Hkv, Dv] (None when values live in the keys), k_index [T, D_I] or None
    -> rows [T, F] in k's dtype."""
    t = k[0].shape[0]
    parts = []
    for lay, kl, vl, il in zip(layouts, k, v, k_index):
        parts.append(kl.reshape(t, lay.num_kv_heads * lay.head_dim))  # [T, Hkv*Dk] (T may be 0)
        if not lay.values_in_keys:
            parts.append(vl.reshape(t, lay.num_kv_heads * lay.v_head_dim))  # [T, Hkv*Dv]
        if lay.index_head_dim:
            parts.append(il.reshape(t, lay.index_head_dim).to(kl.dtype))  # [T, D_I]
    return torch.cat(parts, dim=1)


def unpack_rows(layouts: tuple[KVLayout, ...], rows: torch.Tensor):
    """Inverse of :func:`pack_rows`: rows [T, F] -> (k, v, k_index) lists per layer (views; None where absent)."""
    t, at = rows.shape[0], 0
    k, v, ki = [], [], []

    def take(n):
        nonlocal at
        at += n
        return rows[:, at - n : at]

    for lay in layouts:
        k.append(take(lay.num_kv_heads * lay.head_dim).reshape(t, lay.num_kv_heads, lay.head_dim))
        v.append(None if lay.values_in_keys else
                 take(lay.num_kv_heads * lay.v_head_dim).reshape(t, lay.num_kv_heads, lay.v_head_dim))
        ki.append(take(lay.index_head_dim) if lay.index_head_dim else None)
    if at != rows.shape[1]:
        raise ValueError(f"rows have {rows.shape[1]} columns but the layouts describe {at}")
    return k, v, ki
