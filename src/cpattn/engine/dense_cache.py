"""A dense single-device KV cache and its attention step: the one-device reference path.

:class:`DenseKVCache` holds B requests contiguously per layer; a
:class:`DenseStep` is one forward step on it (prefill, decode, a draft
model's step): it stores the step's new keys/values and attends causally
(bottom-right aligned) through :func:`cpattn.ops.attention_with_lse`, or
runs DeepSeek sparse attention (:func:`cpattn.dsa.dsa_attention`; a layer
without an indexer reuses an earlier layer's selection, :meth:`DenseStep.dsa_shared`). Values
may live in the keys (``KVLayout.values_in_keys``: the MLA latent row).

Example
-------
>>> import torch
>>> from cpattn.models.family import KVLayout, nan_caches
>>> cache = DenseKVCache.empty((KVLayout(2, 4, 4),), batch=1, max_len=8)
>>> step = cache.step([3])
>>> out = step(0, torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), 0.5)
>>> out.shape, step.finish().seq_lens
(torch.Size([3, 2, 4]), (3,))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from cpattn.dsa import dsa_attention
from cpattn.layout.rows import cu_seqlens
from cpattn.ops.dsa import causal_key_ranges, sparse_mla_attention_with_lse
from cpattn.models.family import KVLayout, nan_caches
from cpattn.ops import attention_with_lse


def cumsum(lens) -> torch.Tensor:
    """cu_seqlens [B+1] int32 of per-request lengths [B].

    >>> cumsum([3, 0, 2]).tolist()
    [0, 3, 3, 5]
    """
    return torch.tensor(cu_seqlens(lens), dtype=torch.int32)


@dataclass(frozen=True)
class DenseKVCache:
    """Contiguous KV cache of B requests on one device.

    k[l]: [B, S_max, Hkv, Dk]; v[l]: [B, S_max, Hkv, Dv] or None (values in
    the keys); k_index[l]: [B, S_max, D_I] DSA indexer keys or None.
    ``seq_lens``: tokens stored per request (host ints); rows past them are
    NaN and never read. The tensors are written in place by
    :class:`DenseStep` (the one side effect); lengths change only through
    :meth:`DenseStep.finish`.
    """

    layouts: tuple[KVLayout, ...]
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor | None, ...]
    k_index: tuple[torch.Tensor | None, ...]
    seq_lens: tuple[int, ...]

    @classmethod
    def empty(cls, layouts: tuple[KVLayout, ...], *, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DenseKVCache:
        """An empty cache; unused rows hold NaN (they must never be read)."""

        k, v, ki = nan_caches(tuple(layouts), (batch, max_len), dtype, device)
        return cls(tuple(layouts), k, v, ki, (0,) * batch)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def step(self, new_lens: list[int]) -> DenseStep:
        """Plan one forward step that appends ``new_lens[b]`` tokens to request b."""
        if len(new_lens) != len(self.seq_lens):
            raise ValueError(f"new_lens has {len(new_lens)} entries for a cache of {len(self.seq_lens)} requests")
        ends = [s + int(n) for s, n in zip(self.seq_lens, new_lens)]
        if max(ends, default=0) > self.max_len:
            raise ValueError(f"the step needs {max(ends)} cache rows but max_len is {self.max_len}; raise max_len")
        return DenseStep(self, tuple(int(n) for n in new_lens))

    def truncate(self, seq_lens: list[int]) -> DenseKVCache:
        """The same tensors with shorter ``seq_lens`` (rows past them are dropped, overwritten later)."""
        if any(n < 0 or n > s for n, s in zip(seq_lens, self.seq_lens)) or len(seq_lens) != len(self.seq_lens):
            raise ValueError(f"truncate: seq_lens {list(seq_lens)} must be per request and <= {list(self.seq_lens)}")
        return replace(self, seq_lens=tuple(int(n) for n in seq_lens))

    def kv_bytes(self) -> int:
        """Bytes of cache storage (all layers, all rows)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.k_index) if t is not None)


