"""The KV connector: one object between an engine's paged blocks and KV that lives outside it.

Its shape is vLLM's ``KVConnectorBase_V1`` (facts carried over, code ours). It has two sides, and
a P/D pair of engines adds a hand-off:

- **scheduler side**, :meth:`KVConnector.fetch` ``(tokens, start, stop)``: at admission the
  scheduler asks how many spans of a prompt, after the ``start`` spans already cached on the
  device, the connector can provide (a span is ``block_size * dcp_size`` tokens, one block per
  DCP rank). The spans come back loaded now, one payload per rank, so none can vanish between
  the question and the step. The runner writes them into the request's fresh blocks before the
  step (``SchedulerOutput.loads``), and ``len(spans) * span`` tokens count as computed.
- **worker side**, :meth:`KVConnector.save` ``(out, requests)``: after each step's update, the
  connector sees the step that ran and keeps what it needs. A pool stores the whole blocks that
  became computed. The P/D connector stages the whole blocks of each request that finished.
- **P/D hand-off**. The composition (:class:`~cpattn.engine.pd_engine.PDEngine`,
  :func:`~cpattn.engine.run_rank.run_rank`) calls it with the requests the producer finished,
  as :class:`Handoff` records. :meth:`KVConnector.found` gives how many leading whole blocks of a
  prompt the consumer can get without a transfer (from a pool). The producer calls
  :meth:`~KVConnector.send` and the consumer :meth:`~KVConnector.recv`.

Implementations:

- :class:`PoolConnector`: the KV pool as the prefix cache's second tier
  (:mod:`cpattn.engine.pool_tier`). This is what ``kv_pool=`` builds.
- :class:`~cpattn.engine.connector_pd.PDConnector`: whole blocks sent producer rank to consumer
  rank, over ``Group.send`` / ``recv`` or in memory.
- :class:`MultiConnector`: connectors in order. ``PoolConnector(...) + PDConnector()`` fetches
  from the pool first and takes the rest from the transfer. The transfer skips the blocks found
  in the pool.

A connector object is a spec. :meth:`KVConnector.bind` gives each engine its own bound copy, so
one spec serves every rank of a world.

Example
-------
>>> from cpattn.config import SchedulerConfig
>>> from cpattn.engine.llm import LLMEngine, SamplingParams
>>> from cpattn.engine.pd_engine import memory_pool
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> engine = LLMEngine("qwen3", params, cfg, block_size=4, kv_connector=PoolConnector(memory_pool("qwen3", cfg, params, 4)))
>>> _ = engine.generate([list(range(1, 12))], SamplingParams(max_tokens=2))
>>> engine.connector.stored_blocks                # the prompt's 2 whole blocks, then the 3rd once computed
3
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.engine.pool_tier import PoolTier


@dataclass(frozen=True)
class Side:
    """What a connector knows of the engine it is bound to.

    family / cfg / params / block_size / interleave_size / dcp_size: the engine's. rank: this process's
    DCP rank under torchrun (or in one rank of a world), None when one process drives every rank (the
    simulated mesh inside an engine). role: "kv_both", "kv_producer" or "kv_consumer".
    read(rank, block_id) -> [block_size, F]: a block of a DCP rank's cache (only ``rank``'s when it is
    set). barrier: makes the DCP group meet (None: nothing to wait for).
    hidden_layers: the target hidden states the engine keeps for a drafter (its ``hidden_layers``; None: none).
    hidden(request_id) -> (start, {name: [n, F]}) or None: the engine's kept hidden rows of a request
    (positions ``start .. start + n - 1``), what a P/D producer hands over with the blocks.
    """

    family: Any
    cfg: Any
    params: dict
    block_size: int
    interleave_size: int
    dcp_size: int
    rank: int | None
    role: str
    prefix_caching: bool
    read: Callable[[int, int], torch.Tensor]
    barrier: Callable[[], None] | None = None
    hidden_layers: tuple | None = None
    hidden: Callable[[Hashable], tuple | None] | None = None


@dataclass(frozen=True)
class Handoff:
    """A request the producer finished that goes on to the consumer: its id, its prompt token ids,
    its first token and ``found``, the leading whole blocks the consumer gets without a transfer."""

    request_id: Hashable
    tokens: tuple[int, ...]
    first_token: int
    found: int = 0


class KVConnector:
    """The connector interface (module doc). This base class does nothing: no KV outside the engine."""

    def bind(self, side: Side) -> KVConnector:
        """This connector's own copy for one engine (every state starts empty)."""
        bound = copy.copy(self)
        bound.side = side
        return bound

    def linked(self, link) -> KVConnector:
        """A copy that hands off over ``link`` (only the P/D connector has a use for it)."""
        return self

    def fetch(self, tokens: Sequence[int], start: int, stop: int) -> list[tuple]:
        """Scheduler side: spans ``start .. stop - 1`` (at most, leading ones) it can provide, each as one
        payload [block_size, F] per DCP rank (None for a rank this process does not drive)."""
        return []

    def save(self, out, requests: Mapping[Hashable, Any]) -> None:
        """Worker side, after each step: ``out`` the step's ``SchedulerOutput``, ``requests`` the scheduler's."""

    def found(self, tokens: Sequence[int]) -> int:
        """Leading whole blocks of ``tokens`` a consumer gets without the P/D transfer."""
        return 0

    def send(self, handed: Sequence[Handoff]) -> None:
        """Producer: move the KV of ``handed`` (every producer rank calls it, with the same list)."""

    def recv(self, handed: Sequence[Handoff]) -> None:
        """Consumer: take the KV of ``handed`` before they are added (every consumer rank, the same list)."""

    def request_finished(self, request_id: Hashable) -> None:
        """Forget what is held for a request that will not run on (an abort)."""

    def hidden_rows(self, request_id: Hashable, context_len: int) -> tuple[int, dict] | None:
        """Consumer: target hidden rows handed over for a request whose first computed row is at position
        ``context_len``: ``(start, {name: [context_len - start, F]})``, the rows of positions ``start ..
        context_len - 1`` the consumer did not compute (its drafter reads them); None: none handed."""
        return None

    def close(self) -> None:
        """Release what the bound copy opened (idempotent)."""

    @property
    def stored_blocks(self) -> int:
        return 0

    def __add__(self, other: KVConnector) -> MultiConnector:
        return MultiConnector(self, other)


