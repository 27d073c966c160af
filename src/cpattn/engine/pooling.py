"""The KV pool around a run: load each request's cached prefix before prefill, store new whole blocks after.

A pool (:mod:`cpattn.pool`) keys whole blocks of ``block_size`` tokens by a
chained hash of the tokens, so what one layout stored any other finds. The
engine's payload for a block is its rows ``[1, block_size, F]``
(:mod:`cpattn.engine.kv_rows`: every layer's columns side by side, so
layers may differ in width; the pool sees one "layer" of F columns).

- **identity** (:func:`pool_identity`): the engine names the model by its
  content -- a digest of the config and every weight
  (:func:`cpattn.pool.fingerprint.model_digest`), the KV layout, the cache
  dtype and the block size -- never by a name or path a caller passes, so
  new weights (saved over the same path, or another checkpoint of the same
  name) find a cold pool, never another model's KV;
- **load** (:func:`load_prefix`): the whole blocks of each prompt found in
  the pool -- the same count on every rank (the minimum over the world, one
  small all-reduce), and always at least one prompt token left to compute --
  become the :class:`~cpattn.engine.prefill_steps.Prefix` the prefill starts
  from (every prefill rank needs all of it: each new token attends the whole prefix);
- **store** (:func:`store_blocks`): after the hand-off, each decode rank
  stores the whole prompt blocks it owns, read from its own cache: with
  interleave = block size, global block j lives on DCP rank j % N, so the
  ranks store disjoint blocks with no collective; each store renews the
  prompt's whole chain for eviction, root last (``KVPool.store(...,
  chain=)``), so a pool under pressure drops the tails of chains first and
  keeps the longest prefixes it can hold.

Example
-------
>>> import torch
>>> from cpattn.pool import DictStore, KVPool, PoolIdentity
>>> pool = KVPool(DictStore(), PoolIdentity("toy", torch.float32, num_layers=1, block_size=2, row_width=3))
>>> keys = pool.keys([1, 2, 3, 4, 5])           # two whole blocks
>>> pool.store(keys, [torch.ones(1, 2, 3), torch.zeros(1, 2, 3)])
2
>>> hits([[1, 2, 3, 4, 5]], pool)                # both cached, one token left to compute
[2]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.engine.batch import Prompts
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.prefill_steps import Prefix
from cpattn.layout.dcp import owned_blocks


@dataclass(frozen=True)
class PoolFacts:
    """What the pool did for this rank: blocks found (per request), loaded and stored; bytes loaded and stored;
    seconds spent looking up and loading (``load_s``) and storing (``store_s``)."""

    hit_blocks: tuple[int, ...] = ()
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0


def pool_identity(family, cfg, params: dict, block_size: int, *, label: str = ""):
    """The :class:`~cpattn.pool.PoolIdentity` of a model's blocks: its weights and config digest, KV layout,
    cache dtype (the params' :func:`~cpattn.models.family.param_dtype`) and ``block_size``; ``label`` is an
    extra namespace (a changed label is a cold pool too, a shared one shares nothing across weights).

    >>> import torch
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> a = pool_identity(qwen3.FAMILY, cfg, qwen3.init_params(cfg, seed=0), 4)
    >>> a.block_shape, a == pool_identity(qwen3.FAMILY, cfg, qwen3.init_params(cfg, seed=0), 4)
    ((1, 4, 16), True)
    >>> a == pool_identity(qwen3.FAMILY, cfg, qwen3.init_params(cfg, seed=1), 4)   # other weights
    False
    """
    from cpattn.models.family import param_dtype
    from cpattn.engine.kv_rows import row_width
    from cpattn.pool import PoolIdentity
    from cpattn.pool.fingerprint import model_digest

    layouts = tuple(family.kv_layouts(cfg))
    layout = f"{getattr(family, 'name', type(family).__name__)}:{layouts!r}"
    return PoolIdentity(label, param_dtype(params), num_layers=1, block_size=block_size,
                        row_width=row_width(layouts), weights=model_digest(params, cfg), layout=layout)


@dataclass(frozen=True)
class PoolSpec:
    """A pool to open on every rank (picklable, unlike an open pool): ``spec`` as :func:`cpattn.pool.open_pool`
    takes it ("lmdb:DIR", "mooncake:HOST:PORT"); ``model``: an optional label, a namespace of its own.

    The weights are named by the engine itself (:func:`pool_identity`: a
    digest of the config and weights), not by ``model``: two checkpoints of
    one name, or new weights saved over one path, never share blocks.
    Ranks that are threads of one process (the simulated mesh) share one open
    pool: LMDB allows one environment per directory and process.
    """

    spec: str
    model: str = ""

    def __post_init__(self) -> None:
        from cpattn.pool.spec import check_pool_spec

        check_pool_spec(self.spec)  # one-line ValueError where the pool is named, before any rank opens it

    def open_for(self, family, cfg, params: dict, block_size: int):
        """The open :class:`~cpattn.pool.KVPool` of this model's blocks (:func:`pool_identity`, ``model`` as
        the label); :func:`release` it when done."""
        return self._open(pool_identity(family, cfg, params, block_size, label=self.model))

    def open(self, dtype: torch.dtype, block_size: int, row_width: int):
        """The open pool for blocks of ``[1, block_size, row_width]`` in ``dtype`` keyed by the ``model`` label
        alone (no weights digest: the label must change with the weights). The engine uses :meth:`open_for`."""
        from cpattn.pool import PoolIdentity

        return self._open(PoolIdentity(self.model, dtype, num_layers=1, block_size=block_size, row_width=row_width))

    def _open(self, ident):
        from cpattn.pool import open_pool

        with _LOCK:
            pool, users = _OPEN.get((self.spec, ident), (None, 0))
            if pool is None:
                pool = open_pool(self.spec, ident)
            _OPEN[self.spec, ident] = (pool, users + 1)
        return pool


_LOCK = threading.Lock()
_OPEN: dict = {}  # (spec, identity) -> (open pool, users in this process)


def open_for_run(pool, family, cfg, params: dict, block_size: int):
    """(the pool a run uses, whether this call opened it) for ``pool`` as :func:`~cpattn.engine.driver.
    generate_on_rank` takes it: None; a :class:`PoolSpec` (opened here, :func:`release` it); or an open
    :class:`~cpattn.pool.KVPool`, whose store is used under this model's identity (:func:`pool_identity`,
    its own ``model`` kept as the label) -- whatever identity the caller built, the keys name these weights."""
    if pool is None:
        return None, False
    if isinstance(pool, PoolSpec):
        return pool.open_for(family, cfg, params, block_size), True
    ident = pool_identity(family, cfg, params, block_size, label=pool.identity.model)
    return (pool if pool.identity == ident else pool.with_identity(ident)), False


def release(pool) -> None:
    """Give back a pool from :meth:`PoolSpec.open`; the last user of this process closes it."""
    with _LOCK:
        for key, (open_, users) in list(_OPEN.items()):
            if open_ is pool:
                if users > 1:
                    _OPEN[key] = (open_, users - 1)
                else:
                    del _OPEN[key]
                    pool.close()
                return
    pool.close()


def hits(prompts: list[list[int]], pool) -> list[int]:
    """Whole cached blocks per prompt, leaving at least one token of each prompt to compute."""
    bs = pool.identity.block_size
    return [min(pool.lookup(pool.keys(p)), (len(p) - 1) // bs) for p in prompts]


def _agreed(world: Group, counts: list[int]) -> list[int]:
    """The per-request minimum of ``counts`` over every rank of ``world`` (one small all-gather)."""
    t = torch.tensor(counts, dtype=torch.int64)
    return (world.all_gather(t[None], dim=0).min(0).values if world.size > 1 else t).tolist()


def _load(world: Group, prompts: Prompts, pool, rank: int | None = None, dcp_size: int = 1):
    """(blocks per request agreed by every rank of ``world``, {(request, global block): payload [B, F]} this
    rank loaded below them, seconds): every block (``rank`` None) or those with j % dcp_size == rank."""
    t0 = time.perf_counter()
    lists = prompts.lists()
    found = _agreed(world, hits(lists, pool))  # every rank must start from the same prefix
    bs, counts, got = pool.identity.block_size, [], {}
    for b, (p, n) in enumerate(zip(lists, found)):
        js = list(range(n)) if rank is None else list(owned_blocks(n, rank, dcp_size))
        keys = pool.keys(p)
        loaded = pool.load([keys[j] for j in js]) if js else []
        got.update({(b, j): t.reshape(bs, -1) for j, t in zip(js, loaded)})
        counts.append(n if len(loaded) == len(js) else js[len(loaded)])  # an entry lost since lookup is a miss
    counts = _agreed(world, counts)  # ... on every rank alike
    return counts, {k: v for k, v in got.items() if k[1] < counts[k[0]]}, time.perf_counter() - t0


def _load_facts(counts, got, seconds) -> PoolFacts:
    return PoolFacts(hit_blocks=tuple(counts), blocks_loaded=len(got),
                     bytes_loaded=sum(t.numel() * t.element_size() for t in got.values()), load_s=seconds)


def load_prefix(world: Group, prompts: Prompts, pool) -> tuple[Prefix | None, PoolFacts]:
    """The cached prefix of every prompt (the same on every rank of ``world``), or None when nothing is cached."""
    counts, got, seconds = _load(world, prompts, pool)
    bs = pool.identity.block_size
    blocks = [got[b, j] for b, n in enumerate(counts) for j in range(n)]
    prefix = Prefix(torch.cat(blocks), tuple(n * bs for n in counts)) if blocks else None
    return prefix, _load_facts(counts, got, seconds)


def load_owned(world: Group, prompts: Prompts, pool, *, rank: int, dcp_size: int):
    """P/D: a decode rank's share of the cached prefix, while the prefill ranks :func:`load_prefix` over the
    same ``world`` (every rank agrees on the counts). Returns (``[(request, local block j // N, payload
    [block_size, F])]`` for the cached global blocks j with j % N == ``rank``, as
    :func:`~cpattn.engine.handoff.place_blocks` takes them; blocks cached per request; :class:`PoolFacts`).

    >>> import torch, cpattn
    >>> from cpattn.pool import DictStore, KVPool, PoolIdentity
    >>> pool = KVPool(DictStore(), PoolIdentity("toy", torch.float32, num_layers=1, block_size=2, row_width=3))
    >>> p = Prompts.of([[1, 2, 3, 4, 5]])
    >>> pool.store(pool.keys([1, 2, 3, 4, 5]), [torch.full((1, 2, 3), float(j)) for j in range(2)])
    2
    >>> def rank(g):  # rank 0 prefills from the whole prefix; ranks 1, 2 decode (N = 2), each its own block
    ...     if g.rank == 0:
    ...         return load_prefix(g, p, pool)[0].context_lens
    ...     placed, counts, _ = load_owned(g, p, pool, rank=g.rank - 1, dcp_size=2)
    ...     return [(b, i, float(t[0, 0])) for b, i, t in placed], counts
    >>> cpattn.simulate(3, rank)
    [(4,), ([(0, 0, 0.0)], [2]), ([(0, 0, 1.0)], [2])]
    """
    counts, got, seconds = _load(world, prompts, pool, rank, dcp_size)
    placed = [(b, j // dcp_size, t) for (b, j), t in sorted(got.items(), key=lambda kv: kv[0])]
    return placed, counts, _load_facts(counts, got, seconds)


def store_blocks(shard: PagedShard, prompts: Prompts, pool, *, rank: int, dcp_size: int,
                 skip: tuple[int, ...] = ()) -> PoolFacts:
    """Store the whole prompt blocks this decode rank owns (global block j on rank j % N), past ``skip[b]``
    blocks of request b (already in the pool). Needs interleave = block size when ``dcp_size > 1``."""
    if dcp_size > 1 and shard.interleave_size != shard.block_size:
        raise ValueError(f"a DCP rank stores whole blocks only with cp_kv_cache_interleave_size == block_size; got "
                         f"{shard.interleave_size} and {shard.block_size}")
    t0 = time.perf_counter()
    stored, per_block = 0, 0
    for b, p in enumerate(prompts.lists()):
        chain = pool.keys(p)
        keys, payloads = [], []
        for j in owned_blocks(len(chain), rank, dcp_size, start=skip[b] if skip else 0):
            keys.append(chain[j])
            payloads.append(shard.read_block(int(shard.block_table[b, j // dcp_size]))[None])  # [1, B, F]
        if chain:  # the whole chain is renewed with the new blocks, root last, whatever rank stored which
            stored += pool.store(keys, payloads, chain=chain)
        per_block = payloads[0].numel() * payloads[0].element_size() if payloads else per_block
    return PoolFacts(blocks_stored=stored, bytes_stored=stored * per_block, store_s=time.perf_counter() - t0)
