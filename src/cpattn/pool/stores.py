"""Open a pool backend from a spec string: ``lmdb:DIR`` or ``mooncake:HOST:PORT``.

This is the form a command line takes (``--kv-pool lmdb:/tmp/pool``).

Example
-------
>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     s = open_store(f"lmdb:{d}", capacity_bytes=1 << 20)
...     type(s).__name__
...     s.close()
'LMDBStore'
>>> open_store("redis:x")
Traceback (most recent call last):
...
ValueError: unknown KV pool spec 'redis:x'; use lmdb:DIR or mooncake:HOST:PORT
"""

from __future__ import annotations

from cpattn.pool.base import BlockStore


def open_store(spec: str, **options) -> BlockStore:
    """The backend a spec names; ``options`` go to its constructor.

    ``lmdb:DIR`` -> :class:`~cpattn.pool.lmdb_store.LMDBStore` (options:
    ``capacity_bytes``); ``mooncake:HOST:PORT`` ->
    :class:`~cpattn.pool.mooncake_store.MooncakeStore` (options:
    ``segment_bytes``, ``local_buffer_bytes``, ``prefix``, ...). Raises
    :class:`~cpattn.pool.base.StoreUnavailable` when a Mooncake master does
    not answer.
    """
    kind, _, rest = spec.partition(":")
    if kind == "lmdb" and rest:
        from cpattn.pool.lmdb_store import LMDBStore

        return LMDBStore(rest, **options)
    if kind == "mooncake" and rest:
        from cpattn.pool.mooncake_store import MooncakeStore

        return MooncakeStore(rest, **options)
    raise ValueError(f"unknown KV pool spec {spec!r}; use lmdb:DIR or mooncake:HOST:PORT")


class _Closed:
    """Stands in for a store that could not be opened: every call raises StoreUnavailable."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self, *args):
        from cpattn.pool.base import StoreUnavailable

        raise StoreUnavailable(self.reason)

    exists = get = put = discard = _fail

    def close(self) -> None:
        pass


def open_pool(spec: str, identity, **options):
    """A :class:`~cpattn.pool.kv_pool.KVPool` on the backend ``spec`` names.

    A store that cannot be reached gives a pool that is already unavailable
    (one :class:`~cpattn.pool.kv_pool.PoolUnavailableWarning`, then every
    lookup is a miss): the run goes on cold instead of failing.

    Example
    -------
    >>> import tempfile, torch
    >>> from cpattn.pool import PoolIdentity
    >>> with tempfile.TemporaryDirectory() as d:
    ...     pool = open_pool(f"lmdb:{d}", PoolIdentity("m", torch.float16, 1, 2, 4))
    ...     pool.lookup(pool.keys([1, 2, 3, 4]))
    ...     pool.close()
    0
    """
    from cpattn.pool.base import StoreUnavailable
    from cpattn.pool.kv_pool import KVPool

    try:
        return KVPool(open_store(spec, **options), identity)
    except StoreUnavailable as err:
        pool = KVPool(_Closed(str(err)), identity)
        pool.mark_unavailable(str(err))
        return pool
