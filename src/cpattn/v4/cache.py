"""DeepSeek-V4 attention state as explicit tensors: rings, compressed entries, indexer keys.

Per layer (``kinds[l]`` is "sliding", "csa" or "hca"; D = head_dim):

==============  =================================  ==============================
tensor          shape                              what
==============  =================================  ==============================
window[l]       [NB_w, BS, 1, D]                   ring of the last W + rewind keys
raw[l]          [NB_r, BS, 2C]                     compressor ring: ``[kv | gate]``
index_raw[l]    [NB_r, BS, 4 D_I]                  the CSA indexer's compressor ring
entries[l]      [NB_e, BS, 1, D]                   compressed entries (paged)
index_keys[l]   [NB_e, BS, D_I]                    indexer keys of the CSA entries
==============  =================================  ==============================

(C = 2D for CSA, D for HCA; layers without a compressor hold ``None``.) The
ring sizes are fixed per request (:func:`cpattn.v4.ring.ring_capacity`); the
entry caches grow with the context, one entry per ``m`` tokens (m = 4 for
CSA, 128 for HCA). Entry e of a request is owned by DCP rank
``(e // I) % N`` at local index ``(e // (I*N)) * I + e % I`` (the interleaved
DCP layout, :mod:`cpattn.layout.dcp`); on one device N = 1. Rings are
replicated on every DCP rank (see :mod:`cpattn.v4.attention`).

Block tables, one per kind of ring / entry cache, are shared by the layers:
``tables["window"]``, ``tables["raw_csa"]``, ``tables["ent_csa"]``, ... Lengths
are host ints (``seq_lens``), and so is ``high_water``, the largest length
each request ever reached: :meth:`V4Cache.rewind` may go back at most
``max_rewind`` tokens below it (the rings hold exactly that much extra).

Example
-------
>>> from cpattn.v4.cache import V4Cache, V4Layout
>>> lay = V4Layout(kinds=("sliding", "csa", "hca"), head_dim=16, window=8, csa_ratio=4, hca_ratio=16,
...                index_head_dim=8, max_rewind=3, block_size=4)
>>> cache = V4Cache.empty(lay, batch=2, max_len=64)
>>> cache.window[0].shape, cache.entries[1].shape, cache.entries[2].shape
(torch.Size([6, 4, 1, 16]), torch.Size([8, 4, 1, 16]), torch.Size([2, 4, 1, 16]))
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.v4.ring import ring_capacity, ring_slots

KINDS = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class V4Layout:
    """The static shape of V4 attention state (from the model config, plus serving choices).

    kinds: per layer "sliding" | "csa" | "hca"; head_dim: D (512); window: W
    (128); csa_ratio / hca_ratio: m (4 / 128); index_head_dim: D_I (128);
    max_rewind: tokens a cache may be rewound (speculative decoding: k);
    block_size: rows per block of every paged tensor.
    """

    kinds: tuple[str, ...]
    head_dim: int
    window: int
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_head_dim: int = 128
    max_rewind: int = 0
    block_size: int = 16

    def __post_init__(self):
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"layer kinds must be in {KINDS}; got {bad}")
        for name in ("head_dim", "window", "csa_ratio", "hca_ratio", "index_head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_rewind < 0:
            raise ValueError(f"max_rewind must be >= 0; got {self.max_rewind}")

    def ratio(self, kind: str) -> int:
        """Tokens per compressed entry of a compressed kind."""
        return {"csa": self.csa_ratio, "hca": self.hca_ratio}[kind]

    def back(self, ring: str) -> int:
        """Positions before a step's first token that a step reads from ring "window", "raw_csa" or "raw_hca"."""
        if ring == "window":
            return self.window - 1
        m = self.ratio(ring[4:])
        return 2 * m - 1 if ring == "raw_csa" else m - 1

    def raw_width(self, kind: str) -> int:
        """Row width of a compressor ring: ``[kv | gate]`` of C channels each."""
        return 4 * self.head_dim if kind == "csa" else 2 * self.head_dim


