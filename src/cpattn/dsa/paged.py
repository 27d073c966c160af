"""DeepSeek sparse attention on one DCP rank's paged shard: exact global top-k, static shapes, no host sync.

Rank r of N holds token t iff ``(t // I) % N == r`` (:mod:`cpattn.layout.dcp`),
its local index ``j = (t // (I*N)) * I + t % I`` at slot
``block_table[b, j // block_size] * block_size + j % block_size``. Every
query row scores *every* local index of the block table's width
``L = max_blocks * block_size`` (the width is static, so a captured step
keeps one shape); indices at or past the row's local length
(``meta.kv_lens[r]``, causal: ``local_len(pos + 1, r)``) are masked, so
NaN in unwritten slots never reaches a score::

    keys  [T, L, D_I]  gathered by slot from the rank's indexer-key cache
    score [T, L]       indexer_scores, -inf at j >= kv_len
    local top-k        [T, k] (score desc, j asc = global id asc)
    candidates         (score, global id) of each rank: one all_gather [N, T, k]
    global top-k       re-selected in the same strict order (exact, DESIGN.md §4.4)
    owned slots        [T, k]: the selected keys this rank holds, -1 elsewhere
    sparse MLA         partial (out, lse) over the owned slots; one all_gather, merged by LSE

The owned slots are the layer's **selection** on this rank: a layer that
reuses it (GLM-5's shared layers) attends its own latent cache at the
same slots (every layer has the same block table and slot mapping), with
neither indexer nor top-k exchange (:func:`sparse_partials_merged`).

Example
-------
>>> import torch, cpattn
>>> from cpattn.dcp import dcp_plan
>>> from cpattn.models.family import KVLayout
>>> from cpattn.engine.paged_cache import PagedShard
>>> lay = (KVLayout(1, 12, 8, values_in_keys=True, index_head_dim=4),)
>>> def rank(g):
...     shard = PagedShard.empty(lay, capacity=[6], dcp_size=g.size, block_size=2, interleave_size=1)
...     meta = dcp_plan([6], [6], shard.block_table, dcp_size=g.size, interleave_size=1, block_size=2)
...     x = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
...     shard.write(0, x[:, None], None, meta.slot_mapping[g.rank], x[:, :4])
...     gids, slots = dsa_topk(torch.ones(6, 2, 4), torch.ones(6, 2), shard.k_index[0], meta, rank=g.rank,
...                            group=g, topk=2)
...     return gids
>>> cpattn.simulate(2, rank)[0].shape
torch.Size([6, 2])
"""

from __future__ import annotations

import torch

from cpattn.comm.group import Group
from cpattn.dcp import DCPMeta
from cpattn.dcp.decode import dcp_merge
from cpattn.dsa import global_topk
from cpattn.ops.dsa import indexer_scores, sparse_mla_attention_with_lse


