"""KV-cache pool: whole KV blocks shared across runs and parallel layouts.

A pool stores whole KV blocks under a chained prefix hash of their tokens::

    key_j = H(key_{j-1} | token ids of block j | model | cache dtype | [L, block_size, F])

(:func:`block_keys`). A key names a block and its whole prefix, and nothing
about the parallel layout, so a block written by one device, by PCP = P or
by DCP = N is found by any other. A payload is one block of all layers, a
tensor ``[L, block_size, F]`` in the cache dtype (the engine packs each
layer's K / V / indexer-key rows as the F columns); the pool returns its
exact bytes.

The protocol (:class:`KVPool`)
------------------------------
``pool.keys(tokens) -> list[str]``
    keys of the whole blocks of a request's tokens (a tail shorter than a
    block has none).
``pool.lookup(keys) -> int``
    how many leading keys are present (moves no data).
``pool.load(keys) -> list[Tensor]``
    the payloads of the leading keys that are present *and intact*; may be
    shorter than asked: use ``len(result)`` as the number of cached blocks.
``pool.store(keys, payloads) -> int``
    put-if-absent of whole blocks, after the prefill completes (not layer
    by layer); returns how many it wrote.

Guarantees: a missing, truncated or corrupt entry (CRC-32, key, dtype and
shape are checked by :mod:`cpattn.pool.codec`) is a miss, never wrong KV,
and a corrupt entry is dropped; concurrent writers of one key are harmless
(the first entry stays); a store that goes away (a killed Mooncake master)
degrades to misses and skipped stores after exactly one
:class:`PoolUnavailableWarning`, with bounded waits; each backend evicts
under a capacity limit.

Backends (:class:`BlockStore`): :class:`~cpattn.pool.lmdb_store.LMDBStore`
(embedded, a local directory, LRU eviction) and
:class:`~cpattn.pool.mooncake_store.MooncakeStore` (Mooncake Store over TCP;
memory from ``cpattn pool serve``, :mod:`cpattn.pool.server`).
:func:`open_pool` takes a spec: ``lmdb:DIR`` or ``mooncake:HOST:PORT``;
:func:`check_pool_spec` refuses (ValueError, one line) one that can never be
opened, before any rank starts and without importing torch. A damaged LMDB
pool is a cold pool with one :class:`PoolDamagedWarning`, never a crash.
Under DCP (interleave = block size) each rank stores and loads only its own
blocks: :func:`rank_blocks`.

Example
-------
>>> import tempfile, torch
>>> from cpattn.pool import PoolIdentity, open_pool
>>> ident = PoolIdentity("tiny", torch.bfloat16, num_layers=2, block_size=4, row_width=8)
>>> tokens = list(range(10))                       # 2 whole blocks + 2 tokens
>>> with tempfile.TemporaryDirectory() as d:
...     pool = open_pool(f"lmdb:{d}", ident)
...     keys = pool.keys(tokens)
...     blocks = [torch.randn(2, 4, 8).bfloat16() for _ in keys]
...     pool.lookup(keys)                          # cold
...     pool.store(keys, blocks)
...     got = pool.load(keys[: pool.lookup(keys)])   # warm
...     len(got), all(torch.equal(a, b) for a, b in zip(got, blocks))
...     pool.close()
0
2
(2, True)
"""

# public names -> their module, imported on first use (PEP 562): ``cpattn.pool.spec`` (what a command line
# checks before any rank starts) costs no import of torch
_EXPORTS = {
    **dict.fromkeys(("BlockStore", "DictStore", "StoreUnavailable", "PoolDamagedWarning"), "cpattn.pool.base"),
    **dict.fromkeys(("RankBlocks", "rank_blocks"), "cpattn.pool.dcp"),
    **dict.fromkeys(("PoolIdentity", "block_keys"), "cpattn.pool.keys"),
    **dict.fromkeys(("KVPool", "PoolStats", "PoolUnavailableWarning"), "cpattn.pool.kv_pool"),
    **dict.fromkeys(("open_pool", "open_store"), "cpattn.pool.stores"),
    **dict.fromkeys(("check_pool_spec", "pool_spec_problem"), "cpattn.pool.spec"),
    "model_digest": "cpattn.pool.fingerprint",
}

__all__ = list(_EXPORTS)

from cpattn._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
