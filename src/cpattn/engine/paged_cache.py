"""The decode engine's cache: one DCP rank's share of a paged KV cache, and the DCP attention step.

Rank r of the N-rank DCP group keeps token t of every request iff
``(t // I) % N == r`` (:mod:`cpattn.layout.dcp`), in blocks of
``block_size`` rows addressed by one block table shared by the group. A
decode step writes the new tokens' KV where they are owned
(:func:`cpattn.ops.write_kv`, slot -1 elsewhere), then attends through
:func:`cpattn.dcp.dcp_decode`: query heads all-gathered, every rank attends
its shard, partials merged by LSE. DCP reuses TP ranks: rank r passes its
slice of the query heads and the outputs are all-gathered again (TP's
row-parallel output projection, done as a gather). Every rank holds all KV
heads. One rank (N = 1) is plain paged decode.

Example
-------
>>> import torch, cpattn
>>> from cpattn.models.family import KVLayout
>>> shard = PagedShard.empty((KVLayout(1, 8, 8),), capacity=[10], dcp_size=1, block_size=4, interleave_size=1)
>>> shard.block_table.tolist(), shard.k[0].shape
([[0, 1, 2]], torch.Size([4, 4, 1, 8]))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpattn.comm.group import Group
from cpattn.dcp import DCPMeta, dcp_decode
from cpattn.dcp.layer_merges import ENGINE_MERGE, ENGINE_MERGES, LAYER_MERGES, layer_merge
from cpattn.models.family import KVLayout, nan_caches
from cpattn.engine.kv_rows import unpack_rows
from cpattn.dsa.paged import dsa_topk, sparse_partials_merged
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.ops.rows import scatter_rows, write_kv, write_kv_mla


@dataclass(frozen=True)
class PagedShard:
    """One DCP rank's paged cache for every layer.

    k[l]: [num_blocks, block_size, Hkv, Dk]; v[l]: [.., .., Hkv, Dv] or None
    (values in the keys: ``k[l][..., :v_head_dim]``); k_index[l]: [num_blocks,
    block_size, D_I] DSA indexer keys or None. ``block_table``: [B, max_blocks],
    the same on every rank (one spare block nobody owns stays NaN). Unwritten
    rows hold NaN.
    """

    layouts: tuple[KVLayout, ...]
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor | None, ...]
    k_index: tuple[torch.Tensor | None, ...]
    block_table: torch.Tensor
    block_size: int
    interleave_size: int

    @classmethod
    def empty(cls, layouts: tuple[KVLayout, ...], *, capacity: list[int], dcp_size: int, block_size: int,
              interleave_size: int, dtype: torch.dtype = torch.float32, device="cpu") -> PagedShard:
        """A NaN-filled shard with room for ``capacity[b]`` tokens of request b (same shape on every rank)."""
        local = dcp_local_lens(torch.tensor(capacity), dcp_size, interleave_size).max(dim=1).values  # [B]
        per_req = max(1, -(-int(local.max()) // block_size))
        b = len(capacity)
        table = torch.arange(b * per_req, dtype=torch.int64, device=device).view(b, per_req)
        k, v, ki = nan_caches(tuple(layouts), (b * per_req + 1, block_size), dtype, device)
        return cls(tuple(layouts), k, v, ki, table, block_size, interleave_size)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor,
              k_index: torch.Tensor | None = None) -> None:
        """Store k [T, Hkv, Dk] (and v, and DSA indexer keys [T, D_I]) at ``slots`` [T] (-1: not this rank's);
        ``k=None``: the rows are already there (a fused op wrote them), only the indexer keys are stored."""
        lay = self.layouts[layer]
        if self.k_index[layer] is not None and k_index is not None:  # same slots, [num_blocks * block_size, D_I] rows
            scatter_rows(self.k_index[layer].view(-1, k_index.shape[-1]), k_index, slots)
        if k is None:
            return
        if lay.values_in_keys:
            write_kv_mla(self.k[layer], k[:, 0, : lay.v_head_dim], k[:, 0, lay.v_head_dim :], slots)
        else:
            write_kv(self.k[layer], self.v[layer], k, v, slots)

    def write_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Store packed rows [T, F] (:mod:`cpattn.engine.kv_rows`, every layer) at ``slots`` [T]."""
        k, v, ki = unpack_rows(self.layouts, rows)
        for layer in range(len(self.layouts)):
            self.write(layer, k[layer], v[layer], slots, ki[layer])

    def write_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Copy one whole block's rows [block_size, F] (every layer) into physical block ``block_id``."""
        k, v, ki = unpack_rows(self.layouts, payload)
        for layer in range(len(self.layouts)):
            self.k[layer][block_id] = k[layer]  # the explicit cache write: one whole block
            if v[layer] is not None:
                self.v[layer][block_id] = v[layer]
            if ki[layer] is not None:
                self.k_index[layer][block_id] = ki[layer]

    def read_block(self, block_id: int) -> torch.Tensor:
        """The rows [block_size, F] of physical block ``block_id`` (every layer), as :meth:`write_block` takes them."""
        from cpattn.engine.kv_rows import pack_rows

        return pack_rows(self.layouts, [k[block_id] for k in self.k],
                         [None if v is None else v[block_id] for v in self.v],
                         [None if ki is None else ki[block_id] for ki in self.k_index])

    def slots(self, positions: torch.Tensor, requests: torch.Tensor, rank: int, dcp_size: int) -> torch.Tensor:
        """Slot of each (request, position) on this rank, -1 where another rank owns it: [T]."""
        return dcp_slot_mapping(positions, requests, self.block_table, dcp_rank=rank, dcp_size=dcp_size,
                                interleave_size=self.interleave_size, block_size=self.block_size)

    def cache(self, layer: int):
        """What :func:`cpattn.dcp.dcp_decode` takes as ``kv_cache``."""
        lay = self.layouts[layer]
        return self.k[layer] if lay.values_in_keys else (self.k[layer], self.v[layer])

    def kv_bytes(self) -> int:
        """Bytes of this rank's cache storage (all layers)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.k_index) if t is not None)


# DCPStep.merge: one of the engine's names of the merge vocabulary (cpattn.dcp.layer_merges, whose table gives
# each name's wiring and collectives per layer, the output gather included) -> (query, merge) of dcp_decode.
# The model's hidden state is the same on every DCP rank, so "local_*" compute every query head locally.
STEP_MERGES = {name: LAYER_MERGES[name] for name in ENGINE_MERGES}


@dataclass
class DCPStep:
    """One decode (or verification) step on a DCP rank: ``positions`` [T] from the plan; called per layer."""

    group: Group
    shard: PagedShard
    meta: DCPMeta
    merge: str = ENGINE_MERGE
    positions: torch.Tensor = field(init=False)

    def __post_init__(self):
        if self.merge not in STEP_MERGES:
            layer_merge(self.merge, ENGINE_MERGES, what="DCPStep.merge")  # raises, naming the engine's names
        self.positions = self.meta.positions

    def fused_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's paged MLA latent cache of ``layer`` and the step's slots [T] (-1: not this rank's), for a
        model that writes its latent rows itself (:func:`cpattn.ops.mla_preprocess`); None for a GQA layer."""
        if not self.shard.layouts[layer].values_in_keys:
            return None
        return self.shard.k[layer], self.meta.slot_mapping[self.group.rank]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        """Write this step's k/v where owned (``k=None``: already written), then DCP attention.
        q: [T, Hq, Dk] -> [T, Hq, Dv]."""
        g = self.group
        self.shard.write(layer, k, v, self.meta.slot_mapping[g.rank])
        dv = self.shard.layouts[layer].v_head_dim
        query, merge = STEP_MERGES[self.merge]
        if query == "local" and merge == "ag":  # q is replicated: one all-gather of [O | L], every head merged
            return dcp_decode(q, self.shard.cache(layer), self.meta, group=g, merge="ag", query="local",
                              softmax_scale=scale, v_head_dim=dv)  # [T, Hq, Dv]
        hl = q.shape[1] // g.size  # the engine checked that the DCP size divides the heads
        q_in = q if query == "local" else q[:, g.rank * hl : (g.rank + 1) * hl]  # all heads, or this rank's
        out = dcp_decode(q_in, self.shard.cache(layer), self.meta, group=g, merge=merge, query=query,
                         softmax_scale=scale, v_head_dim=dv)  # [T, Hl, Dv]
        return g.all_gather(out, dim=1)  # [T, Hq, Dv]: the heads back together, as TP would

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float, *, return_selection: bool = False):
        """DSA over the key-sharded cache with the exact global top-k (:mod:`cpattn.dsa.paged`).

        q: [T, H, Dqk] (all heads, the same on every rank); kv: [T, 1, Dqk];
        q_index: [T, H_I, D_I]; w_index: [T, H_I]; k_index: [T, D_I]. Returns
        out [T, H, v_head_dim]; with ``return_selection`` also the selection:
        this rank's slots [T, topk] of the selected keys it owns (-1 elsewhere),
        for :meth:`dsa_shared`. Static shapes, no host sync (capturable).
        """
        g = self.group
        self.shard.write(layer, kv, None, self.meta.slot_mapping[g.rank], k_index)
        _, slots = dsa_topk(q_index, w_index, self.shard.k_index[layer], self.meta, rank=g.rank, group=g, topk=topk)
        out = self.dsa_shared(layer, q, None, slots, scale)
        return (out, slots) if return_selection else out

    def dsa_shared(self, layer: int, q: torch.Tensor, kv: torch.Tensor | None, selection: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """Sparse attention of a layer without an indexer over an earlier layer's selection (this rank's slots
        [T, topk]): writes kv [T, 1, Dqk] where owned (None: already written), then the partials over the
        owned slots of this layer's latent cache, merged over the group. No indexer, no top-k exchange.
        q: [T, H, Dqk] -> [T, H, v_head_dim]."""
        g = self.group
        if kv is not None:
            self.shard.write(layer, kv, None, self.meta.slot_mapping[g.rank])
        return sparse_partials_merged(q, self.shard.k[layer], selection, group=g, softmax_scale=scale,
                                      v_head_dim=self.shard.layouts[layer].v_head_dim)
