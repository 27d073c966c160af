"""Explicit KV caches and the attention steps the reference models call.

A model's forward takes one *step* object (see
:class:`cpattn.models.common.Attention`): it knows this step's token
positions and, per layer, stores the new keys/values in its cache and
returns the attention output. Three layouts:

- :class:`DenseKVCache` / :class:`DenseStep`: one device, contiguous
  per-request cache; prefill and decode alike (bottom-right causal).
- :class:`PCPStep`: prefill with the new tokens split head-tail over a PCP
  group (:func:`cpattn.pcp_prefill`); it keeps this rank's K/V per layer so
  the caller can hand them to a decode cache afterwards.
- DCP decode over a paged, sharded cache lives in :mod:`cpattn.models.dcp_cache`.

Values may be ``None`` (``v = k[..., :dv]``): the MLA latent cache, where
one row ``[latent | rope key]`` serves as both key and value.

Example
-------
>>> import torch
>>> cache = DenseKVCache.empty(num_layers=1, batch=1, max_len=8, kv_heads=2, dk=4, dv=4)
>>> step = cache.step([3])
>>> out = step(0, torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), 0.5)
>>> out.shape, step.finish().seq_lens
(torch.Size([3, 2, 4]), (3,))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from cpattn.comm.group import Group
from cpattn.dsa import DSACPPlan, dsa_attention, dsa_cp_attention
from cpattn.layout.pcp import PCPPlan
from cpattn.ops import attention_with_lse
from cpattn.pcp import pcp_prefill


def _cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


@dataclass(frozen=True)
class DenseKVCache:
    """Contiguous KV cache of B requests on one device.

    k[l]: [B, S_max, Hkv, Dk]; v[l]: [B, S_max, Hkv, Dv], or ``None`` when
    values are the first ``dv`` dims of k (MLA latent cache). ``seq_lens``:
    tokens stored per request (host ints). Rows past ``seq_lens`` are never
    read. The tensors are written in place by :class:`DenseStep` (the one
    side effect); the lengths only change through :meth:`DenseStep.finish`.
    ``ik[l]``: [B, S_max, D_I], the DSA indexer keys (DeepSeek-V3.2 only).
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor | None, ...]
    seq_lens: tuple[int, ...]
    dv: int
    ik: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def empty(
        cls,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        dk: int,
        dv: int,
        shared_v: bool = False,
        index_dim: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        poison: bool = True,
    ) -> DenseKVCache:
        """An empty cache; unused rows hold NaN when ``poison`` (they must never be read).

        ``index_dim > 0`` adds a DSA indexer-key cache of that width.
        """
        fill = float("nan") if poison else 0.0
        k = tuple(torch.full((batch, max_len, kv_heads, dk), fill, dtype=dtype, device=device) for _ in range(num_layers))
        v = tuple(
            None if shared_v else torch.full((batch, max_len, kv_heads, dv), fill, dtype=dtype, device=device)
            for _ in range(num_layers)
        )
        ik = None
        if index_dim:
            ik = tuple(torch.full((batch, max_len, index_dim), fill, dtype=dtype, device=device) for _ in range(num_layers))
        return cls(k, v, (0,) * batch, dv, ik)

    @classmethod
    def from_packed(
        cls,
        k: list[torch.Tensor],
        v: list[torch.Tensor | None],
        cu_seqlens: torch.Tensor | list[int],
        *,
        max_len: int,
        dv: int,
        ik: list[torch.Tensor] | None = None,
    ) -> DenseKVCache:
        """A cache holding packed per-layer KV (k[l]: [T, Hkv, Dk], requests by ``cu_seqlens`` [B+1]).

        ik[l]: [T, D_I] packed DSA indexer keys, when the model has them.
        """
        cu = [int(c) for c in cu_seqlens]
        lens = [b - a for a, b in zip(cu, cu[1:])]
        if max(lens, default=0) > max_len:
            raise ValueError(f"a request holds {max(lens)} tokens but max_len is {max_len}; raise max_len")
        shared = v[0] is None
        cache = cls.empty(
            num_layers=len(k), batch=len(lens), max_len=max_len, kv_heads=k[0].shape[1], dk=k[0].shape[2],
            dv=dv, shared_v=shared, index_dim=0 if ik is None else ik[0].shape[-1], dtype=k[0].dtype,
            device=k[0].device,
        )
        for layer in range(len(k)):
            for b, (s, e) in enumerate(zip(cu, cu[1:])):
                cache.k[layer][b, : e - s] = k[layer][s:e]
                if not shared:
                    cache.v[layer][b, : e - s] = v[layer][s:e]
                if ik is not None:
                    cache.ik[layer][b, : e - s] = ik[layer][s:e]
        return replace(cache, seq_lens=tuple(lens))

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

    def kv_bytes(self) -> int:
        """Bytes of cache storage (all layers, all rows)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *(self.ik or ())) if t is not None)


@dataclass
class DenseStep:
    """One step on a :class:`DenseKVCache` (see module doc); ``positions``: [T] int64."""

    cache: DenseKVCache
    new_lens: tuple[int, ...]
    positions: torch.Tensor = field(init=False)

    def __post_init__(self):
        dev = self.cache.k[0].device
        self.positions = torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(self.cache.seq_lens, self.new_lens)]
            or [torch.zeros(0, dtype=torch.int64)]
        ).to(dev)
        self.cu_q = _cu(self.new_lens).to(dev)
        self._cq = self.cu_q.tolist()  # host copy, once per step (not per layer)
        self.cu_k = _cu([s + n for s, n in zip(self.cache.seq_lens, self.new_lens)]).to(dev)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Store k/v ([T, Hkv, D*]) of this step, attend q [T, Hq, Dk] causally; returns [T, Hq, Dv]."""
        c = self.cache
        kk = self._append(c.k[layer], k)  # [sum S_b, Hkv, Dk]
        vv = kk[..., : c.dv] if c.v[layer] is None else self._append(c.v[layer], v)  # MLA: values are latent dims
        out, _ = attention_with_lse(q, kk, vv, self.cu_q, self.cu_k, causal=True, softmax_scale=scale)
        return out

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """DeepSeek sparse attention (:func:`cpattn.dsa.dsa_attention`) over the cache.

        q: [T, H, Dqk] absorbed queries; kv: [T, 1, Dqk] latent rows;
        q_index: [T, H_I, D_I]; w_index: [T, H_I]; k_index: [T, D_I].
        Stores kv and k_index, returns out [T, H, dv].
        """
        c = self.cache
        lat = self._append(c.k[layer], kv)[:, 0]  # [sum S_b, Dqk]
        keys = self._append(c.ik[layer], k_index)  # [sum S_b, D_I]
        return dsa_attention(q, lat, q_index, w_index, keys, self.cu_q, self.cu_k,
                             topk=topk, softmax_scale=scale, value_dim=c.dv)

    def _append(self, buf: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write this step's rows ``new`` [T, ...] into ``buf`` [B, max_len, ...] (the explicit cache write);
        return every request's rows so far, packed [sum S_b, ...]."""
        cq, rows = self._cq, []
        for b, (start, n) in enumerate(zip(self.cache.seq_lens, self.new_lens)):
            buf[b, start : start + n] = new[cq[b] : cq[b + 1]]
            rows.append(buf[b, : start + n])
        return torch.cat(rows)

    def finish(self) -> DenseKVCache:
        """The cache after this step (same tensors, longer ``seq_lens``)."""
        c = self.cache
        return replace(c, seq_lens=tuple(s + n for s, n in zip(c.seq_lens, self.new_lens)))


@dataclass
class PCPStep:
    """Prefill attention over a PCP group: this rank's tokens of a head-tail split.

    ``positions``: [T_r] global positions from the plan (RoPE must use them).
    After the forward, ``kv[l] = (k, v, None)`` holds this rank's keys/values
    of layer l ([T_r, Hkv, D*]; v may be None), in the plan's local order;
    ``pcp_unshard`` restores request order.
    """

    group: Group
    plan: PCPPlan
    dv: int
    method: str = "ring"
    kv: dict = field(default_factory=dict)

    def __post_init__(self):
        self.positions = self.plan.positions[self.group.rank]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q: [T_r, Hq, Dk], k: [T_r, Hkv, Dk], v: [T_r, Hkv, Dv] or None. Returns [T_r, Hq, Dv]."""
        self.kv[layer] = (k, v, None)
        vv = k[..., : self.dv] if v is None else v
        return pcp_prefill(q, k, vv, self.plan, group=self.group, method=self.method, softmax_scale=scale)


@dataclass
class DSACPStep:
    """Prefill of a DSA model (DeepSeek-V3.2) with tokens split over a DSA-CP group.

    ``plan`` from :func:`cpattn.dsa.dsa_cp_plan` (``split="balanced"``: the
    PCP head-tail chunks; ``"contiguous"``: the guide's DSA-CP). Each rank
    keeps all heads of its tokens; latents and indexer keys are all-gathered
    into a replicated cache (:func:`cpattn.dsa.dsa_cp_attention`).
    ``positions``: [T_r]; after the forward ``kv[l] = (latent [T_r, 1, Dqk],
    None, k_index [T_r, D_I])`` of this rank's tokens.
    """

    group: Group
    plan: DSACPPlan
    dv: int
    kv: dict = field(default_factory=dict)

    def __post_init__(self):
        self.positions = self.plan.positions[self.group.rank]

    def __call__(self, layer, q, k, v, scale):
        raise TypeError("DSACPStep serves DSA layers only; call step.dsa(...)")

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """As :meth:`DenseStep.dsa`, for this rank's tokens; returns out [T_r, H, dv]."""
        self.kv[layer] = (kv, None, k_index)
        return dsa_cp_attention(q, kv[:, 0], q_index, w_index, k_index, self.plan, group=self.group, topk=topk,
                                softmax_scale=scale, value_dim=self.dv)
