"""``V4Step``: one step of DeepSeek-V4 attention layers over a :class:`~cpattn.v4.cache.V4Cache`.

The same step runs on one device and on each rank of a DCP group:

- plan (host, once per step, shared by every layer of a kind): positions,
  ring plans (:func:`cpattn.v4.ring.ring_plan`), the windows that complete
  (their slot rows), the entry slots this rank owns, visible entry counts;
- run (:meth:`V4Step.attend`, per layer): write the window ring, attend the
  window (with the sink, for this rank's heads); compress the completed
  windows and write the entries this rank owns; attend the entries (HCA:
  every visible local entry; CSA: the exact global top-k, see
  :func:`cpattn.dsa.dsa_dcp_topk`); merge; under DCP merge the ranks' partials.

DCP keeps the rings -- window and compressor state, a few hundred rows per
request -- replicated on every rank: every rank computes the new token's
K = V row anyway (one KV head, not split by tensor parallelism), so
replicas cost no communication, rewind locally, and the window's work is
split by heads instead (rank r: heads ``r H/N .. (r+1) H/N``). Only the
entry caches, which grow with the context, are sharded (interleaved).

Example
-------
>>> import torch
>>> from cpattn.v4.cache import V4Cache, V4Layout
>>> from cpattn.v4.attention import LayerInput
>>> lay = V4Layout(kinds=("sliding",), head_dim=8, window=4, block_size=2)
>>> step = V4Step(V4Cache.empty(lay, batch=1, max_len=16), [5])
>>> out = step.attend(0, LayerInput(torch.randn(5, 2, 8), torch.randn(5, 8), torch.zeros(2), 8**-0.5))
>>> out.shape, step.finish().seq_lens
(torch.Size([5, 2, 8]), (5,))
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch

from cpattn.comm.group import Group
from cpattn.dcp import dcp_merge as merge_partials
from cpattn.dsa import ShardedKeys, dsa_dcp_topk
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.layout.pcp import chunk_bounds
from cpattn.layout.rows import cu_seqlens, request_of
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.ref import acc_dtype
from cpattn.ops.rows import write_rows
from cpattn.ops.window_attention import window_attention_with_lse
from cpattn.v4.attention import LayerInput, compress, csa_select, head_slice, merge, sparse_partial
from cpattn.v4.cache import V4Cache
from cpattn.v4.ring import RingPlan, ring_commit, ring_extend, ring_plan, ring_slots


@dataclass(frozen=True)
class KindPlan:
    """A step's plan for the compressed layers of one kind ("csa" or "hca").

    raw: the compressor ring's :class:`RingPlan`; rows / prev_rows: [W, m]
    slots (in ``raw.table``'s ring) of the windows that complete in this
    step (prev_rows: the previous window's, CSA only; -1 for entry 0);
    entry_pos: [W] RoPE positions ``e * m``; entry_slots: [W] where this rank
    writes each entry (-1: another rank owns it); local_visible: [T] local
    entries each row sees. CSA only: key_slots [S] (every local entry after
    the step, packed per request), key_ids [S] (their entry ids), key_cu
    [B+1], entry_visible [T] (global count, ``(p + 1) // m``).
    """

    raw: RingPlan
    rows: torch.Tensor
    prev_rows: torch.Tensor | None
    entry_pos: torch.Tensor
    entry_slots: torch.Tensor
    local_visible: torch.Tensor
    key_slots: torch.Tensor | None = None
    key_ids: torch.Tensor | None = None
    key_cu: torch.Tensor | None = None
    entry_visible: torch.Tensor | None = None


class V4Step:
    """One step of ``query_lens[b]`` new tokens per request over ``cache`` (see the module doc).

    group: the DCP group (its rank and size must match the cache's), or
    None on one device. ``positions`` [T] are the new tokens' positions.
    """

    def __init__(self, cache: V4Cache, query_lens: list[int] | tuple[int, ...], group: Group | None = None):
        if len(query_lens) != cache.batch:
            raise ValueError(f"query_lens must hold one count per request ({cache.batch}); got {list(query_lens)}")
        if group is not None and (group.size, group.rank) != (cache.dcp_size, cache.dcp_rank):
            raise ValueError(
                f"the cache is DCP rank {cache.dcp_rank} of {cache.dcp_size} but the group is rank "
                f"{group.rank} of {group.size}; build the cache with the group's rank and size"
            )
        if group is None and cache.dcp_size > 1:
            raise ValueError(f"the cache is sharded over {cache.dcp_size} DCP ranks; pass its group")
        self.cache, self.group = cache, group
        self.query_lens = [int(n) for n in query_lens]
        self.context_lens = list(cache.seq_lens)
        for b, (l, n) in enumerate(zip(self.context_lens, self.query_lens)):
            if n < 0 or (cache.max_len and l + n > cache.max_len):
                raise ValueError(
                    f"request {b}: {l} cached + {n} new tokens; a step adds >= 0 tokens and the cache holds at "
                    f"most max_len={cache.max_len} per request. Build the cache with a larger max_len"
                )
        dev = cache.tables["window"].device
        self.cu_q = cu_seqlens(self.query_lens)
        self.req = request_of(self.cu_q).to(dev)
        self.positions = torch.cat(
            [torch.arange(l, l + n) for l, n in zip(self.context_lens, self.query_lens)] or [torch.zeros(0)]
        ).long().to(dev)
        lay = cache.layout
        self.window_plan = ring_plan(cache.tables["window"], lay.block_size, lay.back("window"),
                                     self.context_lens, self.query_lens)
        self._kind_plans: dict[str, KindPlan] = {}

    # ------------------------------------------------------------------ plan
    def kind_plan(self, kind: str) -> KindPlan:
        """The (cached) plan of the compressed layers of ``kind``."""
        if kind not in self._kind_plans:
            self._kind_plans[kind] = self._plan_kind(kind)
        return self._kind_plans[kind]

    def _plan_kind(self, kind: str) -> KindPlan:
        c, lay = self.cache, self.cache.layout
        bs, m, dev = lay.block_size, lay.ratio(kind), self.positions.device
        raw = ring_plan(c.tables[f"raw_{kind}"], bs, lay.back(f"raw_{kind}"), self.context_lens, self.query_lens)
        wins = [(b, e) for b, (l, n) in enumerate(zip(self.context_lens, self.query_lens))
                for e in range(l // m, (l + n) // m)]
        w_req = torch.tensor([b for b, _ in wins], dtype=torch.int64, device=dev)
        w_e = torch.tensor([e for _, e in wins], dtype=torch.int64, device=dev)
        j = torch.arange(m, device=dev)
        rows = ring_slots(raw.table, bs, w_req[:, None].expand(-1, m).reshape(-1),
                          (w_e[:, None] * m + j).reshape(-1)).view(-1, m)  # [W, m]
        prev = None
        if kind == "csa":
            prev_pos = ((w_e[:, None] - 1) * m + j).clamp(min=0)
            prev = ring_slots(raw.table, bs, w_req[:, None].expand(-1, m).reshape(-1), prev_pos.reshape(-1)).view(-1, m)
            prev = torch.where((w_e > 0)[:, None], prev, -1)
        table = c.tables[f"ent_{kind}"]
        slots = dcp_slot_mapping(w_e, w_req, table, dcp_rank=c.dcp_rank, dcp_size=c.dcp_size,
                                 interleave_size=c.interleave_size, block_size=bs)
        visible = torch.div(self.positions + 1, m, rounding_mode="floor")  # [T] entries each row sees
        local = dcp_local_lens(visible, c.dcp_size, c.interleave_size)[:, c.dcp_rank] if visible.numel() else visible
        plan = KindPlan(raw, rows, prev, w_e * m, slots, local)
        if kind != "csa":
            return plan
        # every local CSA entry after this step, packed per request (the indexer's keys)
        n_after = torch.tensor([(l + n) // m for l, n in zip(self.context_lens, self.query_lens)], dtype=torch.int64)
        n_local = dcp_local_lens(n_after, c.dcp_size, c.interleave_size)[:, c.dcp_rank].tolist()
        cu_k = cu_seqlens(n_local)
        k_req = request_of(cu_k).to(dev)
        li = torch.cat([torch.arange(n) for n in n_local] or [torch.zeros(0)]).long().to(dev)  # local index
        n_i, size = c.interleave_size, c.dcp_size
        ids = torch.div(li, n_i, rounding_mode="floor") * (n_i * size) + c.dcp_rank * n_i + li % n_i  # entry id
        key_slots = table[k_req, torch.div(li, bs, rounding_mode="floor")].long() * bs + li % bs
        key_cu = torch.tensor(cu_k, dtype=torch.int64, device=dev)
        return replace(plan, key_slots=key_slots, key_ids=ids, key_cu=key_cu,
                       entry_visible=visible)

    # ------------------------------------------------------------------ run
    def attend(self, layer: int, inp: LayerInput) -> torch.Tensor:
        """Layer ``layer``'s attention output [T, H, D] (the same on every DCP rank); writes its caches."""
        c, lay = self.cache, self.cache.layout
        kind = lay.kinds[layer]
        heads = inp.q.shape[1]
        n, r = c.dcp_size, c.dcp_rank
        h0, h1 = chunk_bounds(heads, n)[r : r + 2]
        # 1. the sliding window, with the sink, for this rank's heads
        rows = inp.kv[:, None, :]  # [T, 1, D]
        ring = ring_extend(c.window[layer], self.window_plan, rows)
        o, l = window_attention_with_lse(
            inp.q[:, h0:h1], ring, ring, self.window_plan.table, self.req, self.positions - lay.window + 1,
            self.positions + 1, softmax_scale=inp.scale, sinks=inp.sinks[h0:h1])
        ring_commit(c.window[layer], self.window_plan, rows)
        parts = [head_slice(o, l, h0, h1, heads)]
        # 2. compressed entries
        if kind != "sliding":
            plan = self.kind_plan(kind)
            self._write_entries(c.raw[layer], c.entries[layer], plan, inp.compression)
            if kind == "hca":
                parts.append(paged_attention_with_lse(
                    inp.q, c.entries[layer], c.entries[layer], c.tables["ent_hca"], self.req, plan.local_visible,
                    softmax_scale=inp.scale))
            else:
                self._write_entries(c.index_raw[layer], c.index_keys[layer], plan, inp.index_compression)
                parts.append(self._csa_partial(layer, inp, plan))
        out, lse = merge(parts)
        if n > 1:
            out, lse = merge_all(out, lse, self.group)
        return out.to(inp.q.dtype)

    def _write_entries(self, raw_cache, entry_cache, plan: KindPlan, comp) -> None:
        """Extend the compressor ring with the step's ``[kv | gate]`` rows, pool the completed windows,
        finish them (RMSNorm, RoPE) and write the ones this rank owns."""
        src = torch.cat([comp.kv, comp.gate], dim=-1)  # [T, 2C]
        ring = ring_extend(raw_cache, plan.raw, src)
        if plan.rows.shape[0]:
            entries = compress(comp, ring, plan.rows, plan.prev_rows, plan.entry_pos)  # [W, D]
            write_rows(entry_cache, entries.view(-1, *entry_cache.shape[2:]), plan.entry_slots)
        ring_commit(raw_cache, plan.raw, src)

    def _csa_partial(self, layer: int, inp: LayerInput, plan: KindPlan):
        c = self.cache
        di = c.index_keys[layer].shape[-1]
        keys = c.index_keys[layer].view(-1, di)[plan.key_slots]  # [S, D_I] local keys, packed per request
        lens = (plan.key_cu[1:] - plan.key_cu[:-1]).tolist()
        if c.dcp_size == 1:
            local = csa_select(inp.index_q, inp.index_weights, keys, plan.key_cu[self.req], plan.local_visible,
                               inp.topk, max(lens, default=0))  # [T, k] entry ids
            rows = torch.where(local >= 0, plan.key_cu[self.req][:, None] + local, -1)
        else:
            # key "position" e + 1 <= row "position" (p + 1) // m: entry e is visible (no negative positions);
            # ids shifted by one keep their order, so the (score desc, id asc) selection is unchanged
            # no latent rows: the entries stay in their paged cache
            sharded = ShardedKeys(keys.new_empty(keys.shape[0], 0), keys, plan.key_ids + 1, plan.key_cu)
            _, rows = dsa_dcp_topk(inp.index_q, inp.index_weights, plan.entry_visible, self.cu_q, sharded,
                                   group=self.group, topk=inp.topk)  # rows of `keys` this rank owns
        slots = torch.where(rows >= 0, plan.key_slots[rows.clamp(min=0)] if plan.key_slots.numel() else rows, -1)
        return sparse_partial(inp.q, c.entries[layer], slots, inp.scale)

    def finish(self) -> V4Cache:
        """The cache after this step: lengths advanced (tensors were written in place)."""
        lens = tuple(l + n for l, n in zip(self.context_lens, self.query_lens))
        high = tuple(max(h, n) for h, n in zip(self.cache.high_water, lens))
        return replace(self.cache, seq_lens=lens, high_water=high)


def merge_all(out: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial (out [T, H, D], lse [T, H]) of every head, in ``acc_dtype(out)``:
    :func:`cpattn.dcp.dcp_merge` with ``merge="ag"`` (one all-gather, then an N-way merge; N > 1).

    Returns out [T, H, D] and lse [T, H], the same on every rank.

    >>> import torch, cpattn
    >>> from cpattn.ops import merge_attn_states
    >>> o, l = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1)  # rank r's partial is o[r], l[r]
    >>> outs = cpattn.simulate(2, lambda g: merge_all(o[g.rank], l[g.rank], g)[0])
    >>> bool(torch.allclose(outs[0], merge_attn_states(o, l)[0])) and bool(torch.equal(outs[0], outs[1]))
    True
    """
    wide = acc_dtype(out)
    return merge_partials(out.to(wide), lse.to(wide), group=group, merge="ag")


def dcp_merge(out: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Deprecated: :func:`merge_all` (``cpattn.dcp.dcp_merge(..., merge="ag")`` in ``acc_dtype(out)``)."""
    warnings.warn("cpattn.v4.step.dcp_merge is deprecated; use cpattn.v4.step.merge_all "
                  "(cpattn.dcp.dcp_merge(out, lse, group=g, merge='ag'))", DeprecationWarning, stacklevel=2)
    return merge_all(out, lse, group)
