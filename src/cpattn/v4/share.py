"""One request's DeepSeek-V4 decode state for one DCP rank, as a flat tensor: export from a hand-off, place in a slot.

A V4 decode cache holds, per request of L tokens (:mod:`cpattn.v4.cache`):
ring rows at positions ``[L - back, L)`` (replicated on every DCP rank) and
the compressed entries / CSA indexer keys ``e < L // m`` that the rank owns
(entry e on rank ``(e // I) % N``). That is the request's **share** for a
rank: :func:`export_share` cuts it out of a :class:`~cpattn.v4.handoff.V4Handoff`
(the producer's collected prefill state) as one flat tensor, and
:func:`place_share` writes it into one row (slot) of a rank's
:class:`~cpattn.v4.cache.V4Cache`, which then holds L tokens, as
:func:`~cpattn.v4.handoff.seed_cache` would have left it.

The payload order is :func:`share_parts` (per layer: window ring, compressor
ring, indexer ring, entries, indexer keys, as the layer has them); its size
depends only on (layout, L, rank, N, I) (:func:`share_numel`), so a receiver
knows it before the bytes arrive.

Example
-------
>>> import torch
>>> from cpattn.comm.sim import SimMesh
>>> from cpattn.engine.batch import Prompts
>>> from cpattn.models import deepseek_v4 as v4
>>> from cpattn.v4.handoff import collect, seed_cache
>>> from cpattn.v4.prefill import v4_prefill
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> g = SimMesh(1).groups()[0]
>>> h = collect(g, v4_prefill(g, v4.forward, params, cfg, Prompts.of([list(range(9)), list(range(20))])))
>>> lay = cfg.layout(block_size=4)
>>> flat = export_share(h, 1, lay, rank=0, size=1, interleave=1)
>>> flat.numel() == share_numel(lay, 20, rank=0, size=1, interleave=1)
True
>>> a = place_share(v4.empty_cache(cfg, batch=2, max_len=32, block_size=4), 1, 20, flat)
>>> alone = collect(g, v4_prefill(g, v4.forward, params, cfg, Prompts.of([list(range(20))])))
>>> b = seed_cache(v4.empty_cache(cfg, batch=1, max_len=32, block_size=4), alone)   # the same state, seeded alone
>>> sa, sb = a.live_state(), b.live_state()
>>> a.seq_lens, all(torch.allclose(sa[k][1:].nan_to_num(7), sb[k].nan_to_num(7), atol=1e-5) for k in sb
...                 if k.endswith(("window", "raw")))
((0, 20), True)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from cpattn.layout.dcp import dcp_slot_mapping
from cpattn.ops.rows import write_rows
from cpattn.v4.cache import V4Cache, V4Layout
from cpattn.v4.handoff import V4Handoff
from cpattn.v4.ring import ring_slots

RINGS = ("window", "raw", "index_raw")


def owned_entries(n: int, rank: int, size: int, interleave: int) -> list[int]:
    """Entries ``e < n`` that DCP rank ``rank`` of ``size`` owns: ``(e // interleave) % size == rank``.

    >>> owned_entries(7, 1, 2, 2)
    [2, 3, 6]
    """
    return [e for e in range(n) if (e // interleave) % size == rank]


def share_parts(lay: V4Layout, length: int, rank: int, size: int, interleave: int) -> Iterator[tuple]:
    """The payload's parts in order: (layer, tensor name, table name, positions or entry indices, row numel).

    Tensor names are :class:`~cpattn.v4.cache.V4Cache` fields ("window", "raw", "index_raw", "entries",
    "index_keys"); rings hold positions ``[max(0, L - back), L)``, entry caches this rank's entries."""
    d, di = lay.head_dim, lay.index_head_dim
    for layer, kind in enumerate(lay.kinds):
        rings = [("window", "window", d)]
        if kind != "sliding":
            rings.append(("raw", f"raw_{kind}", lay.raw_width(kind)))
        if kind == "csa":
            rings.append(("index_raw", "raw_csa", 4 * di))
        for name, table, width in rings:
            yield layer, name, table, list(range(max(0, length - lay.back(table)), length)), width
        if kind == "sliding":
            continue
        owned = owned_entries(length // lay.ratio(kind), rank, size, interleave)
        yield layer, "entries", f"ent_{kind}", owned, d
        if kind == "csa":
            yield layer, "index_keys", "ent_csa", owned, di


def share_numel(lay: V4Layout, length: int, *, rank: int, size: int, interleave: int) -> int:
    """Elements of a request's share (:func:`export_share`) for a rank, from the layout alone."""
    return sum(len(idx) * w for *_, idx, w in share_parts(lay, length, rank, size, interleave))


def export_share(h: V4Handoff, j: int, lay: V4Layout, *, rank: int, size: int, interleave: int) -> torch.Tensor:
    """Request ``j`` of hand-off ``h`` (its collected prefill state) for DCP rank ``rank`` of ``size``
    (entries interleaved by ``interleave``): one flat tensor in the model's dtype, :func:`share_parts` order."""
    length = h.lens[j]
    req, pos = h.tail.requests.long(), h.tail.positions.long()
    tails = {"window": h.tail.window, "raw": h.tail.raw, "index_raw": h.tail.index_raw}
    out = []
    for layer, name, table, idx, width in share_parts(lay, length, rank, size, interleave):
        if name in tails:
            src = tails[name][layer]
            mask = (req == j) & (pos >= length - lay.back(table))
            order = torch.argsort(pos[mask])
            rows = src[mask.to(src.device)][order.to(src.device)]
            if rows.shape[0] != len(idx):
                raise ValueError(f"request {j}: the hand-off holds {rows.shape[0]} rows of layer {layer}'s {name} "
                                 f"ring, its share needs {len(idx)}; pass the collected prefill state")
        else:
            kind = table[4:]
            src = h.entries.entries[layer] if name == "entries" else h.entries.index_keys[layer]
            at = int(h.entries.offsets[kind][j]) + torch.tensor(idx, dtype=torch.int64)
            rows = src[at.to(src.device)]
        out.append(rows.reshape(-1))
    return torch.cat(out) if out else torch.empty(0)


def place_share(cache: V4Cache, slot: int, length: int, flat: torch.Tensor) -> V4Cache:
    """Write a request's share (:func:`export_share` for this cache's DCP rank) into row ``slot``; returns the
    cache with ``seq_lens[slot] = high_water[slot] = length`` (the row's other state untouched)."""
    lay, bs = cache.layout, cache.layout.block_size
    want = share_numel(lay, length, rank=cache.dcp_rank, size=cache.dcp_size, interleave=cache.interleave_size)
    if flat.numel() != want:
        raise ValueError(f"a V4 share of {flat.numel()} elements, but a {length}-token request on DCP rank "
                         f"{cache.dcp_rank} of {cache.dcp_size} needs {want}: producer and consumer layouts differ")
    dev = cache.tables["window"].device
    at = 0
    for layer, name, table, idx, width in share_parts(lay, length, cache.dcp_rank, cache.dcp_size,
                                                      cache.interleave_size):
        n = len(idx) * width
        dst = getattr(cache, name)[layer]
        rows = flat[at:at + n].reshape(len(idx), *dst.shape[2:])
        at += n
        if not idx:
            continue
        where = torch.tensor(idx, dtype=torch.int64, device=dev)
        reqs = torch.full_like(where, slot)
        if name in RINGS:
            slots = ring_slots(cache.tables[table], bs, reqs, where)
        else:
            slots = dcp_slot_mapping(where, reqs, cache.tables[table], dcp_rank=cache.dcp_rank,
                                     dcp_size=cache.dcp_size, interleave_size=cache.interleave_size, block_size=bs)
            if bool((slots < 0).any()):
                raise ValueError(f"slot {slot}: the cache has no room for entry {idx[-1]} of layer {layer}; "
                                 "build it with max_len >= the request's length")
        write_rows(dst, rows.to(dst.device), slots)
    lens, high = list(cache.seq_lens), list(cache.high_water)
    lens[slot] = high[slot] = length
    return replace(cache, seq_lens=tuple(lens), high_water=tuple(high))
