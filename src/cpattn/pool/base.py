"""The backend side of the pool: a byte store of whole-block entries.

A backend stores opaque byte strings (the :mod:`cpattn.pool.codec` form of
a block) under string keys. It does not know tensors, dtypes or layouts;
:class:`cpattn.pool.kv_pool.KVPool` does. Every backend keeps these rules:

- ``put`` is put-if-absent: a key already present keeps its entry (the
  first writer wins), so concurrent writers of one key are harmless -- an
  entry is always one writer's whole blob, never a mix.
- ``get`` may return ``None`` for any key at any time (never stored,
  evicted, dropped); a present entry may still be corrupt, which the codec
  catches.
- A failure of the store itself (server gone, unusable database) raises
  :class:`StoreUnavailable` within a bounded time; the pool turns it into
  misses and one warning.
- Recency: a backend that evicts by recency renews the keys of ``put`` and
  ``get`` (hits) *in the order given*, the last one most recent.
  :class:`~cpattn.pool.kv_pool.KVPool` passes a chain of prefix keys deepest
  first, so the root of a chain is the last to go (leaves before roots) and a
  pool under pressure keeps the longest prefix it can hold.
- Optional ``put_chain(keys, blobs)``: as ``put``, but a ``None`` blob means
  "renew this key if present, write nothing", and every present key is
  renewed *before* anything is evicted for the new ones. The pool uses it to
  renew a request's whole chain (the cached prefix, other DCP ranks' blocks)
  in the same operation that writes its new blocks; without it the pool
  falls back to ``put`` of the new blocks, deepest first.

Example
-------
>>> store = DictStore()
>>> store.put(["a"], [b"1"]), store.put(["a"], [b"2"]), store.get(["a", "b"])
([True], [True], [b'1', None])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class StoreUnavailable(RuntimeError):
    """The backend cannot serve requests (server gone, database unusable)."""


class PoolDamagedWarning(RuntimeWarning):
    """A pool's files were damaged and were replaced or rebuilt: this run starts (partly) cold, never wrong."""


@runtime_checkable
class BlockStore(Protocol):
    """What :class:`~cpattn.pool.kv_pool.KVPool` needs from a backend (see the module docstring)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has an entry (no data moved)."""

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's entry, or None; counts as an access for eviction."""

    def put(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        """Put-if-absent; True where the key has an entry afterwards."""

    def discard(self, keys: Sequence[str]) -> None:
        """Drop entries (ones found corrupt), ignoring absent keys."""

    def close(self) -> None:
        """Release the store; the object is unusable afterwards."""


class DictStore:
    """An in-process dict backend: the protocol's reference, for tests and examples.

    ``capacity_entries``: the most entries kept (None: no limit); past it the
    least recently used go first, recency renewed in the order keys are given
    (see the module docstring).

    >>> s = DictStore()
    >>> s.put(["k"], [b"v"]), s.exists(["k", "x"])
    ([True], [True, False])
    >>> s = DictStore(capacity_entries=2)
    >>> s.put(["c", "b", "a"], [b"3", b"2", b"1"]), s.exists(["a", "b", "c"])   # "c", the oldest, went
    ([False, True, True], [True, True, False])
    """

    def __init__(self, capacity_entries: int | None = None) -> None:
        if capacity_entries is not None and capacity_entries < 1:
            raise ValueError(f"capacity_entries must be positive or None; got {capacity_entries}")
        self.capacity_entries = capacity_entries
        self.entries: dict[str, bytes] = {}  # insertion order = recency, oldest first

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.entries for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out = [self.entries.get(k) for k in keys]
        self.touch(keys)
        return out

    def put(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        if len(keys) != len(blobs):
            raise ValueError(f"put() got {len(keys)} keys but {len(blobs)} blobs")
        return self.put_chain(keys, [bytes(b) for b in blobs])

    def put_chain(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        """Renew every present key and write the absent ones that have a blob, in this order (the last most
        recent); then the least recently used go until the capacity holds."""
        for k, b in zip(keys, blobs, strict=True):
            old = self.entries.pop(k, None)  # first writer wins; renewed
            if old is not None or b is not None:
                self.entries[k] = bytes(b) if old is None else old
        while self.capacity_entries is not None and len(self.entries) > self.capacity_entries:
            del self.entries[next(iter(self.entries))]
        return [k in self.entries for k in keys]

    def touch(self, keys: Sequence[str]) -> None:
        """Renew the present keys, in this order (the last most recent)."""
        for k in keys:
            if k in self.entries:
                self.entries[k] = self.entries.pop(k)

    def discard(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.entries.pop(k, None)

    def close(self) -> None:
        self.entries = {}
