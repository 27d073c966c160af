"""Attention steps of a prefill whose tokens are split over a group (PCP, or DSA-CP for DSA models).

A model's forward calls ``step(layer, q, k, v, scale)`` (or ``step.dsa(...)``)
on this rank's tokens; the step runs the parallel attention and keeps the
layer's new K/V (``kv[layer] = (k, v, k_index)``, this rank's tokens in the
plan's local order) so the engine can hand them to a decode cache. A cached
prefix (prefix caching, a KV-pool hit) is a :class:`Prefix`: every new token
attends all of its request's cached tokens.

- :class:`PCPStep`: :func:`cpattn.pcp_prefill` over a head-tail
  :func:`cpattn.pcp_plan` (ring or all-gather); one rank is plain prefill.
- :class:`DSACPStep`: :func:`cpattn.dsa.dsa_cp_attention` over a
  :func:`cpattn.dsa.dsa_cp_plan` (balanced head-tail or contiguous split);
  a layer without an indexer (GLM-5's shared layers) reuses the selection
  its rank computed on an earlier layer over the replicated cache
  (:func:`cpattn.dsa.dsa_cp_sparse_attention`): no indexer, no indexer keys.

Example
-------
>>> import torch, cpattn
>>> from cpattn.models.family import KVLayout
>>> plan = cpattn.pcp_plan([0, 6], 1)
>>> step = PCPStep(cpattn.comm.SimMesh(1).groups()[0], plan, (KVLayout(1, 8, 8),))
>>> step(0, torch.randn(6, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8), 0.3).shape
torch.Size([6, 2, 8])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cpattn.comm.group import Group
from cpattn.dsa import DSACache, DSACPPlan, dsa_cp_attention, dsa_cp_sparse_attention
from cpattn.models.family import KVLayout
from cpattn.engine.kv_rows import unpack_rows
from cpattn.layout.pcp import PCPPlan
from cpattn.layout.rows import cu_seqlens
from cpattn.ops import attention_with_lse
from cpattn.pcp import Context, pcp_prefill


@dataclass(frozen=True)
class Prefix:
    """A request's prefix: the cached KV of the tokens before its new ones (every layer, packed rows),
    replicated on every prefill rank; each layer's part is that layer's :class:`cpattn.Context`
    (docs/engine.md "Words": prefix, context).

    rows: [Tc, F] (:mod:`cpattn.engine.kv_rows`), request b's rows are
    ``rows[cu[b]:cu[b+1]]`` with ``cu = cumsum(context_lens)``; context_lens: per request.
    """

    rows: torch.Tensor
    context_lens: tuple[int, ...]


class LayerRows(NamedTuple):
    """One layer's rows this prefill rank computed, in the plan's local order (what the hand-off ships).

    k: [T_r, Hkv, Dk] keys (an MLA / DSA latent [T_r, 1, Dqk]); v: [T_r, Hkv, Dv] or None when the values
    live in the keys; k_index: [T_r, D_I] indexer keys of a full DSA layer, else None.
    """

    k: torch.Tensor
    v: torch.Tensor | None = None
    k_index: torch.Tensor | None = None


@dataclass
class _SplitPrefill:
    """What a prefill step over a token split holds: the group, the plan, the layouts, an optional cached
    prefix, and ``kv[l]``, layer l's :class:`LayerRows` of this rank's tokens after the forward.
    ``positions``: [T_r] global positions from the plan (RoPE must use them)."""

    group: Group
    plan: PCPPlan | DSACPPlan
    layouts: tuple[KVLayout, ...]
    prefix: Prefix | None = None
    kv: dict = field(default_factory=dict)

    def __post_init__(self):
        self.positions = self.plan.positions[self.group.rank]
        self._context = _split_prefix(self.prefix, self.layouts)

    def fused_cache(self, layer: int) -> None:
        """None: a prefill step keeps this rank's rows for the hand-off itself."""
        return None