@dataclass(frozen=True)
class V4Cache:
    """The state of B requests (see the module doc). Tensors are written in place by steps;
    lengths only change through :meth:`cpattn.v4.step.V4Step.finish` and :meth:`rewind`."""

    layout: V4Layout
    window: tuple[torch.Tensor, ...]
    raw: tuple[torch.Tensor | None, ...]
    index_raw: tuple[torch.Tensor | None, ...]
    entries: tuple[torch.Tensor | None, ...]
    index_keys: tuple[torch.Tensor | None, ...]
    tables: dict[str, torch.Tensor]
    seq_lens: tuple[int, ...]
    high_water: tuple[int, ...]
    dcp_rank: int = 0
    dcp_size: int = 1
    interleave_size: int = 1
    max_len: int = 0  # tokens per request the entry caches can hold (0: unchecked)

    @classmethod
    def empty(
        cls,
        layout: V4Layout,
        *,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        dcp_rank: int = 0,
        dcp_size: int = 1,
        interleave_size: int = 1,
        seed: int | None = None,
    ) -> V4Cache:
        """An empty cache for ``batch`` requests of up to ``max_len`` tokens, NaN-poisoned.

        Every request gets whole blocks of each table; ``seed`` shuffles the
        block ids (tests: nothing may assume blocks are in order). Entry
        caches hold this DCP rank's share only.
        """
        lay, bs = layout, layout.block_size
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        tables: dict[str, torch.Tensor] = {}

        def table(name: str, per: int) -> torch.Tensor:
            ids = torch.randperm(batch * per, generator=g) if g is not None else torch.arange(batch * per)
            tables[name] = ids.view(batch, per).to(device)
            return tables[name]

        def blank(t: torch.Tensor, *row: int) -> torch.Tensor:
            return torch.full((t.numel(), bs, *row), float("nan"), dtype=dtype, device=device)

        kinds = set(lay.kinds)
        table("window", ring_capacity(lay.back("window"), lay.max_rewind, bs) // bs)
        for k in ("csa", "hca"):
            if k in kinds:
                table(f"raw_{k}", ring_capacity(lay.back(f"raw_{k}"), lay.max_rewind, bs) // bs)
                n_entries = max_len // lay.ratio(k)
                local = int(dcp_local_lens(torch.tensor([n_entries]), dcp_size, interleave_size)[0].max())
                table(f"ent_{k}", max(1, -(-local // bs)))
        d, di = lay.head_dim, lay.index_head_dim
        win, raw, iraw, ent, ik = [], [], [], [], []
        for k in lay.kinds:
            win.append(blank(tables["window"], 1, d))
            comp = k != "sliding"
            raw.append(blank(tables[f"raw_{k}"], lay.raw_width(k)) if comp else None)
            ent.append(blank(tables[f"ent_{k}"], 1, d) if comp else None)
            iraw.append(blank(tables["raw_csa"], 4 * di) if k == "csa" else None)
            ik.append(blank(tables["ent_csa"], di) if k == "csa" else None)
        zeros = (0,) * batch
        return cls(lay, tuple(win), tuple(raw), tuple(iraw), tuple(ent), tuple(ik), tables, zeros, zeros,
                   dcp_rank, dcp_size, interleave_size, max_len)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    def kv_bytes(self) -> int:
        """Bytes of this rank's storage (every ring, entry cache and indexer-key cache, allocated).

        >>> lay = V4Layout(kinds=("sliding",), head_dim=4, window=4, block_size=2)
        >>> V4Cache.empty(lay, batch=1, max_len=8).kv_bytes()  # a ring of 2 blocks x 2 rows x 4 float32
        64
        """
        ts = (*self.window, *self.raw, *self.index_raw, *self.entries, *self.index_keys)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def rewind(self, counts: list[int] | tuple[int, ...], *, poison: bool = True) -> V4Cache:
        """Drop the last ``counts[b]`` tokens of each request (rejected speculative tokens).

        Allowed while the new length is at least ``high_water - max_rewind``.
        With ``poison`` the dropped rows (ring slots and compressed entries)
        are set to NaN again, so an append-then-rewind restores every cache
        tensor bit for bit and nothing can read a dropped row unnoticed.

        >>> from cpattn.v4.cache import V4Cache, V4Layout
        >>> lay = V4Layout(kinds=("sliding",), head_dim=4, window=4, max_rewind=2, block_size=2)
        >>> c = replace(V4Cache.empty(lay, batch=1, max_len=8), seq_lens=(5,), high_water=(5,))
        >>> c.rewind([2]).seq_lens
        (3,)
        """
        counts = [int(c) for c in counts]
        lay = self.layout
        if len(counts) != self.batch:
            raise ValueError(f"counts must hold one int per request ({self.batch}); got {counts}")
        new = []
        for b, (n, c, hw) in enumerate(zip(self.seq_lens, counts, self.high_water)):
            if c < 0 or c > n or n - c < hw - lay.max_rewind:
                raise ValueError(
                    f"request {b}: cannot rewind {c} of {n} tokens; a cache rewinds at most max_rewind="
                    f"{lay.max_rewind} below the highest length it held ({hw}). Raise max_rewind"
                )
            new.append(n - c)
        if poison:
            self._poison(new)
        return replace(self, seq_lens=tuple(new))

    def _poison(self, new: list[int]) -> None:
        lay, bs, dev = self.layout, self.layout.block_size, self.tables["window"].device
        req = torch.tensor([b for b, (a, z) in enumerate(zip(new, self.seq_lens)) for _ in range(a, z)],
                           dtype=torch.int64, device=dev)
        pos = torch.tensor([p for a, z in zip(new, self.seq_lens) for p in range(a, z)], dtype=torch.int64, device=dev)
        if pos.numel() == 0:
            return
        for name, tensors in (("window", self.window), ("raw", self.raw), ("index_raw", self.index_raw)):
            for k, t in zip(lay.kinds, tensors):
                if t is not None:
                    tab = self.tables["window" if name == "window" else f"raw_{k}"]
                    t.view(-1, *t.shape[2:])[ring_slots(tab, bs, req, pos)] = float("nan")
        for k in ("csa", "hca"):
            m = lay.ratio(k)
            ent = [(b, e) for b, (a, z) in enumerate(zip(new, self.seq_lens)) for e in range(a // m, z // m)]
            if k not in lay.kinds or not ent:
                continue
            slots = dcp_slot_mapping(torch.tensor([e for _, e in ent], device=dev),
                                     torch.tensor([b for b, _ in ent], device=dev), self.tables[f"ent_{k}"],
                                     dcp_rank=self.dcp_rank, dcp_size=self.dcp_size, interleave_size=self.interleave_size,
                                     block_size=bs)
            slots = slots[slots >= 0]
            for kind, ents, keys in zip(lay.kinds, self.entries, self.index_keys):
                if kind == k:
                    ents.view(-1, *ents.shape[2:])[slots] = float("nan")
                    if keys is not None:
                        keys.view(-1, keys.shape[-1])[slots] = float("nan")

    def live_state(self) -> dict[str, torch.Tensor]:
        """Everything a later step can read, position-ordered: ring rows at positions
        ``[L - back, L)`` per request ([B, back, *row], NaN before position 0), the
        entry caches whole, and the lengths. Two caches with bit-identical live
        states produce bit-identical results from here on."""
        lay, bs = self.layout, self.layout.block_size
        dev = self.tables["window"].device
        out: dict[str, torch.Tensor] = {"seq_lens": torch.tensor(self.seq_lens)}
        for l, k in enumerate(lay.kinds):
            rings = [("window", self.window[l], "window")]
            if k != "sliding":
                rings.append(("raw", self.raw[l], f"raw_{k}"))
                out[f"{l}.entries"] = self.entries[l]
            if k == "csa":
                rings.append(("index_raw", self.index_raw[l], "raw_csa"))
                out[f"{l}.index_keys"] = self.index_keys[l]
            for name, t, tab in rings:
                back = lay.back(tab)
                pos = torch.tensor([[n - back + j for j in range(back)] for n in self.seq_lens],
                                   device=dev)  # [B, back]
                req = torch.arange(self.batch, device=dev)[:, None].expand_as(pos)
                rows = t.view(-1, *t.shape[2:])[ring_slots(self.tables[tab], bs, req.reshape(-1),
                                                           pos.clamp(min=0).reshape(-1))]
                rows = torch.where((pos.reshape(-1) >= 0).view(-1, *([1] * (rows.dim() - 1))), rows, float("nan"))
                out[f"{l}.{name}"] = rows.view(self.batch, back, *t.shape[2:])
        return out
