"""``KVPool``: whole KV blocks in a backend store, keyed by chained prefix hashes.

The engine-facing object: it turns payload tensors into checked entries
(:mod:`cpattn.pool.codec`) and back, and owns the failure policy -- a
missing, truncated or corrupt entry is a miss (and a corrupt one is dropped
so it can be written again), and a store that goes away turns every later
call into a miss or a no-op after exactly one :class:`PoolUnavailableWarning`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpattn.pool import codec
from cpattn.pool.base import BlockStore, StoreUnavailable
from cpattn.pool.keys import PoolIdentity, block_keys

log = logging.getLogger("cpattn.pool")


class PoolUnavailableWarning(RuntimeWarning):
    """The pool's store stopped answering; the run goes on without the pool (cold prefill)."""


@dataclass
class PoolStats:
    """Counters of one :class:`KVPool` (blocks, not requests)."""

    looked_up: int = 0  # keys asked about by lookup()
    hits: int = 0  # leading keys lookup() found
    loaded: int = 0  # payloads load() returned
    corrupt: int = 0  # entries found truncated / corrupt / of another dtype or shape (dropped)
    stored: int = 0  # payloads store() wrote
    already: int = 0  # payloads store() skipped because the key was present
    rejected: int = 0  # payloads the store did not keep (full, too large, transient error)