def local_slots(block_table: torch.Tensor, requests: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every local index ``j < max_blocks * block_size`` of each row's request: [T, L] int64.

    requests: [T] (-1 for padding rows: read as request 0, masked by the caller).

    >>> local_slots(torch.tensor([[3, 1]]), torch.tensor([0, -1]), 2).tolist()
    [[6, 7, 2, 3], [6, 7, 2, 3]]
    """
    blocks = block_table[requests.long().clamp(min=0)].long()  # [T, max_blocks]
    offs = torch.arange(block_size, device=blocks.device)  # [bs]
    return (blocks[:, :, None] * block_size + offs).flatten(1)  # [T, L]


def global_ids(local: torch.Tensor, rank: int, size: int, interleave_size: int) -> torch.Tensor:
    """Global position of local index ``local`` on DCP rank ``rank`` (-1 stays -1).

    >>> global_ids(torch.tensor([0, 1, 2, 3, -1]), 1, 2, 2).tolist()
    [2, 3, 6, 7, -1]
    """
    j = local.long()
    i = interleave_size
    return torch.where(j >= 0, (j // i) * (i * size) + rank * i + j % i, -1)


def owned_slots(gids: torch.Tensor, requests: torch.Tensor, block_table: torch.Tensor, *, rank: int, size: int,
                interleave_size: int, block_size: int) -> torch.Tensor:
    """Slots [T, k] of the global ids ``gids`` [T, k] this rank owns; -1 where another rank owns one (or gid -1).

    >>> owned_slots(torch.tensor([[0, 1, 2, -1]]), torch.tensor([0]), torch.tensor([[5, 6]]), rank=1, size=2,
    ...             interleave_size=1, block_size=1).tolist()
    [[-1, 5, -1, -1]]
    """
    i, g = interleave_size, gids.long()
    mine = (g >= 0) & ((g // i) % size == rank)
    j = (g.clamp(min=0) // (i * size)) * i + g.clamp(min=0) % i  # [T, k] local index
    col = (j // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[requests.long().clamp(min=0)].long().gather(1, col)  # [T, k]
    return torch.where(mine, blocks * block_size + j % block_size, -1)


def dsa_topk(q_index: torch.Tensor, w_index: torch.Tensor, index_cache: torch.Tensor, meta: DCPMeta, *, rank: int,
             group: Group, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact global top-k over a key-sharded paged indexer cache, with static shapes (:func:`sharded_topk`
    with the step's metadata).

    Arguments
    ---------
    q_index: [T, H_I, D_I]; w_index: [T, H_I] -- the same on every rank.
    index_cache: [num_blocks, block_size, D_I] -- this rank's indexer keys.
    meta: the step's :class:`~cpattn.dcp.DCPMeta` (``req_indices``, ``kv_lens``,
        ``block_table``, sizes); rank: this rank in the DCP group; topk: k.

    Returns
    -------
    global_ids [T, topk] int64 (score desc, id asc; -1 padded; the same on
    every rank and equal to one device's request-local selection), and
    slots [T, topk] int64 of the selected keys this rank owns (-1 elsewhere).
    One all_gather of ``T * topk`` (score, int64 id) pairs: 12 bytes each for float32 scores.
    """
    return sharded_topk(q_index, w_index, index_cache, meta.block_table, meta.req_indices, meta.kv_lens[rank],
                        rank=rank, size=meta.dcp_size, interleave_size=meta.interleave_size, group=group, topk=topk)


def sharded_topk(q_index: torch.Tensor, w_index: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 requests: torch.Tensor, visible: torch.Tensor, *, rank: int, size: int, interleave_size: int,
                 group: Group, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The static-width exact global top-k over any key-sharded paged cache (DSA's keys, V4's CSA entries).

    q_index: [T, H_I, D_I]; w_index: [T, H_I]; index_cache: [NB, BS, D_I]
    this rank's keys; block_table: [B, max_blocks]; requests: [T] request
    of each row (-1: padding); visible: [T] local keys row t sees (0 for
    padding). Every row scores every local index of the table's width, keeps
    its local top-k, and :func:`cpattn.dsa.exchange_topk` re-selects the
    global top-k (:func:`cpattn.dsa.global_topk`, which
    :func:`cpattn.dsa.dsa_dcp_topk` uses over packed keys too). Returns
    (global ids [T, topk], owned slots [T, topk]).
    """
    t, bs, d = q_index.shape[0], index_cache.shape[1], index_cache.shape[-1]
    slots = local_slots(block_table, requests, bs)  # [T, L]
    width = slots.shape[1]
    flat = index_cache.reshape(-1, d)  # [num_blocks * bs, D_I]
    keys = flat[slots.clamp(0, flat.shape[0] - 1)].reshape(t * width, d)  # [T*L, D_I]: row t's keys at t*L
    start = torch.arange(t, device=keys.device) * width  # [T]
    scores = indexer_scores(q_index, w_index, keys, start, visible.long(), width)  # [T, L]
    gids = global_topk(scores, lambda j: global_ids(j, rank, size, interleave_size), topk, group=group)  # [T, k]
    return gids, owned_slots(gids, requests, block_table, rank=rank, size=size, interleave_size=interleave_size,
                             block_size=bs)


def sparse_partials_merged(q: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor, *, group: Group,
                           softmax_scale: float, v_head_dim: int) -> torch.Tensor:
    """Sparse MLA over the selected keys this rank owns, merged over the DCP group: every rank gets out [T, H, Dv].

    q: [T, H, Dqk] (all heads, the same on every rank); latent_cache: this
    rank's paged latent rows [num_blocks, block_size, 1, Dqk]; slots: [T, k]
    (-1: not here). Partials stay float32 (float64 for float64 q) through
    one all_gather of ``[out | lse]`` and the LSE merge.
    """
    qf = q if q.dtype == torch.float64 else q.float()
    out, lse = sparse_mla_attention_with_lse(qf, latent_cache, slots, softmax_scale=softmax_scale,
                                             v_head_dim=v_head_dim)  # [T, H, Dv], [T, H]
    return dcp_merge(out, lse.to(out.dtype), group=group, merge="ag")[0].to(q.dtype)  # one all_gather of [out | lse]