class PoolConnector(KVConnector):
    """The KV pool as the second tier (:class:`~cpattn.engine.pool_tier.PoolTier`).

    pool: a :class:`~cpattn.engine.pooling.PoolSpec` (opened at bind, released at close) or an open
    :class:`~cpattn.pool.KVPool`. store: whether this engine stores its computed blocks; None: unless
    its role is "kv_consumer" (a P/D decode role never races the producer's stores).
    """

    def __init__(self, pool, *, store: bool | None = None) -> None:
        if pool is None:
            raise ValueError("PoolConnector(pool=None): pass a PoolSpec or an open KVPool")
        self.spec, self.store = pool, store
        self.pool, self.tier, self._opened = None, None, False

    def bind(self, side: Side) -> PoolConnector:
        from cpattn.engine.pooling import open_for_run  # here: pooling imports the engine's driver

        if not side.prefix_caching:
            raise ValueError("kv_pool: the pool is the prefix cache's second tier; enable_prefix_caching=True")
        if side.dcp_size > 1 and side.interleave_size != side.block_size:
            raise ValueError(f"kv_pool with dcp_size={side.dcp_size} needs whole blocks per rank: interleave_size = "
                             f"block_size ({side.block_size}); got {side.interleave_size}")
        bound = super().bind(side)
        bound.pool, bound._opened = open_for_run(self.spec, side.family, side.cfg, side.params, side.block_size)
        bound.tier = PoolTier(bound.pool, side.dcp_size, rank=side.rank)
        bound._stored = {}  # whole blocks of each request already in the pool
        bound._stores = self.store if self.store is not None else side.role != "kv_consumer"
        return bound

    def fetch(self, tokens, start, stop):
        return self.tier.fetch(tokens, start, stop)

    def save(self, out, requests) -> None:
        """Store every whole block that became computed this step (each rank its own), then meet."""
        if not self._stores:
            return
        size = self.side.block_size
        for b, rid in enumerate(out.req_ids):
            req = requests[rid]
            lo, hi = self._stored.get(rid, 0), req.num_computed // size
            if hi > lo:
                self.tier.store(req.tokens, range(lo, hi), out.block_tables[b], self.side.read)
                self._stored[rid] = hi
            if req.status == "finished":
                self._stored.pop(rid, None)
        if self.side.barrier is not None:  # every rank's blocks stored before any looks up
            self.side.barrier()

    def found(self, tokens) -> int:
        return self.pool.lookup(self.pool.keys(tokens))

    @property
    def stored_blocks(self) -> int:
        return 0 if self.tier is None else self.tier.stored_blocks

    @property
    def loaded_blocks(self) -> int:
        """Pool blocks :meth:`fetch` loaded for this bound engine (N per span: under torchrun every rank
        loads a span's N blocks); with :attr:`loaded_bytes`, their bytes. 0 before bind."""
        return 0 if self.tier is None else self.tier.loaded_blocks

    @property
    def loaded_bytes(self) -> int:
        return 0 if self.tier is None else self.tier.loaded_bytes

    def close(self) -> None:
        if self._opened and self.pool is not None:
            from cpattn.engine.pooling import release

            release(self.pool)
            self._opened = False


