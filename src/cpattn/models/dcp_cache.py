"""Decode with DCP: each rank holds its interleaved share of a paged KV cache.

Rank r of the N-rank DCP group keeps token t of every request iff
``(t // I) % N == r`` (:mod:`cpattn.layout.dcp`), in blocks of
``block_size`` rows addressed by one block table shared by the group. A
decode step writes the new token's KV where it is owned
(:func:`cpattn.ops.paged.write_kv`, slot -1 elsewhere), then attends through
:func:`cpattn.dcp.dcp_decode`: the query heads are all-gathered, every rank
attends its shard, and the partials are merged by LSE. DCP reuses TP ranks:
N must divide the query heads; rank r passes its head slice and the outputs
are all-gathered again (standing in for TP's row-parallel o_proj). Every
rank's cache holds all KV heads (TP of the KV heads is not modelled).

Example
-------
>>> import torch, cpattn
>>> from cpattn.models import qwen3
>>> from cpattn.models.generate import generate
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> out = generate(qwen3, qwen3.init_params(cfg), cfg, [[1, 2, 3]], 4, dcp_size=2)
>>> out.tokens.shape
torch.Size([1, 4])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.dcp import DCPMeta, dcp_decode, dcp_plan
from cpattn.dsa import ShardedKeys, dsa_dcp_attention
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.models import resolve_model
from cpattn.ops.paged import scatter_rows, write_kv, write_kv_mla


@dataclass(frozen=True)
class PagedShard:
    """One DCP rank's paged cache for every layer.

    k[l]: [num_blocks, block_size, Hkv, Dk]; v[l]: [.., .., Hkv, Dv], or None
    for the MLA latent cache (values are ``k[l][..., :dv]``). ``block_table``:
    [B, max_blocks], the same on every rank. ``ik[l]``: [num_blocks,
    block_size, D_I] DSA indexer keys (DeepSeek-V3.2 only), same slots.
    Unwritten rows hold NaN.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor | None, ...]
    block_table: torch.Tensor
    dv: int
    block_size: int
    interleave_size: int
    ik: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def empty(cls, cfg: Any, *, seq_lens: list[int], dcp_size: int, block_size: int, interleave_size: int,
              dtype: torch.dtype, device="cpu") -> PagedShard:
        """A NaN-filled shard with room for ``seq_lens[b]`` tokens of request b (same shape on every rank)."""
        hkv, dk, dv, shared = cfg.kv_dims
        local = dcp_local_lens(torch.tensor(seq_lens), dcp_size, interleave_size).max(dim=1).values  # [B]
        per_req = max(1, -(-int(local.max()) // block_size))
        b = len(seq_lens)
        table = torch.arange(b * per_req, dtype=torch.int64, device=device).view(b, per_req)
        nb = b * per_req + 1  # one spare block nobody owns: stays NaN
        k = tuple(torch.full((nb, block_size, hkv, dk), float("nan"), dtype=dtype, device=device)
                  for _ in range(cfg.num_hidden_layers))
        v = tuple(None if shared else torch.full((nb, block_size, hkv, dv), float("nan"), dtype=dtype, device=device)
                  for _ in range(cfg.num_hidden_layers))
        di = getattr(cfg, "index_head_dim", 0) if hasattr(cfg, "index_topk") else 0
        ik = tuple(torch.full((nb, block_size, di), float("nan"), dtype=dtype, device=device)
                   for _ in range(cfg.num_hidden_layers)) if di else None
        return cls(k, v, table, dv, block_size, interleave_size, ik)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor,
              k_index: torch.Tensor | None = None) -> None:
        """Store k [T, Hkv, Dk] (and v, and DSA indexer keys [T, D_I]) at ``slots`` [T] (-1: not this rank's)."""
        if k_index is not None:  # the same slot write as write_kv, on the [num_blocks * block_size, D_I] rows
            scatter_rows(self.ik[layer].view(-1, k_index.shape[-1]), k_index, slots)
        if self.v[layer] is None:
            write_kv_mla(self.k[layer], k[:, 0, : self.dv], k[:, 0, self.dv :], slots)
        else:
            write_kv(self.k[layer], self.v[layer], k, v, slots)

    def cache(self, layer: int):
        """What :func:`cpattn.dcp.dcp_decode` takes as ``kv_cache``."""
        return self.k[layer] if self.v[layer] is None else (self.k[layer], self.v[layer])

    def kv_bytes(self) -> int:
        """Bytes of this rank's cache storage (all layers)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *(self.ik or ())) if t is not None)

    def key_index(self, meta: DCPMeta, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where this rank's DSA keys live, the same for every layer: slots [S_r], global ids [S_r], cu [B+1].

        Host work (a loop over requests); build it once per step, not per layer.
        """
        n, i_sz, bs = meta.dcp_size, self.interleave_size, self.block_size
        local = dcp_local_lens(meta.seq_lens, n, i_sz)[:, rank]  # [B]
        slots, ids, cu = [], [], [0]
        for b, m in enumerate(local.tolist()):
            j = torch.arange(m)  # local indices
            slots.append(self.block_table[b, j // bs] * bs + j % bs)
            ids.append((j // i_sz) * (i_sz * n) + rank * i_sz + j % i_sz)  # global positions
            cu.append(cu[-1] + m)
        dev = self.k[0].device
        return torch.cat(slots).to(dev), torch.cat(ids).to(dev), torch.tensor(cu, device=dev)

    def sharded_keys(self, layer: int, index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        """This rank's DSA keys of layer ``layer`` as :class:`cpattn.dsa.ShardedKeys` (``index`` from :meth:`key_index`)."""
        slots, ids, cu = index
        lat = self.k[layer].view(-1, self.k[layer].shape[-1])[slots]  # [S_r, Dqk]
        keys = self.ik[layer].view(-1, self.ik[layer].shape[-1])[slots]  # [S_r, D_I]
        return ShardedKeys(lat, keys, ids, cu)


@dataclass
class DCPStep:
    """One decode step on a DCP rank: ``positions`` [T] from the plan; call per layer like any step."""

    group: Group
    shard: PagedShard
    meta: DCPMeta
    merge: str = "ag_rs"
    positions: torch.Tensor = field(init=False)
    _key_index: tuple | None = field(default=None, init=False, repr=False)  # DSA: built by the first layer

    def __post_init__(self):
        self.positions = self.meta.positions

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Write this step's k/v where owned, then DCP attention. q: [T, Hq, Dk] -> [T, Hq, Dv]."""
        g = self.group
        self.shard.write(layer, k, v, self.meta.slot_mapping[g.rank])
        hq = q.shape[1]
        if hq % g.size:
            raise ValueError(
                f"{hq} query heads cannot be split over {g.size} DCP ranks; DCP reuses TP ranks, so the "
                "DCP size must divide the number of attention heads. Pick dcp_size from the head count's divisors"
            )
        hl = hq // g.size
        q_mine = q[:, g.rank * hl : (g.rank + 1) * hl]  # [T, Hl, Dk]: this rank's TP heads
        out = dcp_decode(q_mine, self.shard.cache(layer), self.meta, group=g, merge=self.merge,
                         softmax_scale=scale, v_head_dim=self.shard.dv)  # [T, Hl, Dv]
        return g.all_gather(out, dim=1)  # [T, Hq, Dv]: the heads back together, as TP would

    def dsa(self, layer: int, q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, w_index: torch.Tensor,
            k_index: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """DSA over the key-sharded cache (:func:`cpattn.dsa.dsa_dcp_attention`): exact global top-k.

        q: [T, H, Dqk] (all heads, the same on every rank); kv: [T, 1, Dqk];
        q_index: [T, H_I, D_I]; w_index: [T, H_I]; k_index: [T, D_I]. Returns [T, H, dv].
        """
        g = self.group
        self.shard.write(layer, kv, None, self.meta.slot_mapping[g.rank], k_index)
        if self._key_index is None:  # layer-independent: once per step
            self._key_index = self.shard.key_index(self.meta, g.rank)
        keys = self.shard.sharded_keys(layer, self._key_index)
        return dsa_dcp_attention(q, q_index, w_index, self.meta.positions, self.meta.cu_seqlens_q, keys, group=g,
                                 topk=topk, softmax_scale=scale, value_dim=self.shard.dv)


def fill_from_prefill(shard: PagedShard, rank: int, dcp_size: int, k: list[torch.Tensor], v: list, cu_seqlens: list[int],
                      ik: list[torch.Tensor] | None = None) -> None:
    """Write packed prefill KV into this rank's shard.

    k[l]: [T, Hkv, Dk]; v[l]: [T, Hkv, Dv] or None; ik[l]: [T, D_I] or None;
    requests by ``cu_seqlens`` [B+1]. Tokens owned by other ranks are skipped.
    """
    cu = torch.tensor(cu_seqlens)
    lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
    pos = torch.arange(int(cu[-1])) - cu[:-1][req]  # [T]
    slots = dcp_slot_mapping(pos, req, shard.block_table, dcp_rank=rank, dcp_size=dcp_size,
                             interleave_size=shard.interleave_size, block_size=shard.block_size)
    for layer in range(len(k)):
        shard.write(layer, k[layer], v[layer], slots, None if ik is None else ik[layer])


def decode_dcp_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, pre, first: torch.Tensor,
                       steps: int, *, block_size: int = 4, interleave_size: int = 1,
                       merge: str = "ag_rs") -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` greedy decode steps with the KV cache sharded over the DCP ``group`` (run it on every rank).

    pre: a :class:`cpattn.models.generate.PrefillResult` (the whole prompt KV;
    this rank keeps its share); first: [B] the token chosen from the prefill
    logits. Returns (tokens [B, steps], logits [B, steps, V] float32), the
    same on every rank.
    """
    model = resolve_model(model)
    n = group.size
    cu = pre.cu_seqlens.tolist()
    prompt = [b - a for a, b in zip(cu, cu[1:])]
    nreq = len(prompt)
    shard = PagedShard.empty(cfg, seq_lens=[m + steps for m in prompt], dcp_size=n, block_size=block_size,
                             interleave_size=interleave_size, dtype=pre.k[0].dtype, device=first.device)
    fill_from_prefill(shard, group.rank, n, pre.k, pre.v, cu, pre.ik)
    lens, tok, toks, logits = list(prompt), first, [], []
    for _ in range(steps):
        lens = [m + 1 for m in lens]
        meta = dcp_plan(lens, [1] * nreq, shard.block_table, dcp_size=n, interleave_size=interleave_size,
                        block_size=block_size)
        out = model.forward(params, cfg, tok, DCPStep(group, shard, meta, merge)).float()  # [B, V]
        tok = out.argmax(-1)
        toks.append(tok)
        logits.append(out)
    if not toks:
        return torch.zeros(nreq, 0, dtype=torch.int64), torch.zeros(nreq, 0, 0)
    return torch.stack(toks, 1), torch.stack(logits, 1)
