"""DeepSeek-V4 decode steps with a host plan in static buffers: the capturable form of :class:`~cpattn.v4.step.V4Step`.

A decode (or verification) step gives every request ``q = 1 + k`` new
tokens after ``L`` cached ones. Everything that depends on the lengths --
ring slots, the windows that complete, where their entries go, how many
entries each row sees -- is planned on the host by :func:`decode_plan`
into per-token tensors of fixed widths (:func:`plan_fields`), *before* the
captured region; the step (:class:`V4DecodeStep`) only indexes with them::

    row t (request b, position p = L + j)          plan tensors (one row each)
    window ring slot of p                          window_slot
    compressor ring slot of p, per kind            {kind}_raw_slot
    does p close window e = (p + 1) / m - 1 ?      {kind}_rows [m] (slots of e's tokens, -1: no)
      ... and the previous window (CSA)            {kind}_prev_rows [m]
      entry position e * m, its slot on this rank  {kind}_entry_pos, {kind}_entry_slot (-1: not here)
    entries row t sees on each DCP rank            {kind}_kv_lens [N]: local_len((p + 1) // m, r)

A token closes at most one window, so one row of window slots per token is
the static width (the ``ceil((1 + k) / m)`` windows of a request are among
its q rows). Padding rows (a captured batch padded to its size) have
request -1, slots -1 and no visible entry: they write nothing and see
nothing (``(0, -inf)`` partials, outputs discarded).

The step writes the rings in place (a decode step of ``1 + k <= 1 +
max_rewind`` tokens always fits, :mod:`cpattn.v4.ring`), attends the window
for this DCP rank's heads with their sinks, pools the closed windows and
writes the entries this rank owns, attends the entries (HCA: every visible
local entry; CSA: the exact global top-k of :func:`entry_topk`) and merges
the ranks' partials -- the same partials, in the same order, as
:class:`~cpattn.v4.step.V4Step`.

Example
-------
>>> import torch
>>> from cpattn.comm.sim import SimMesh
>>> from cpattn.v4.attention import LayerInput
>>> from cpattn.v4.cache import V4Cache, V4Layout
>>> lay = V4Layout(kinds=("sliding",), head_dim=8, window=4, block_size=2)
>>> cache = V4Cache.empty(lay, batch=1, max_len=16)
>>> plan = decode_plan(cache, [0], [5], 1)          # one token at position 5
>>> plan["window_slot"].tolist(), sorted(plan_fields(lay, dcp_size=1)) == sorted(plan)
([1], True)
>>> step = V4DecodeStep(lay, cache_state(cache), plan, SimMesh(1).groups()[0])
>>> step.attend(0, LayerInput(torch.randn(1, 2, 8), torch.randn(1, 8), torch.zeros(2), 8**-0.5)).shape
torch.Size([1, 2, 8])
"""

from __future__ import annotations

import torch

from cpattn.comm.group import Group
from cpattn.dsa.paged import sharded_topk
from cpattn.graphs.runner import Field
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.layout.pcp import chunk_bounds
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.rows import write_rows
from cpattn.ops.window_attention import window_attention_with_lse
from cpattn.v4.attention import Compression, LayerInput, compress, head_slice, merge, sparse_partial
from cpattn.v4.cache import V4Cache, V4Layout
from cpattn.v4.ring import ring_slots
from cpattn.v4.step import merge_all


def compressed_kinds(layout: V4Layout) -> tuple[str, ...]:
    """The compressed kinds ("csa", "hca") present in a layout, in that order.

    >>> compressed_kinds(V4Layout(kinds=("hca", "sliding"), head_dim=4, window=4))
    ('hca',)
    """
    return tuple(k for k in ("csa", "hca") if k in layout.kinds)


