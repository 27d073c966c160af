"""Transitional: the dense cache moved to :mod:`cpattn.engine.dense_cache`; this keeps the families'
``empty_cache`` helpers working until they build caches from their ``kv_layouts`` directly."""

from __future__ import annotations

from cpattn.engine.dense_cache import DenseKVCache as _DenseKVCache
from cpattn.engine.family import KVLayout


class DenseKVCache:
    """Builds a :class:`cpattn.engine.dense_cache.DenseKVCache` from the old per-model arguments."""

    @staticmethod
    def empty(*, num_layers: int, batch: int, max_len: int, kv_heads: int, dk: int, dv: int, shared_v: bool = False,
              index_dim: int = 0, dtype=None, device="cpu", poison: bool = True) -> _DenseKVCache:
        import torch

        lay = KVLayout(kv_heads, dk, dv, values_in_keys=shared_v, index_head_dim=index_dim)
        return _DenseKVCache.empty((lay,) * num_layers, batch=batch, max_len=max_len,
                                   dtype=dtype or torch.float32, device=device)