class KVPool:
    """Whole KV blocks of one model / cache dtype / block shape in a :class:`BlockStore`.

    A payload is one block of all layers, ``[L, block_size, F]`` in the
    cache dtype (``identity.block_shape`` / ``identity.dtype``); the pool
    returns exactly the bytes it was given.

    Per request the engine calls (see :mod:`cpattn.pool` for the flow)::

        keys = pool.keys(tokens)            # whole blocks only
        hit = pool.lookup(keys)             # leading keys present
        blocks = pool.load(keys[:hit])      # may be shorter than hit: use len(blocks)
        ... prefill tokens from len(blocks) * block_size on ...
        pool.store(keys[len(blocks):], new_blocks, chain=keys)  # the whole chain renewed, root last

    Eviction keeps chains usable: the keys of one call are one request's
    chain in prefix order, and the store is asked to renew them deepest first
    (the root last), so under pressure a chain loses its tail, never its root.

    Example
    -------
    >>> import torch
    >>> from cpattn.pool import DictStore, PoolIdentity
    >>> pool = KVPool(DictStore(), PoolIdentity("m", torch.float32, num_layers=2, block_size=4, row_width=8))
    >>> keys = pool.keys(list(range(10)))
    >>> pool.store(keys, [torch.full((2, 4, 8), float(j)) for j in range(len(keys))])
    2
    >>> pool.lookup(keys), [b[0, 0, 0].item() for b in pool.load(keys)]
    (2, [0.0, 1.0])
    """

    def __init__(self, store: BlockStore, identity: PoolIdentity) -> None:
        self.backend = store
        self.identity = identity
        self.stats = PoolStats()
        self._down: str | None = None

    # -- the protocol -------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | torch.Tensor) -> list[str]:
        """Keys of the whole blocks of ``tokens`` (:func:`cpattn.pool.keys.block_keys`)."""
        return block_keys(tokens, self.identity)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys have an entry (0 when the store is unavailable). Moves no data."""
        self.stats.looked_up += len(keys)
        present = self._call("exists", list(keys), default=[])
        hit = next((i for i, p in enumerate(present) if not p), len(present))
        self.stats.hits += hit
        return hit

    def load(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Payloads of the leading keys that are present and intact.

        Stops at the first key that is missing, truncated, corrupt or of
        another dtype / shape, so the result may be shorter than ``keys``
        (even right after :meth:`lookup` said they were there: eviction and
        corruption are races the caller must allow). Returns new CPU tensors
        ``[L, block_size, F]`` in ``identity.dtype``.
        """
        blobs = self._call("get", list(keys)[::-1], default=[])[::-1]  # deepest first: the root is renewed last
        out: list[torch.Tensor] = []
        for key, blob in zip(keys, blobs):
            if blob is None:
                break
            t = codec.decode(key, blob, self.identity.dtype, self.identity.block_shape)
            if t is None:
                why = codec.check(key, blob, self.identity.dtype, self.identity.block_shape)
                log.warning("cpattn pool: entry %s is unusable (%s); treated as a miss and dropped", key, why)
                self.stats.corrupt += 1
                self._call("discard", [key], default=None)
                break
            out.append(t)
        self.stats.loaded += len(out)
        return out

    def store(self, keys: Sequence[str], payloads: Sequence[torch.Tensor], *,
              chain: Sequence[str] | None = None) -> int:
        """Store whole blocks put-if-absent; returns how many this call wrote.

        ``payloads[i]`` is the block named ``keys[i]``: a tensor of
        ``identity.block_shape`` and ``identity.dtype`` on any device.
        Keys already present are skipped without encoding their payload; a
        block the store does not keep (full, too large) is counted in
        ``stats.rejected``, never an error.

        ``chain``: the request's whole chain of keys in prefix order, when
        ``keys`` are only part of it (the blocks after a cached prefix, or one
        DCP rank's blocks); default: ``keys`` themselves are the chain. Every
        key of the chain present in the store is renewed for eviction with
        the new ones, deepest first, so the root goes last and a pool under
        pressure keeps the longest prefix it can hold (leaves before roots).
        """
        if len(keys) != len(payloads):
            raise ValueError(f"store() got {len(keys)} keys but {len(payloads)} payloads; pass one payload per key")
        for i, p in enumerate(payloads):
            if p.dtype != self.identity.dtype or tuple(p.shape) != self.identity.block_shape:
                raise ValueError(
                    f"payload {i} is {p.dtype} {tuple(p.shape)}; this pool holds {self.identity.dtype} "
                    f"{self.identity.block_shape} blocks ([num_layers, block_size, row_width])"
                )
        if chain is None:
            chain = list(keys)
        else:
            chain = list(chain)
            missing = set(keys) - set(chain)
            if missing:
                raise ValueError(f"store() key {sorted(missing)[0]} is not in chain; pass the request's whole key "
                                 "chain (pool.keys(tokens)) as chain=")
        present = self._call("exists", list(keys), default=None) if keys else []
        if present is None:
            return 0
        todo = [i for i, p in enumerate(present) if not p]
        self.stats.already += len(keys) - len(todo)
        blobs = {keys[i]: codec.encode(keys[i], payloads[i]) for i in todo}
        order = chain[::-1]  # deepest first: the root is renewed last
        if hasattr(self.backend, "put_chain"):
            kept_all = self._call("put_chain", order, [blobs.get(k) for k in order], default=[False] * len(order))
            kept_of = dict(zip(order, kept_all))
            kept = [kept_of.get(keys[i], False) for i in todo]
        elif todo:
            new = [k for k in order if k in blobs]
            kept = self._call("put", new, [blobs[k] for k in new], default=[False] * len(new))
        else:
            kept = []
        n = sum(bool(k) for k in kept)
        self.stats.stored += n
        self.stats.rejected += len(todo) - n
        return n

    def with_identity(self, identity: PoolIdentity) -> KVPool:
        """A pool on the same store (and the same ``stats``) for blocks of another identity; closing either
        closes the store.

        >>> import torch
        >>> from cpattn.pool import DictStore, PoolIdentity
        >>> a = KVPool(DictStore(), PoolIdentity("m", torch.float32, 1, 2, 4))
        >>> b = a.with_identity(PoolIdentity("m", torch.float32, 1, 2, 4, weights="00" * 16))
        >>> b.backend is a.backend, b.stats is a.stats, a.keys([1, 2]) == b.keys([1, 2])
        (True, True, False)
        """
        view = KVPool(self.backend, identity)
        view.stats, view._down = self.stats, self._down
        return view

    # -- state ---------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False once the store failed; every later call is then a miss or a no-op."""
        return self._down is None

    def close(self) -> None:
        """Close the store (errors while closing a failed store are ignored)."""
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001 - closing a broken store must not fail the run
            if self._down is None:
                raise

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, *args, default):
        if self._down is not None:
            return default
        try:
            return getattr(self.backend, method)(*args)
        except StoreUnavailable as err:
            self.mark_unavailable(str(err))
            return default

    def mark_unavailable(self, reason: str) -> None:
        """Stop using the store; warns once (:class:`PoolUnavailableWarning`)."""
        if self._down is None:
            self._down = reason
            warnings.warn(
                f"cpattn KV pool: the store is unavailable ({reason}); continuing without the pool "
                "(every lookup is a miss, stores are skipped)",
                PoolUnavailableWarning,
                stacklevel=3,
            )