@dataclass
class PCPStep(_SplitPrefill):
    """Prefill attention over a PCP group: this rank's tokens of a head-tail split (``method``: "ring" or
    "allgather"); fields as :class:`_SplitPrefill`."""

    method: str = "ring"

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q: [T_r, Hq, Dk], k: [T_r, Hkv, Dk], v: [T_r, Hkv, Dv] or None. Returns [T_r, Hq, Dv]."""
        self.kv[layer] = LayerRows(k, v)
        lay = self.layouts[layer]
        vv = k[..., : lay.v_head_dim] if lay.values_in_keys else v
        if self._context is not None and self.method == "allgather" and self.group.size > 1:
            return self._with_context(layer, q, k, vv, scale)
        ctx = None
        if self._context is not None:
            ck, cv, _, cu = self._context[layer]
            ctx = Context(ck, ck[..., : lay.v_head_dim] if lay.values_in_keys else cv, cu)
        return pcp_prefill(q, k, vv, self.plan, group=self.group, method=self.method, softmax_scale=scale,
                           context=ctx)

    def _with_context(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """The all-gather method over a cached context: the chunk's K/V gathered once, then each local part
        (A, B) attends its request's cached context and the chunk up to its own end in one causal call
        (bottom-right: the part's queries are the last keys), so no partial is merged afterwards.
        q [T_r, Hq, Dk], k [T_r, Hkv, Dk], v [T_r, Hkv, Dv] -> [T_r, Hq, Dv]."""
        plan, r, dk = self.plan, self.group.rank, k.shape[-1]
        ck, cv, _, _ = self._context[layer]
        cv = ck[..., : v.shape[-1]] if self.layouts[layer].values_in_keys else cv
        kv = torch.nn.functional.pad(torch.cat([k, v], dim=-1), (0, 0, 0, 0, 0, plan.max_tokens - k.shape[0]))
        gathered = self.group.all_gather(kv)  # [P * max_tokens, Hkv, Dk + Dv], rank-major
        na, outs, parts = plan.num_a(r), [], self._fused
        tc = ck.shape[0]
        if parts[0] == "one":  # one request: [context | chunk in order]; each part's keys are a prefix of it
            _, order, ends = parts
            pool = gathered.new_empty(tc + order.numel(), *gathered.shape[1:])
            pool[:tc, :, :dk], pool[:tc, :, dk:] = ck, cv
            torch.index_select(gathered, 0, order.to(gathered.device), out=pool[tc:])
            parts = [(slice(None, tc + e), torch.tensor([0, tc + e], dtype=torch.int32)) for e in ends]
        else:  # [context | gathered] and, per part, the rows each request attends
            pool = torch.cat([torch.cat([ck, cv], dim=-1).to(kv.dtype), gathered])
        for rows, cu_q, (idx, cu_k) in ((slice(0, na), plan.cu_a[r], parts[0]),
                                        (slice(na, q.shape[0]), plan.cu_b[r], parts[1])):
            keys = pool[idx] if isinstance(idx, slice) else pool[idx.to(pool.device)]
            out, _ = attention_with_lse(q[rows], keys[..., :dk], keys[..., dk:], cu_q.to(q.device),
                                        cu_k.to(q.device), causal=True, softmax_scale=scale)
            outs.append(out)
        return torch.cat(outs).to(q.dtype)

    def __post_init__(self):
        super().__post_init__()
        self._fused = None if self._context is None else _fused_index(self.plan, self.group.rank, self.prefix)


@dataclass
class DSACPStep(_SplitPrefill):
    """Prefill of a DSA model with its tokens split over a DSA-CP group.

    Each rank keeps all heads of its tokens; latents and indexer keys are
    all-gathered into a replicated cache (:func:`cpattn.dsa.dsa_cp_attention`).
    Fields as :class:`_SplitPrefill`; ``kv[l]`` holds the latent [T_r, 1, Dqk]
    and, for a full layer, k_index.
    """

    def __call__(self, layer, q, k, v, scale):
        raise TypeError("DSACPStep serves DSA layers only; the model must call step.dsa(...)")

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float, *, return_selection: bool = False):
        """q [T_r, H, Dqk], kv [T_r, 1, Dqk], q_index [T_r, H_I, D_I], w_index [T_r, H_I], k_index [T_r, D_I]
        -> out [T_r, H, v_head_dim]; with ``return_selection`` also the selection (this rank's rows
        [T_r, topk] of the replicated cache, -1 padded) for :meth:`dsa_shared`."""
        self.kv[layer] = LayerRows(kv, None, k_index)
        return dsa_cp_attention(q, kv[:, 0], q_index, w_index, k_index, self.plan, group=self.group, topk=topk,
                                softmax_scale=scale, v_head_dim=self.layouts[layer].v_head_dim,
                                cache=self._cache(layer, kv, k_index), return_indices=return_selection)

    def dsa_shared(self, layer: int, q: torch.Tensor, kv: torch.Tensor, selection: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """A layer without an indexer reusing an earlier layer's selection: its latents are all-gathered into
        a replicated cache laid out like the full layer's (same rows), attended at ``selection``.
        q [T_r, H, Dqk], kv [T_r, 1, Dqk] -> out [T_r, H, v_head_dim]."""
        self.kv[layer] = LayerRows(kv)
        return dsa_cp_sparse_attention(q, kv[:, 0], selection, self.plan, group=self.group, softmax_scale=scale,
                                       v_head_dim=self.layouts[layer].v_head_dim, cache=self._cache(layer, kv, None))

    def _cache(self, layer: int, kv: torch.Tensor, k_index: torch.Tensor | None) -> DSACache | None:
        """A replicated cache holding the prefix rows where the plan expects them (None without a prefix).

        Rows no request owns stay NaN (never read); a layer without an indexer gets no indexer keys.
        """
        if self._context is None:
            return None
        ck, _, cki, cu = self._context[layer]
        size = self.plan.cache_size
        latent = kv.new_full((size, kv.shape[-1]), float("nan"))
        keys = None if k_index is None else k_index.new_full((size, k_index.shape[-1]), float("nan"))
        for b, start in enumerate(self.plan.cache_starts):
            a, e = int(cu[b]), int(cu[b + 1])
            latent[start : start + e - a] = ck[a:e, 0]
            if keys is not None:
                keys[start : start + e - a] = cki[a:e]
        return DSACache(latent, keys)


def _fused_index(plan: PCPPlan, rank: int, prefix: Prefix) -> tuple:
    """For :meth:`PCPStep._with_context`: per local part (A, B), the rows of ``[context | gathered chunk]``
    each request's queries attend -- its cached context, then its chunk keys up to the part's end
    (``plan.prefix_index``) -- and their cu_seqlens [B+1]. One request: ``("one", order, ends)`` -- the
    gathered rows of the chunk in order [T] and each part's end, whose keys are then a prefix of
    ``[context | chunk]``."""
    cu_c = cu_seqlens(prefix.context_lens)
    total = cu_c[-1]
    if plan.num_requests == 1:  # ("one", gathered rows of the chunk in order [T], each part's end)
        where = torch.empty(plan.query_lens[0], dtype=torch.int64)
        for j, idx in enumerate(plan.token_index):
            where[idx] = j * plan.max_tokens + torch.arange(idx.numel())
        return "one", where, (plan.a_bounds[rank][0][1], plan.b_bounds[rank][0][1])
    parts = []
    for idx, cu_k in (plan.prefix_index[rank][:2], plan.prefix_index[rank][2:]):
        cu_k = cu_k.tolist()
        pieces = []
        for b in range(len(cu_c) - 1):
            pieces += [torch.arange(cu_c[b], cu_c[b + 1], dtype=torch.int64), total + idx[cu_k[b]:cu_k[b + 1]]]
        cu = torch.tensor([c + k for c, k in zip(cu_c, cu_k)], dtype=torch.int32)
        parts.append((torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64), cu))
    return tuple(parts)


def _split_prefix(prefix: Prefix | None, layouts: tuple[KVLayout, ...]):
    """Per layer (k, v, k_index, cu [B+1]) of a prefix, or None."""
    if prefix is None:
        return None
    cu = torch.tensor(cu_seqlens(prefix.context_lens), dtype=torch.int32)
    k, v, ki = unpack_rows(layouts, prefix.rows)
    return [(k[l], v[l], ki[l], cu) for l in range(len(layouts))]