@dataclass
class DenseStep:
    """One step on a :class:`DenseKVCache`; ``positions``: [T] int64 (RoPE positions of the step's tokens)."""

    cache: DenseKVCache
    new_lens: tuple[int, ...]
    positions: torch.Tensor = field(init=False)

    def __post_init__(self):
        dev = self.cache.k[0].device
        self.positions = torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(self.cache.seq_lens, self.new_lens)]
            or [torch.zeros(0, dtype=torch.int64)]
        ).to(dev)
        self.cu_q = cumsum(self.new_lens).to(dev)
        self._cq = self.cu_q.tolist()  # host copy, once per step (not per layer)
        self.cu_k = cumsum([s + n for s, n in zip(self.cache.seq_lens, self.new_lens)]).to(dev)
        self._start = None  # DSA: [T] key start of each query, built by the first shared layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Store k/v ([T, Hkv, D*]) of this step, attend q [T, Hq, Dk] causally; returns [T, Hq, Dv]."""
        c, lay = self.cache, self.cache.layouts[layer]
        kk = self._append(c.k[layer], k)  # [sum S_b, Hkv, Dk]
        vv = kk[..., : lay.v_head_dim] if lay.values_in_keys else self._append(c.v[layer], v)
        out, _ = attention_with_lse(q, kk, vv, self.cu_q, self.cu_k, causal=True, softmax_scale=scale)
        return out

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float, *, return_selection: bool = False):
        """DeepSeek sparse attention (:func:`cpattn.dsa.dsa_attention`) over the cache.

        q: [T, H, Dqk] absorbed queries; kv: [T, 1, Dqk] latent rows; q_index:
        [T, H_I, D_I]; w_index: [T, H_I]; k_index: [T, D_I]. Stores kv and
        k_index, returns out [T, H, v_head_dim]; with ``return_selection``
        also the selection (request-local key positions [T, topk] int32, -1
        padded) for :meth:`dsa_shared`.
        """
        c, lay = self.cache, self.cache.layouts[layer]
        lat = self._append(c.k[layer], kv)[:, 0]  # [sum S_b, Dqk]
        keys = self._append(c.k_index[layer], k_index)  # [sum S_b, D_I]
        return dsa_attention(q, lat, q_index, w_index, keys, self.cu_q, self.cu_k, topk=topk, softmax_scale=scale,
                             v_head_dim=lay.v_head_dim, return_indices=return_selection)

    def dsa_shared(self, layer: int, q: torch.Tensor, kv: torch.Tensor, selection: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """Sparse attention of a layer without an indexer, over the keys ``selection`` names
        (from an earlier layer's :meth:`dsa`). Stores kv [T, 1, Dqk]; q [T, H, Dqk] -> out [T, H, v_head_dim]."""
        c, lay = self.cache, self.cache.layouts[layer]
        lat = self._append(c.k[layer], kv)[:, 0]  # [sum S_b, Dqk]
        start = self._key_start()  # [T]
        rows = torch.where(selection >= 0, start[:, None] + selection, -1)  # [T, topk] rows of lat
        out, _ = sparse_mla_attention_with_lse(q, lat, rows, softmax_scale=scale, v_head_dim=lay.v_head_dim)
        return out

    def _key_start(self) -> torch.Tensor:
        """[T] first packed key row of each query's request (the same for every layer of the step)."""
        if self._start is None:
            self._start = causal_key_ranges(self._cq, self.cu_k.tolist())[0].to(self.cu_q.device)
        return self._start

    def _append(self, buf: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write this step's rows ``new`` [T, ...] into ``buf`` [B, max_len, ...] (the explicit cache write);
        return every request's rows so far, packed [sum S_b, ...]."""
        cq, rows = self._cq, []
        for b, (start, n) in enumerate(zip(self.cache.seq_lens, self.new_lens)):
            buf[b, start : start + n] = new[cq[b] : cq[b + 1]]
            rows.append(buf[b, : start + n])
        return torch.cat(rows)

    def fused_cache(self, layer: int) -> None:
        """None: this step writes its rows into the dense cache itself."""
        return None

    def finish(self) -> DenseKVCache:
        """The cache after this step (same tensors, longer ``seq_lens``)."""
        c = self.cache
        return replace(c, seq_lens=tuple(s + n for s, n in zip(c.seq_lens, self.new_lens)))