def plan_fields(layout: V4Layout, *, dcp_size: int) -> dict[str, Field]:
    """The per-token plan tensors of a step (:class:`~cpattn.graphs.Field` declarations; pads make a row inert).

    ``req`` -1 (a padding row), ``positions`` 0, every slot -1 (no write),
    ``{kind}_kv_lens`` 0 (no entry visible). The step's ``tokens`` field is the engine's.

    >>> lay = V4Layout(kinds=("hca",), head_dim=4, window=4)
    >>> sorted(plan_fields(lay, dcp_size=2))  # doctest: +NORMALIZE_WHITESPACE
    ['hca_entry_pos', 'hca_entry_slot', 'hca_kv_lens', 'hca_raw_slot', 'hca_rows', 'positions', 'req',
     'window_slot']
    """
    i64 = torch.int64
    out = {"req": Field("token", (), i64, pad=-1), "positions": Field("token", (), i64, pad=0),
           "window_slot": Field("token", (), i64, pad=-1)}
    for kind in compressed_kinds(layout):
        m = layout.ratio(kind)
        out[f"{kind}_raw_slot"] = Field("token", (), i64, pad=-1)
        out[f"{kind}_rows"] = Field("token", (m,), i64, pad=-1)
        if kind == "csa":
            out[f"{kind}_prev_rows"] = Field("token", (m,), i64, pad=-1)
        out[f"{kind}_entry_pos"] = Field("token", (), i64, pad=0)
        out[f"{kind}_entry_slot"] = Field("token", (), i64, pad=-1)
        out[f"{kind}_kv_lens"] = Field("token", (dcp_size,), i64, pad=0)
    return out


