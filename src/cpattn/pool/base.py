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
    """An in-process dict backend: the protocol's reference, for tests and examples (no capacity limit).

    >>> s = DictStore()
    >>> s.put(["k"], [b"v"]), s.exists(["k", "x"])
    ([True], [True, False])
    """

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.entries for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.entries.get(k) for k in keys]

    def put(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        for k, b in zip(keys, blobs, strict=True):
            self.entries.setdefault(k, bytes(b))
        return [True] * len(keys)

    def discard(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.entries.pop(k, None)

    def close(self) -> None:
        self.entries = {}
