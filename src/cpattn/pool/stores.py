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
from cpattn.pool.spec import check_pool_spec, split_spec


def open_store(spec: str, **options) -> BlockStore:
    """The backend a spec names; ``options`` go to its constructor.

    ``lmdb:DIR`` -> :class:`~cpattn.pool.lmdb_store.LMDBStore` (options:
    ``capacity_bytes``); ``mooncake:HOST:PORT`` ->
    :class:`~cpattn.pool.mooncake_store.MooncakeStore` (options:
    ``segment_bytes``, ``local_buffer_bytes``, ``prefix``, ...). Raises
    ValueError for a spec that can never be opened (:func:`~cpattn.pool.spec.check_pool_spec`) and
    :class:`~cpattn.pool.base.StoreUnavailable` when a store cannot serve (a Mooncake master that does
    not answer, an LMDB database that cannot be opened); a damaged LMDB file is replaced by an empty pool
    with one :class:`~cpattn.pool.base.PoolDamagedWarning`.
    """
    check_pool_spec(spec)  # ValueError, one line, for what can never be opened (a damaged pool is not that)
    kind, rest = split_spec(spec)
    if kind == "lmdb":
        from cpattn.pool.lmdb_store import LMDBStore

        return LMDBStore(rest, **options)
    from cpattn.pool.mooncake_store import MooncakeStore

    return MooncakeStore(rest, **options)


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
