"""Prefill context parallelism for DeepSeek-V4 attention: halos, not rings.

Each request's prompt is split head-tail over the P ranks
(:func:`cpattn.layout.pcp.pcp_plan`: rank r holds chunks r and 2P-1-r, equal
causal work). For one V4 layer, rank r then:

1. receives the ``W - 1`` tokens before each of its chunks (a halo,
   :mod:`cpattn.v4.halo`) and attends its queries' sliding windows with the
   sink: bytes per rank ``~ 2 (W - 1) D`` per request, whatever the length;
2. (CSA / HCA) receives the compressor rows of the windows straddling its
   chunk starts (at most ``2m - 1`` / ``m - 1`` tokens), pools the windows
   that *end* in its chunks -- every entry is computed by exactly one rank --
   and all-gathers the entries (and CSA's indexer keys): ``L / m`` rows, 4x
   (CSA) or 128x (HCA) fewer than the tokens;
3. attends every visible entry (HCA), or the indexer's top-k of them (CSA:
   every rank holds every key, so its local top-k is the global one), and
   merges that partial with its window partial.

No context (prefix cache) yet: a prefill starts at position 0. The result
is the rank's tokens' output (``pcp_unshard`` restores request order) and the
gathered entries, which a decode cache can take over.

Example
-------
>>> import torch, cpattn
>>> from cpattn.v4.attention import LayerInput
>>> from cpattn.v4.cache import V4Layout
>>> lay = V4Layout(kinds=("sliding",), head_dim=8, window=4, block_size=2)
>>> plan = v4_pcp_plan([0, 10], 2, lay)
>>> q, kv = torch.randn(10, 2, 8), torch.randn(10, 8)
>>> def rank(g):
...     mine = plan.pcp.token_index[g.rank]
...     return v4_pcp_attention(LayerInput(q[mine], kv[mine], torch.zeros(2), 8**-0.5), "sliding", plan, g).out
>>> cpattn.pcp_unshard(cpattn.simulate(2, rank), plan.pcp).shape
torch.Size([10, 2, 8])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.pcp import PCPPlan, pcp_plan
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.rows import write_rows
from cpattn.ops.window_attention import window_attention_with_lse
from cpattn.v4.attention import Compression, LayerInput, compress, csa_select, merge, sparse_partial
from cpattn.v4.cache import V4Layout
from cpattn.v4.halo import HaloPlan, halo_plan, halo_rows, local_chunks
from cpattn.v4.ring import ring_slots


@dataclass(frozen=True)
class KindPCP:
    """The compressed layers of one kind under a PCP plan (per rank r, lists indexed by rank).

    halo: the compressor rows' :class:`HaloPlan`; rows[r] / prev_rows[r]: [W_r, m]
    slots (in rank r's scratch ring) of the windows ending in its chunks;
    entry_pos[r]: [W_r] ``e * m``; gather: [S] row of the all-gathered
    ``[P * max W_r]`` entries for each packed entry (-1: padding), requests
    packed whole blocks apart (``offsets`` [B], block_size rows a block).
    """

    halo: HaloPlan
    rows: tuple[torch.Tensor, ...]
    prev_rows: tuple[torch.Tensor | None, ...]
    entry_pos: tuple[torch.Tensor, ...]
    gather: torch.Tensor
    offsets: torch.Tensor
    max_windows: int


@dataclass(frozen=True)
class V4PCPPlan:
    """A V4 PCP prefill plan: the head-tail split, the window halo and each compressed kind's plan."""

    pcp: PCPPlan
    layout: V4Layout
    window: HaloPlan
    kinds: dict[str, KindPCP]
    row_chunk: tuple[torch.Tensor, ...]  # [T_r] local chunk of each local token
    row_request: tuple[torch.Tensor, ...]  # [T_r] request of each local token

    def scratch_blocks(self, halo: HaloPlan, rank: int) -> int:
        """Blocks per chunk of a scratch ring holding any extended chunk of ``halo`` on ``rank``."""
        counts = torch.bincount(halo.ext_chunk[rank]) if halo.ext_chunk[rank].numel() else torch.zeros(1)
        return max(1, -(-int(counts.max()) // self.layout.block_size))


@dataclass(frozen=True)
class V4PCPOutput:
    """out: [T_r, H, D] this rank's tokens; entries [S, D] / index_keys [S, D_I]: every request's
    compressed entries (CSA / HCA layers), request b's entry e at row ``offsets[b] + e``."""

    out: torch.Tensor
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


def v4_pcp_plan(cu_seqlens: torch.Tensor | list[int], pcp_size: int, layout: V4Layout) -> V4PCPPlan:
    """Plan a V4 prefill of a packed batch (prompts ``cu_seqlens`` [B+1], no context) over ``pcp_size`` ranks."""
    pcp = pcp_plan(cu_seqlens, pcp_size)
    w = layout.window
    chunks = [local_chunks(pcp, r) for r in range(pcp_size)]
    row_chunk = tuple(
        torch.tensor([k for k, (_, s, e, _) in enumerate(ch) for _ in range(s, e)], dtype=torch.int64) for ch in chunks
    )
    row_request = tuple(
        torch.tensor([req for req, s, e, _ in ch for _ in range(s, e)], dtype=torch.int64) for ch in chunks
    )
    kinds = {k: _kind_plan(pcp, layout, k, chunks) for k in ("csa", "hca") if k in layout.kinds}
    return V4PCPPlan(pcp, layout, halo_plan(pcp, lambda s: w - 1), kinds, row_chunk, row_request)


def _kind_plan(pcp: PCPPlan, lay: V4Layout, kind: str, chunks) -> KindPCP:
    m, bs = lay.ratio(kind), lay.block_size
    back = m if kind == "csa" else 0  # overlapping windows also read the previous window
    halo = halo_plan(pcp, lambda s: s % m + back)
    rows, prev, pos, made = [], [], [], []
    for r, ch in enumerate(chunks):
        counts = torch.bincount(halo.ext_chunk[r]) if halo.ext_chunk[r].numel() else torch.zeros(1, dtype=torch.int64)
        per = max(1, -(-int(counts.max()) // bs))
        table = torch.arange(len(ch) * per).view(len(ch), per) if ch else torch.zeros(0, 1, dtype=torch.int64)
        wins = [(k, req, e) for k, (req, s, end, _) in enumerate(ch) for e in range(s // m, end // m)]
        chunk = torch.tensor([k for k, _, _ in wins], dtype=torch.int64)
        e_idx = torch.tensor([e for _, _, e in wins], dtype=torch.int64)
        j = torch.arange(m)
        slots = ring_slots(table, bs, chunk[:, None].expand(-1, m).reshape(-1), (e_idx[:, None] * m + j).reshape(-1))
        rows.append(slots.view(-1, m))
        if kind == "csa":
            pp = ((e_idx[:, None] - 1) * m + j).clamp(min=0).reshape(-1)
            pslots = ring_slots(table, bs, chunk[:, None].expand(-1, m).reshape(-1), pp).view(-1, m)
            prev.append(torch.where((e_idx > 0)[:, None], pslots, -1))
        else:
            prev.append(None)
        pos.append(e_idx * m)
        made.append([(req, e) for _, req, e in wins])
    n_ent = [n // m for n in pcp.query_lens]
    padded = [-(-n // bs) * bs for n in n_ent]
    offsets = torch.tensor([sum(padded[:b]) for b in range(len(padded))], dtype=torch.int64)
    max_w = max(len(x) for x in made)
    gather = torch.full((sum(padded),), -1, dtype=torch.int64)
    for r, lst in enumerate(made):
        for i, (req, e) in enumerate(lst):
            gather[int(offsets[req]) + e] = r * max_w + i
    return KindPCP(halo, tuple(rows), tuple(prev), tuple(pos), gather, offsets, max_w)


def _scratch(rows: torch.Tensor, halo: HaloPlan, rank: int, per: int, bs: int, group: Group):
    """Extended rows of every local chunk written into a NaN-poisoned scratch ring: (ring, table)."""
    ext = halo_rows(rows, halo, group)  # [E_r, *row]
    n_chunks = int(halo.ext_chunk[rank].max()) + 1 if halo.ext_chunk[rank].numel() else 0
    table = torch.arange(n_chunks * per, device=rows.device).view(n_chunks, per)
    ring = torch.full((n_chunks * per, bs, *rows.shape[1:]), float("nan"), dtype=rows.dtype, device=rows.device)
    if n_chunks:
        dev = rows.device
        write_rows(ring, ext, ring_slots(table, bs, halo.ext_chunk[rank].to(dev), halo.ext_pos[rank].to(dev)))
    return ring, table


def _entries(c: Compression, kp: KindPCP, plan: V4PCPPlan, group: Group) -> torch.Tensor:
    """This rank's finished entries [W_r, D] (windows ending in its chunks)."""
    r, bs = group.rank, plan.layout.block_size
    src = torch.cat([c.kv, c.gate], dim=-1)  # [T_r, 2C]
    ring, _ = _scratch(src, kp.halo, r, plan.scratch_blocks(kp.halo, r), bs, group)
    dev = src.device
    if kp.rows[r].shape[0] == 0:
        return src.new_zeros(0, c.position_bias.shape[1] // (2 if kp.prev_rows[r] is not None else 1))
    prev = None if kp.prev_rows[r] is None else kp.prev_rows[r].to(dev)
    return compress(c, ring, kp.rows[r].to(dev), prev, kp.entry_pos[r].to(dev))


def _gather(parts: list[torch.Tensor], kp: KindPCP, group: Group) -> list[torch.Tensor]:
    """All-gather every rank's entries (one message, padded to the longest) into the packed layout."""
    widths = [x.shape[1] for x in parts]
    msg = torch.cat(parts, dim=1)  # [W_r, sum widths]
    msg = torch.nn.functional.pad(msg, (0, 0, 0, kp.max_windows - msg.shape[0]))
    got = group.all_gather(msg)  # [P * max W, sum widths]
    idx = kp.gather.to(msg.device)
    packed = torch.where((idx >= 0)[:, None], got[idx.clamp(min=0)], float("nan"))  # padding rows: NaN
    return list(packed.split(widths, dim=1))


def v4_pcp_attention(inp: LayerInput, kind: str, plan: V4PCPPlan, group: Group) -> V4PCPOutput:
    """One V4 layer's attention for this rank's prefill tokens (see the module doc).

    inp: the rank's tokens in :func:`cpattn.layout.pcp.pcp_shard` order (q [T_r, H, D], ...);
    kind: the layer's "sliding" | "csa" | "hca"; plan: :func:`v4_pcp_plan` for ``group.size``.
    """
    lay, r, bs = plan.layout, group.rank, plan.layout.block_size
    if group.size != plan.pcp.pcp_size:
        raise ValueError(f"the plan is for {plan.pcp.pcp_size} ranks but the group has {group.size}; rebuild the plan")
    if inp.q.shape[0] != plan.pcp.num_tokens[r]:
        raise ValueError(f"rank {r} holds {plan.pcp.num_tokens[r]} tokens in the plan but q has {inp.q.shape[0]}; "
                         "pass pcp_shard(x, plan.pcp, group.rank)")
    dev = inp.q.device
    pos = plan.pcp.positions[r].to(dev)
    chunk = plan.row_chunk[r].to(dev)
    ring, table = _scratch(inp.kv[:, None, :], plan.window, r, plan.scratch_blocks(plan.window, r), bs, group)
    parts = [window_attention_with_lse(inp.q, ring, ring, table, chunk, pos - lay.window + 1, pos + 1,
                                       softmax_scale=inp.scale, sinks=inp.sinks)]
    if kind == "sliding":
        return V4PCPOutput(merge(parts)[0].to(inp.q.dtype))
    kp = plan.kinds[kind]
    mine = [_entries(inp.compression, kp, plan, group)]
    if kind == "csa":
        mine.append(_entries(inp.index_compression, kp, plan, group))
    gathered = _gather(mine, kp, group)
    entries, keys = gathered[0], (gathered[1] if kind == "csa" else None)
    m = lay.ratio(kind)
    if entries.shape[0] == 0:  # every prompt shorter than m: no entry yet
        return V4PCPOutput(merge(parts)[0].to(inp.q.dtype), entries, keys, kp.offsets)
    req = plan.row_request[r].to(dev)
    visible = torch.div(pos + 1, m, rounding_mode="floor")  # [T_r]
    off = kp.offsets.to(dev)
    if kind == "hca":
        n_blocks = max(1, max(-(-(n // m) // bs) for n in plan.pcp.query_lens))
        bt = torch.div(off, bs, rounding_mode="floor")[:, None] + torch.arange(n_blocks, device=dev)  # [B, n]
        cache = entries.view(-1, bs, 1, entries.shape[-1])
        parts.append(paged_attention_with_lse(inp.q, cache, cache, bt.clamp(max=cache.shape[0] - 1), req, visible,
                                              softmax_scale=inp.scale))
    else:
        n_max = max(n // m for n in plan.pcp.query_lens)
        local = csa_select(inp.index_q, inp.index_weights, keys, off[req], visible, inp.topk, n_max)  # [T_r, k]
        slots = torch.where(local >= 0, off[req][:, None] + local, -1)
        parts.append(sparse_partial(inp.q, entries, slots, inp.scale))
    return V4PCPOutput(merge(parts)[0].to(inp.q.dtype), entries, keys, kp.offsets)