class MultiConnector(KVConnector):
    """Connectors in order (vLLM's ``MultiConnector``): a prompt's spans come from the first that has
    them, then the next goes on from there; every one saves, sends and receives. ``found``: the most
    any member finds (a pool's lookup), so a P/D member after a pool sends only the blocks after them."""

    def __init__(self, *connectors: KVConnector) -> None:
        flat = []
        for c in connectors:
            flat += c.connectors if isinstance(c, MultiConnector) else [c]
        if not flat:
            raise ValueError("MultiConnector(): pass at least one connector")
        self.connectors = tuple(flat)

    def bind(self, side: Side) -> MultiConnector:
        bound = copy.copy(self)
        bound.side, bound.connectors = side, tuple(c.bind(side) for c in self.connectors)
        return bound

    def linked(self, link) -> MultiConnector:
        out = copy.copy(self)
        out.connectors = tuple(c.linked(link) for c in self.connectors)
        return out

    @property
    def pool(self):
        """The first member's pool (None without one)."""
        return next((c.pool for c in self.connectors if getattr(c, "pool", None) is not None), None)

    def member(self, kind: type) -> KVConnector | None:
        """The first member of class ``kind`` (None if none is)."""
        return next((c for c in self.connectors if isinstance(c, kind)), None)

    def fetch(self, tokens, start, stop):
        got: list = []
        for c in self.connectors:
            if start + len(got) >= stop:
                break
            got += c.fetch(tokens, start + len(got), stop)
        return got

    def save(self, out, requests) -> None:
        for c in self.connectors:
            c.save(out, requests)

    def found(self, tokens) -> int:
        return max(c.found(tokens) for c in self.connectors)

    def send(self, handed) -> None:
        for c in self.connectors:
            c.send(handed)

    def recv(self, handed) -> None:
        for c in self.connectors:
            c.recv(handed)

    def request_finished(self, request_id) -> None:
        for c in self.connectors:
            c.request_finished(request_id)

    def hidden_rows(self, request_id, context_len):
        return next((h for c in self.connectors if (h := c.hidden_rows(request_id, context_len)) is not None), None)

    @property
    def stored_blocks(self) -> int:
        return sum(c.stored_blocks for c in self.connectors)

    def close(self) -> None:
        for c in self.connectors:
            c.close()


def from_args(kv_pool=None, kv_connector: KVConnector | None = None) -> KVConnector | None:
    """The connector an engine's ``kv_pool=`` / ``kv_connector=`` arguments ask for (at most one of them):
    ``kv_pool`` builds a :class:`PoolConnector`."""
    if kv_pool is not None and kv_connector is not None:
        raise ValueError("pass kv_pool= or kv_connector=, not both (compose them: PoolConnector(pool) + PDConnector())")
    if kv_connector is not None and not isinstance(kv_connector, KVConnector):
        raise ValueError(f"kv_connector: saw {type(kv_connector).__name__}; pass a cpattn.engine.connector.KVConnector")
    return PoolConnector(kv_pool) if kv_pool is not None else kv_connector