def decode_plan(cache: V4Cache, requests: list[int], context_lens: list[int],
                query_len: int) -> dict[str, torch.Tensor]:
    """Host plan of one step: ``query_len`` tokens for each of ``requests`` (cache rows) after ``context_lens``.

    Returns the tensors of :func:`plan_fields` for ``T = len(requests) * query_len``
    rows, request-major (row ``i * q + j`` is position ``context_lens[i] + j`` of
    request ``requests[i]``), on the cache's device, for this cache's DCP rank.
    Needs ``query_len <= 1 + max_rewind`` (the rings are written in place).

    >>> lay = V4Layout(kinds=("hca",), head_dim=4, window=4, hca_ratio=4, block_size=4, max_rewind=1)
    >>> plan = decode_plan(V4Cache.empty(lay, batch=1, max_len=16), [0], [6], 2)   # positions 6, 7
    >>> plan["hca_rows"].tolist(), plan["hca_entry_slot"].tolist(), plan["hca_kv_lens"].tolist()
    ([[-1, -1, -1, -1], [4, 5, 6, 7]], [-1, 1], [[1], [2]])
    """
    lay, tabs = cache.layout, cache.tables
    bs, q = lay.block_size, int(query_len)
    if q < 1 or q > 1 + lay.max_rewind:
        raise ValueError(f"query_len={q}: a decode step writes its rings in place, so 1 <= query_len <= "
                         f"1 + max_rewind = {1 + lay.max_rewind}; build the cache with max_rewind >= {q - 1}")
    if len(requests) != len(context_lens):
        raise ValueError(f"requests ({len(requests)}) and context_lens ({len(context_lens)}) must have one entry "
                         "per request")
    dev = tabs["window"].device
    j = torch.arange(q)
    req = torch.tensor(requests, dtype=torch.int64).repeat_interleave(q)  # [T]
    pos = (torch.tensor(context_lens, dtype=torch.int64)[:, None] + j).reshape(-1)  # [T]
    last = max((c + q - 1 for c in context_lens), default=-1)
    if cache.max_len and last >= cache.max_len:
        raise ValueError(f"a step reaches position {last} but the cache holds max_len={cache.max_len} "
                         "tokens per request; build it with a larger max_len")
    req, pos = req.to(dev), pos.to(dev)
    out = {"req": req, "positions": pos, "window_slot": ring_slots(tabs["window"], bs, req, pos)}
    n, rank, inter = cache.dcp_size, cache.dcp_rank, cache.interleave_size
    for kind in compressed_kinds(lay):
        m, raw = lay.ratio(kind), tabs[f"raw_{kind}"]
        closes = (pos + 1) % m == 0  # [T] this token completes window e
        e = torch.div(pos + 1, m, rounding_mode="floor") - 1  # [T]
        slot_j = torch.arange(m, device=dev)

        def window_slots(first: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
            p = (first.clamp(min=0)[:, None] + slot_j).reshape(-1)  # [T * m]
            s = ring_slots(raw, bs, req[:, None].expand(-1, m).reshape(-1), p).view(-1, m)
            return torch.where(live[:, None], s, -1)

        out[f"{kind}_raw_slot"] = ring_slots(raw, bs, req, pos)
        out[f"{kind}_rows"] = window_slots(e * m, closes)
        if kind == "csa":
            out[f"{kind}_prev_rows"] = window_slots((e - 1) * m, closes & (e > 0))
        out[f"{kind}_entry_pos"] = torch.where(closes, e * m, 0)
        owned = dcp_slot_mapping(e.clamp(min=0), req, tabs[f"ent_{kind}"], dcp_rank=rank, dcp_size=n,
                                 interleave_size=inter, block_size=bs)
        out[f"{kind}_entry_slot"] = torch.where(closes, owned, -1)
        out[f"{kind}_kv_lens"] = dcp_local_lens(torch.div(pos + 1, m, rounding_mode="floor"), n, inter).long()
    return out


def cache_state(cache: V4Cache) -> dict:
    """The cache's tensors as a step's state (a pytree the graph runner passes unchanged every step).

    >>> lay = V4Layout(kinds=("sliding", "hca"), head_dim=4, window=4, hca_ratio=4, block_size=2)
    >>> st = cache_state(V4Cache.empty(lay, batch=1, max_len=8))
    >>> [t is None for t in st["entries"]], sorted(st["tables"])
    ([True, False], ['ent_hca', 'raw_hca', 'window'])
    """
    return {"window": cache.window, "raw": cache.raw, "index_raw": cache.index_raw, "entries": cache.entries,
            "index_keys": cache.index_keys, "tables": dict(cache.tables)}


def entry_topk(index_q: torch.Tensor, index_weights: torch.Tensor, index_keys: torch.Tensor, table: torch.Tensor,
               req: torch.Tensor, kv_lens: torch.Tensor, *, group: Group, interleave_size: int, topk: int) -> torch.Tensor:
    """The CSA indexer's exact global top-k over key-sharded entries, static widths: this rank's slots [T, topk].

    Every row scores every local entry of the table's width (masked past
    ``kv_lens[:, rank]``), keeps its local top-k (score desc, id asc), and one
    all-gather of ``(score, entry id)`` candidates lets every rank re-select
    the global top-k in the same strict order (DESIGN.md §4.4) -- the
    capturable form of :func:`cpattn.dsa.dsa_dcp_topk`.

    index_q: [T, H_I, D_I]; index_weights: [T, H_I]; index_keys: this rank's
    [NB, BS, D_I]; table: [B, n] entry blocks; req: [T] (-1: padding);
    kv_lens: [T, N] entries row t sees on each rank. Returns slots [T, topk]
    of the selected entries this rank holds, -1 elsewhere.

    Example
    -------
    One rank, entries 0..5 scoring 1, 5, 3, 0, 4, 2 (blocks in order: entry j at slot j); the row sees 5:

    >>> from cpattn.comm.sim import SimMesh
    >>> keys = torch.tensor([1.0, 5.0, 3.0, 0.0, 4.0, 2.0]).view(3, 2, 1)   # [NB 3, BS 2, D_I 1]
    >>> entry_topk(torch.ones(1, 1, 1), torch.ones(1, 1), keys, torch.tensor([[0, 1, 2]]), torch.tensor([0]),
    ...            torch.tensor([[5]]), group=SimMesh(1).groups()[0], interleave_size=1, topk=2).tolist()
    [[1, 4]]
    """
    visible = torch.where(req >= 0, kv_lens[:, group.rank], 0)
    return sharded_topk(index_q, index_weights, index_keys, table, req, visible, rank=group.rank, size=group.size,
                        interleave_size=interleave_size, group=group, topk=topk)[1]


class V4DecodeStep:
    """One planned decode step over a cache's tensors (the attention step the model calls).

    layout: the cache's :class:`~cpattn.v4.cache.V4Layout`; state:
    :func:`cache_state` (written in place); plan: :func:`decode_plan`'s
    tensors (or the runner's buffers holding them); group: the DCP group (a
    one-rank group on one device). ``positions`` [T] feed the model's RoPE.
    """

    def __init__(self, layout: V4Layout, state: dict, plan: dict[str, torch.Tensor], group: Group, *,
                 interleave_size: int = 1):
        self.layout, self.state, self.plan, self.group, self.interleave_size = layout, state, plan, group, interleave_size
        self.positions = plan["positions"]

    def attend(self, layer: int, inp: LayerInput) -> torch.Tensor:
        """Layer ``layer``'s attention output [T, H, D] (the same on every DCP rank); writes its caches."""
        lay, st, plan, g = self.layout, self.state, self.plan, self.group
        kind, heads = lay.kinds[layer], inp.q.shape[1]
        h0, h1 = chunk_bounds(heads, g.size)[g.rank : g.rank + 2]
        req, pos = plan["req"], plan["positions"]
        ring = st["window"][layer]
        write_rows(ring, inp.kv[:, None, :], plan["window_slot"])
        o, l = window_attention_with_lse(inp.q[:, h0:h1], ring, ring, st["tables"]["window"], req,
                                         pos - lay.window + 1, pos + 1, softmax_scale=inp.scale,
                                         sinks=inp.sinks[h0:h1])
        parts = [head_slice(o, l, h0, h1, heads)]
        if kind != "sliding":
            self._write_entries(kind, st["raw"][layer], st["entries"][layer], inp.compression)
            table = st["tables"][f"ent_{kind}"]
            if kind == "hca":
                kv_lens = torch.where(req >= 0, plan["hca_kv_lens"][:, g.rank], 0)
                parts.append(paged_attention_with_lse(inp.q, st["entries"][layer], st["entries"][layer], table, req,
                                                      kv_lens, softmax_scale=inp.scale))
            else:
                self._write_entries(kind, st["index_raw"][layer], st["index_keys"][layer], inp.index_compression)
                slots = entry_topk(inp.index_q, inp.index_weights, st["index_keys"][layer], table, req,
                                   plan["csa_kv_lens"], group=g, interleave_size=self.interleave_size, topk=inp.topk)
                parts.append(sparse_partial(inp.q, st["entries"][layer], slots, inp.scale))
        out, lse = merge(parts)
        if g.size > 1:
            out, lse = merge_all(out, lse, g)
        return out.to(inp.q.dtype)

    def _write_entries(self, kind: str, raw: torch.Tensor, entries: torch.Tensor, comp: Compression) -> None:
        """Write the step's ``[kv | gate]`` rows into the compressor ring, pool the windows they close and
        write the entries this rank owns (rows that close no window pool nothing and write nowhere)."""
        plan = self.plan
        write_rows(raw, torch.cat([comp.kv, comp.gate], dim=-1), plan[f"{kind}_raw_slot"])
        prev = plan.get(f"{kind}_prev_rows")
        pooled = compress(comp, raw, plan[f"{kind}_rows"], prev, plan[f"{kind}_entry_pos"])  # [T, D]
        write_rows(entries, pooled.view(-1, *entries.shape[2:]), plan[f"{kind}_entry_slot"])
