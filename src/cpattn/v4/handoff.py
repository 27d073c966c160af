"""DeepSeek-V4 hand-off: a prefill's tail rows and gathered entries seed a decode :class:`~cpattn.v4.cache.V4Cache`.

A V4 decode cache holds, per request of L prompt tokens:

- rings (replicated on every DCP rank): the window's last ``W - 1`` K = V
  rows and the compressors' last ``2m - 1`` / ``m - 1`` ``[kv | gate]`` rows
  -- the prefill's *tail* rows (:class:`~cpattn.v4.prefill.TailRows`), a few
  hundred rows whatever L;
- entries and CSA indexer keys (sharded: entry e on DCP rank ``(e // I) % N``)
  -- ``L / m`` rows, which every prefill rank already holds (the PCP
  prefill all-gathers them).

So the hand-off is one all-gather of the tail rows over the prefill group
(:func:`collect`: every rank then holds the same :class:`V4Handoff`, in
request order) and a local write (:func:`seed_cache`: rings whole, the
entries this rank owns). Nothing is sent per entry. P/D on separate
ranks: prefill rank 0 sends the :class:`V4Handoff` (and the first-token
logits) to every decode rank point to point over a
:class:`~cpattn.comm.group.Group` (:func:`send_handoff` /
:func:`recv_handoff`: each tensor after a small shape header), and each
keeps its share.

Example
-------
>>> import torch, cpattn
>>> from cpattn.engine.batch import Prompts
>>> from cpattn.models import deepseek_v4 as v4
>>> from cpattn.v4.prefill import v4_prefill
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> def rank(g):
...     h = collect(g, v4_prefill(g, v4.forward, params, cfg, Prompts.of([list(range(20))])))
...     return seed_cache(v4.empty_cache(cfg, batch=1, max_len=32, block_size=4), h).seq_lens, h.tail.positions[:2]
>>> [(lens, pos.tolist()) for lens, pos in cpattn.simulate(2, rank)]
[((20,), [5, 6]), ((20,), [5, 6])]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpattn.comm.group import Group
from cpattn.ops.logits import acc_dtype, as_logits
from cpattn.layout.dcp import dcp_slot_mapping
from cpattn.layout.rows import cu_seqlens, request_of
from cpattn.ops.rows import write_rows
from cpattn.v4.cache import V4Cache, V4Layout
from cpattn.v4.prefill import GatheredEntries, TailRows, V4PrefillOut
from cpattn.v4.ring import ring_slots


@dataclass(frozen=True)
class V4Handoff:
    """What seeds a decode cache: ``lens`` (prompt lengths), every request's ``tail`` rows (request order,
    position ascending) and the gathered ``entries``."""

    lens: tuple[int, ...]
    tail: TailRows
    entries: GatheredEntries

    def nbytes(self) -> int:
        """Bytes of the rows it carries (what P/D sends once)."""
        ts = [*self.tail.window, *self.tail.raw, *self.tail.index_raw, *self.entries.entries,
              *self.entries.index_keys]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _columns(tail: TailRows) -> list[torch.Tensor]:
    return [t for t in (*tail.window, *tail.raw, *tail.index_raw) if t is not None]


def collect(group: Group, out: V4PrefillOut) -> V4Handoff:
    """Every request's tail rows on every rank of the prefill group (one all-gather), in request order.

    The rows of each layer are sent side by side, padded to the longest
    rank; who holds which (request, position) is in the plan
    (``out.tail.ranks``), so no header travels.
    """
    tail = out.tail
    cols = _columns(tail)
    widths = [c.shape[1] for c in cols]
    if group.size > 1:
        n_max = max(int(req.numel()) for req, _ in tail.ranks)
        msg = torch.cat(cols, dim=1)  # [R_r, F]
        msg = torch.nn.functional.pad(msg, (0, 0, 0, n_max - msg.shape[0]))
        got = group.all_gather(msg[None], dim=0)  # [P, n_max, F]
        rows = torch.cat([got[j, : req.numel()] for j, (req, _) in enumerate(tail.ranks)])
        req = torch.cat([r for r, _ in tail.ranks])
        pos = torch.cat([p for _, p in tail.ranks])
    else:
        rows, req, pos = torch.cat(cols, dim=1), tail.requests, tail.positions
    order = torch.argsort(req * (max(out.lens, default=0) + 1) + pos)
    rows, req, pos = rows[order.to(rows.device)], req[order], pos[order]
    parts = iter(rows.split(widths, dim=1))
    pick = [[next(parts) if t is not None else None for t in ts] for ts in (tail.window, tail.raw, tail.index_raw)]
    return V4Handoff(out.lens, TailRows(req, pos, *map(tuple, pick)), out.entries)


def seed_cache(cache: V4Cache, h: V4Handoff) -> V4Cache:
    """Write a hand-off into an empty decode cache (this DCP rank's share) and set its lengths to the prompts'.

    Rings get the positions ``[L - back, L)`` they hold after L tokens; entry
    e < L // m of request b goes where this rank owns it (``cache.dcp_rank``).
    Returns the cache with ``seq_lens = high_water = lens``.
    """
    lay, bs = cache.layout, cache.layout.block_size
    if len(h.lens) != cache.batch:
        raise ValueError(f"the hand-off holds {len(h.lens)} requests but the cache {cache.batch}")
    dev = cache.tables["window"].device
    lens = torch.tensor(h.lens, dtype=torch.int64)
    req, pos = h.tail.requests.long(), h.tail.positions.long()
    for layer, kind in enumerate(lay.kinds):
        rings = [(cache.window[layer], h.tail.window[layer], "window")]
        if kind != "sliding":
            rings.append((cache.raw[layer], h.tail.raw[layer], f"raw_{kind}"))
        if kind == "csa":
            rings.append((cache.index_raw[layer], h.tail.index_raw[layer], "raw_csa"))
        for dst, rows, ring in rings:
            keep = pos >= lens[req] - lay.back(ring)
            slots = ring_slots(cache.tables[ring], bs, req[keep].to(dev), pos[keep].to(dev))
            write_rows(dst, rows[keep.to(rows.device)].reshape(-1, *dst.shape[2:]), slots)
        if kind == "sliding":
            continue
        m = lay.ratio(kind)
        b_idx = request_of(cu_seqlens(n // m for n in h.lens))
        e_idx = torch.cat([torch.arange(n // m) for n in h.lens]).long()
        src = (h.entries.offsets[kind][b_idx] + e_idx).to(dev)
        slots = dcp_slot_mapping(e_idx.to(dev), b_idx.to(dev), cache.tables[f"ent_{kind}"], dcp_rank=cache.dcp_rank,
                                 dcp_size=cache.dcp_size, interleave_size=cache.interleave_size, block_size=bs)
        ents = cache.entries[layer]
        write_rows(ents, h.entries.entries[layer][src].reshape(-1, *ents.shape[2:]), slots)
        if kind == "csa":
            write_rows(cache.index_keys[layer], h.entries.index_keys[layer][src], slots)
    return replace(cache, seq_lens=tuple(h.lens), high_water=tuple(h.lens))


MAX_DIMS = 4  # a header carries ndim and up to this many sizes


def _tensors(h: V4Handoff, first_logits: torch.Tensor) -> list[torch.Tensor]:
    """The payload in a fixed order that :func:`recv_handoff` rebuilds from the layout alone."""
    t, e = h.tail, h.entries
    ts = [as_logits(first_logits), t.requests.long(), t.positions.long()]
    ts += [x for x in (*t.window, *t.raw, *t.index_raw, *e.entries, *e.index_keys) if x is not None]
    return ts + [e.offsets[k].long() for k in sorted(e.offsets)]


def _p2p(world: Group | None) -> Group:
    if world is not None:
        return world
    from cpattn.comm.dist import DistGroup  # legacy default: torch.distributed's world group

    return DistGroup()


def send_handoff(h: V4Handoff, first_logits: torch.Tensor, decode_ranks: list[int], world: Group | None = None) -> int:
    """P/D: send the hand-off and first-token logits [B, V] to every decode rank (ranks of ``world``, default
    torch.distributed's world), point to point (:meth:`~cpattn.comm.group.Group.send`); each tensor goes
    after an int64 header ``[ndim, *shape]``. Returns bytes sent (the rows, not the headers)."""
    world = _p2p(world)
    sent = 0
    for d in decode_ranks:
        for x in _tensors(h, first_logits):
            header = torch.zeros(1 + MAX_DIMS, dtype=torch.int64)
            header[0] = x.dim()
            header[1 : 1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
            world.send(header, d)
            if x.numel():
                world.send(x, d)
                sent += x.numel() * x.element_size()
    return sent


def recv_handoff(layout: V4Layout, lens: tuple[int, ...], dtype: torch.dtype, src: int, world: Group | None = None):
    """P/D: receive what :func:`send_handoff` sent from rank ``src`` of ``world`` (default torch.distributed's
    world): (:class:`V4Handoff`, first-token logits [B, V] float32 (float64 in a float64 run), bytes
    received). ``layout`` says which layers carry which tensors; rows arrive in ``dtype`` (the model's)."""
    world = _p2p(world)
    got = 0

    def take(dt: torch.dtype) -> torch.Tensor:
        nonlocal got
        header = world.recv((1 + MAX_DIMS,), torch.int64, src)
        shape = header[1 : 1 + int(header[0])].tolist()
        if not torch.Size(shape).numel():
            return torch.empty(shape, dtype=dt)
        x = world.recv(shape, dt, src)
        got += x.numel() * x.element_size()
        return x

    kinds = layout.kinds
    first = take(acc_dtype(dtype))  # as the prefill's logits
    req, pos = take(torch.int64), take(torch.int64)
    window = tuple(take(dtype) for _ in kinds)
    raw = tuple(take(dtype) if k != "sliding" else None for k in kinds)
    index_raw = tuple(take(dtype) if k == "csa" else None for k in kinds)
    entries = tuple(take(dtype) if k != "sliding" else None for k in kinds)
    index_keys = tuple(take(dtype) if k == "csa" else None for k in kinds)
    offsets = {k: take(torch.int64) for k in sorted({k for k in kinds if k != "sliding"})}
    tail = TailRows(req, pos, window, raw, index_raw)
    return V4Handoff(tuple(lens), tail, GatheredEntries(entries, index_keys, offsets)), first, got
