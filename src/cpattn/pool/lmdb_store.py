"""The embedded pool backend: an LMDB database in a local directory, no server.

Entries live in LMDB (memory-mapped B+tree, one writer at a time across
processes, readers never blocked), so every process on the machine that
opens the same directory shares one pool, and the pool outlives the run.

Eviction: least recently used, by an access stamp. Every entry carries a
stamp from a counter stored in the database (so it orders accesses across
processes); ``put`` / ``put_chain``, ``get`` hits and ``touch`` renew it
in the order the keys are given, the last most recent (``exists`` does not).
:class:`~cpattn.pool.kv_pool.KVPool` gives a chain deepest first, so a
chain's tail is older than its root and goes first (leaves before roots).
When the entries' bytes exceed ``capacity_bytes``, entries are dropped from
the oldest stamp up until they fit, as each entry is written (a batch
larger than the capacity keeps its last entries), in the same transaction. The LMDB map (the file's maximum size) is ``2 * capacity +
64 MiB`` to leave room for LMDB's copy-on-write pages.

Layout (named sub-databases): ``blocks`` key -> entry; ``stamps`` key ->
stamp; ``lru`` stamp (8 bytes big-endian) + key -> nothing, iterated
oldest first; ``meta`` ``clock`` (last stamp) and ``used`` (entry bytes).

Durability: the environment is opened without fsync per commit
(``sync=False``): a crashed *process* loses nothing committed; an operating
system crash may lose the last commits (LMDB keeps the database consistent).
A pool is a cache, so that trade is right; corrupt entries are caught by the
codec anyway.

Example
-------
>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     s = LMDBStore(d, capacity_bytes=10)
...     s.put(["a", "b"], [b"12345", b"67890"]), s.get(["a"]), s.put(["c"], [b"xyz"]), s.exists(["a", "b", "c"])
...     s.close()
([True, True], [b'12345'], [True], [True, False, True])
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import warnings
from collections.abc import Sequence

from cpattn.pool.base import PoolDamagedWarning, StoreUnavailable
from cpattn.pool.spec import lmdb_file_damage, lmdb_path_problem

_U64 = struct.Struct(">Q")
_MAP_SLACK = 64 << 20

# One lmdb.Environment per database file per process: LMDB forbids opening the
# same file twice in one process. Stores on one path share it (reference-counted).
_ENVS: dict[str, list] = {}
_ENVS_LOCK = threading.Lock()


def import_lmdb():
    """The ``lmdb`` module, or ImportError saying how to install it."""
    try:
        import lmdb  # noqa: PLC0415 - optional dependency
    except ImportError as err:
        raise ImportError(f"the LMDB pool needs the lmdb package ({err}); pip install 'cpattn[pool]'") from err
    return lmdb


class LMDBStore:
    """A :class:`~cpattn.pool.base.BlockStore` in an LMDB directory with LRU eviction.

    Arguments
    ---------
    path: directory of the database (created if missing).
    capacity_bytes: the most entry bytes kept; older entries are evicted past it.
        Each process applies its own limit when it writes.

    Attributes ``env`` and ``blocks_db`` (the raw LMDB handles) are there for
    tools and tests.
    """

    def __init__(self, path: str | os.PathLike, *, capacity_bytes: int = 4 << 30) -> None:
        lmdb = import_lmdb()
        self._lmdb = lmdb
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive; got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        why = lmdb_path_problem(os.fspath(path))
        if why is not None:
            raise ValueError(f"KV pool 'lmdb:{os.fspath(path)}': {why}")
        os.makedirs(path, exist_ok=True)
        self.path = os.path.realpath(path)
        self._closed = True  # until opened
        with _ENVS_LOCK:
            fresh = self.path not in _ENVS
            if fresh:
                self.env = self._open_env()
                _ENVS[self.path] = [self.env, 1]
            else:
                _ENVS[self.path][1] += 1
                self.env = _ENVS[self.path][0]
        self._closed = False
        try:
            self.blocks_db = self.env.open_db(b"blocks")
            self._stamps = self.env.open_db(b"stamps")
            self._lru = self.env.open_db(b"lru")
            self._meta = self.env.open_db(b"meta")
            if fresh:  # once per process; a record damaged later is caught where it is read
                self._check_bookkeeping()
        except (lmdb.Error, _Damaged, struct.error) as err:
            if isinstance(err, lmdb.MapFullError):
                raise
            self.close()
            raise StoreUnavailable(f"LMDB pool {self.path} is damaged ({err}); delete the directory to start a "
                                   "new pool") from err

    def _open_env(self):
        """The environment, after checking the file against its own header (under a lock shared by every
        process of the machine): a damaged ``data.mdb`` is moved aside and an empty pool started, one warning."""
        lmdb = self._lmdb
        with open(os.path.join(self.path, ".cpattn-open.lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process at a time checks and, if need be, replaces the file
            why = lmdb_file_damage(self.path)
            if why is not None:
                data = os.path.join(self.path, "data.mdb")
                os.replace(data, data + ".damaged")
                try:  # a process still holding the old file keeps its lock file; new ones get a new pair
                    os.remove(os.path.join(self.path, "lock.mdb"))
                except FileNotFoundError:
                    pass
                warnings.warn(f"cpattn KV pool: {data} is damaged ({why}); moved it to data.mdb.damaged and "
                              "started an empty pool (this run is cold; nothing wrong is served)",
                              PoolDamagedWarning, stacklevel=4)
            try:
                return lmdb.open(
                    self.path, map_size=2 * self.capacity_bytes + _MAP_SLACK, max_dbs=4, subdir=True,
                    sync=False, metasync=False, readahead=False, max_readers=256,
                )
            except lmdb.Error as err:
                raise StoreUnavailable(f"LMDB pool {self.path} cannot be opened ({err}); delete the directory to "
                                       "start a new pool") from err

    def _check_bookkeeping(self) -> None:
        """Every stamp and meta record 8 bytes, every LRU key a stamp and a key; else rebuild them from the
        stored entries (one warning). Reads keys and small values only."""
        problem = None
        with self.env.begin() as txn:
            for name in (b"clock", b"used"):
                v = txn.get(name, db=self._meta)
                if v is not None and len(v) != 8:
                    problem = f"meta record {name.decode()!r} is {len(v)} bytes, expected 8"
            if problem is None:
                with txn.cursor(db=self._stamps) as cur:
                    bad = next((k for k, v in cur if len(v) != 8), None)
                if bad is not None:
                    problem = f"the stamp of {bad.decode(errors='replace')!r} is not 8 bytes"
            if problem is None:
                with txn.cursor(db=self._lru) as cur:
                    bad = next((k for k, _ in cur if len(k) <= 8), None)
                if bad is not None:
                    problem = f"an LRU record of {len(bad)} bytes (expected a stamp and a key)"
        if problem is None:
            return
        with self.env.begin(write=True) as txn:
            txn.drop(self._stamps, delete=False)
            txn.drop(self._lru, delete=False)
            clock = used = 0
            with txn.cursor(db=self.blocks_db) as cur:
                entries = [(k, len(v)) for k, v in cur]
            for kb, n in entries:
                clock += 1
                txn.put(kb, _U64.pack(clock), db=self._stamps)
                txn.put(_U64.pack(clock) + kb, b"", db=self._lru)
                used += n
            txn.put(b"clock", _U64.pack(clock), db=self._meta)
            txn.put(b"used", _U64.pack(used), db=self._meta)
        warnings.warn(f"cpattn KV pool: {self.path}: {problem}; rebuilt the eviction records of its {len(entries)} "
                      "entries (each entry is still checked when loaded)", PoolDamagedWarning, stacklevel=3)

    # -- reads -------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._txn(write=False) as txn:
            return [txn.get(k.encode(), db=self._stamps) is not None for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._txn(write=False) as txn:
            out = [txn.get(k.encode(), db=self.blocks_db) for k in keys]  # bytes copies
        self.touch([k for k, v in zip(keys, out) if v is not None])
        return out

    def touch(self, keys: Sequence[str]) -> None:
        """Renew the present keys' stamps in this order (the last most recent); no data moves."""
        if not keys:
            return
        with self._txn(write=True) as txn:
            clock = self._clock(txn)
            for k in keys:
                if txn.get(k.encode(), db=self._stamps) is not None:  # not evicted meanwhile
                    clock += 1
                    self._touch(txn, k.encode(), clock)
            txn.put(b"clock", _U64.pack(clock), db=self._meta)

    # -- writes ------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        if len(keys) != len(blobs):
            raise ValueError(f"put() got {len(keys)} keys but {len(blobs)} blobs")
        if any(b is None for b in blobs):
            raise ValueError("put() got a None blob; use put_chain() to renew keys without writing them")
        return self.put_chain(keys, blobs)

    def put_chain(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        """Put-if-absent where a blob is given; renew every present key (a ``None`` blob: renew only).

        Stamps follow the order of ``keys`` (the last most recent). The
        present keys are renewed first, then the new entries are written,
        the oldest entries evicted as each one lands -- so renewing a chain
        and adding to it in one call never evicts its renewed prefix for its
        new tail. Returns, per key, whether it has an entry afterwards.
        """
        if len(keys) != len(blobs):
            raise ValueError(f"put_chain() got {len(keys)} keys but {len(blobs)} blobs")
        try:
            return self._put(keys, blobs)
        except self._lmdb.MapFullError:  # copy-on-write pages ran out: make room, try once more
            self._evict_to(self.capacity_bytes // 2)
            try:
                return self._put(keys, blobs)
            except self._lmdb.MapFullError:
                return [False] * len(keys)

    def _put(self, keys, blobs) -> list[bool]:
        with self._txn(write=True) as txn:
            clock, used = self._clock(txn), self._used(txn)
            stamps = {k: clock + 1 + i for i, k in enumerate(keys)}
            clock += len(keys)
            had = set()
            for k in keys:  # renew what is there first (first writer wins) ...
                kb = k.encode()
                if txn.get(kb, db=self._stamps) is not None:
                    self._touch(txn, kb, stamps[k])
                    had.add(k)
            for k, blob in zip(keys, blobs):  # ... then write the rest, evicting the oldest as each lands
                if k in had or blob is None or len(blob) > self.capacity_bytes:  # too large: could never fit
                    continue
                kb = k.encode()
                txn.put(kb, blob, db=self.blocks_db)
                txn.put(kb, _U64.pack(stamps[k]), db=self._stamps)
                txn.put(_U64.pack(stamps[k]) + kb, b"", db=self._lru)
                used = self._evict(txn, used + len(blob), self.capacity_bytes)
            txn.put(b"clock", _U64.pack(clock), db=self._meta)
            txn.put(b"used", _U64.pack(max(used, 0)), db=self._meta)
            return [txn.get(k.encode(), db=self._stamps) is not None for k in keys]

    def discard(self, keys: Sequence[str]) -> None:
        with self._txn(write=True) as txn:
            used = self._used(txn)
            for k in keys:
                used -= self._drop(txn, k.encode())
            txn.put(b"used", _U64.pack(max(used, 0)), db=self._meta)

    def used_bytes(self) -> int:
        """Bytes of the entries held now."""
        with self._txn(write=False) as txn:
            return self._used(txn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _ENVS_LOCK:
            entry = _ENVS.get(self.path)
            if entry is not None and entry[0] is self.env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[self.path]
                    self.env.close()

    # -- helpers -----------------------------------------------------------------------------
    def _txn(self, write: bool):
        if self._closed:
            raise StoreUnavailable(f"LMDB store {self.path} is closed")
        try:
            return _Txn(self.env.begin(write=write), self._lmdb)
        except self._lmdb.Error as err:
            raise StoreUnavailable(f"LMDB at {self.path}: {err}") from err

    def _clock(self, txn) -> int:
        return _u64(txn.get(b"clock", db=self._meta), "meta record 'clock'")

    def _used(self, txn) -> int:
        return _u64(txn.get(b"used", db=self._meta), "meta record 'used'")

    def _touch(self, txn, kb: bytes, clock: int) -> None:
        old = txn.get(kb, db=self._stamps)
        if old is not None:
            _u64(old, "a stamp")
            txn.delete(old + kb, db=self._lru)
        txn.put(kb, _U64.pack(clock), db=self._stamps)
        txn.put(_U64.pack(clock) + kb, b"", db=self._lru)

    def _drop(self, txn, kb: bytes) -> int:
        """Delete one entry; returns its size (0 if absent)."""
        stamp = txn.get(kb, db=self._stamps)
        if stamp is None:
            return 0
        blob = txn.get(kb, db=self.blocks_db)
        txn.delete(kb, db=self._stamps)
        txn.delete(stamp + kb, db=self._lru)
        txn.delete(kb, db=self.blocks_db)
        return len(blob) if blob is not None else 0

    def _evict(self, txn, used: int, limit: int) -> int:
        if used <= limit:
            return used
        cur = txn.cursor(db=self._lru)
        victims = []
        if cur.first():
            for lru_key, _ in cur:
                if used <= limit:
                    break
                if len(lru_key) <= 8:
                    raise _Damaged(f"an LRU record of {len(lru_key)} bytes (expected a stamp and a key)")
                kb = lru_key[8:]
                blob = txn.get(kb, db=self.blocks_db)
                used -= len(blob) if blob is not None else 0
                victims.append(kb)
        cur.close()
        for kb in victims:
            self._drop(txn, kb)
        return used

    def _evict_to(self, limit: int) -> None:
        with self._txn(write=True) as txn:
            used = self._evict(txn, self._used(txn), limit)
            txn.put(b"used", _U64.pack(max(used, 0)), db=self._meta)


class _Damaged(ValueError):
    """A bookkeeping record of the wrong form (found while the store runs: the pool stops using it)."""


def _u64(v: bytes | None, what: str) -> int:
    """An 8-byte big-endian counter record (0 when absent); _Damaged for any other length."""
    if v is None:
        return 0
    if len(v) != 8:
        raise _Damaged(f"{what} is {len(v)} bytes, expected 8")
    return _U64.unpack(v)[0]


class _Txn:
    """A transaction context that turns LMDB errors and damaged records into StoreUnavailable (MapFullError
    passes through)."""

    def __init__(self, txn, lmdb) -> None:
        self.txn, self.lmdb = txn, lmdb

    def __enter__(self):
        return self.txn

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self.txn.commit()
            except self.lmdb.MapFullError:
                raise
            except self.lmdb.Error as err:
                raise StoreUnavailable(f"LMDB commit failed: {err}") from err
            return False
        self.txn.abort()
        if isinstance(exc, self.lmdb.Error) and not isinstance(exc, self.lmdb.MapFullError):
            raise StoreUnavailable(f"LMDB: {exc}") from exc
        if isinstance(exc, (_Damaged, struct.error)):
            raise StoreUnavailable(f"LMDB pool is damaged: {exc}; delete its directory to start a new pool") from exc
        return False
