"""The P/D connector: a request's whole blocks sent from the producer's ranks to the consumer's ranks.

There is no pool between the two roles. A producer of P ranks and a consumer of D ranks both keep
global block j of a sequence on rank ``j % size`` (``interleave_size = block_size``; producer rank p
holds it at its table's entry ``j // P``). Block j therefore goes from producer rank ``j % P`` to
consumer rank ``j % D``, as in the fixed-batch hand-off (:mod:`cpattn.engine.handoff`).

- **save**, on the producer, after each step: the whole blocks of each request that finished (its
  first token out) are read from this rank's cache and staged. The copy is taken before a later
  step can reuse the freed blocks.
- **send / recv** (:class:`~cpattn.engine.connector.Handoff` records, the same list on every rank
  of both roles). The blocks the consumer can use go over the link: its whole spans of
  ``block_size * D`` tokens, leaving at least one token to compute (the consumer needs logits for
  its first token). Blocks the consumer finds elsewhere are skipped: ``Handoff.found`` (from a
  pool member of a :class:`~cpattn.engine.connector.MultiConnector`), rounded down to whole spans.
  :class:`GroupLink` sends one message per (producer rank, consumer rank) pair that has blocks,
  ``[n, block_size, F]``, over ``Group.send`` / ``recv`` (:func:`~cpattn.engine.handoff.send_block_pairs`).
  :class:`MemoryLink` hands them over in this process, for :class:`~cpattn.engine.pd_engine.PDEngine`.
  A DeepSeek-V4 engine has no per-token blocks: bound to one, ``PDConnector()`` hands over each
  request's whole V4 state instead (:mod:`cpattn.engine.connector_v4`); bound to a hybrid engine
  (Qwen3-Next), every prompt block plus the linear layers' states (:mod:`cpattn.engine.connector_hybrid`).
- **fetch**, on the consumer, at admission: the received spans, from the first span sent on. A
  span the device prefix cache already holds is not asked for. The inbox entry is dropped once
  the request has run a step.
- **hidden rows**, with a drafter that reads the target's hidden states (MTP, Eagle3, DSpark: both
  engines keep its ``hidden_layers``; :class:`~cpattn.engine.connector.Side`). Such a drafter has its own
  attention (or context) over every earlier position, so it needs the target's hidden rows of the whole
  prompt, not only of the last position. The producer engine keeps each request's rows as it computes
  its chunks; **save** stages those of positions ``0 .. usable * block_size - 1`` (where the consumer's
  computed tail can start at the latest), flattened ``{name: [m, F]}``; **send** sends them after the
  blocks, consumer rank d from producer rank ``d % P``
  (:func:`~cpattn.engine.hidden_rows.send_hidden_rows`: an int64 header of each request's start and row
  count and each name's width, then ``[sum m, sum F]``; in memory for a
  :class:`MemoryLink`). At the consumer's first step of the request, :meth:`PDConnector.hidden_rows`
  gives the rows before its first computed position, which the engine puts before the rows it computed
  (:meth:`~cpattn.engine.llm.LLMEngine._keep_hidden`), so the drafter's first proposal reads every
  prompt position, as in one engine that ran the prompt. Rows the producer did not compute (a prefix it
  found cached) are not sent; the drafter then starts at the first position with a row, as
  ``LLMEngine``'s does after a prefix hit, and so does a request the consumer preempts and recomputes.
  The V4 and hybrid kinds, whose consumers compute no prompt token, send every prompt position's rows after
  their state (:class:`~cpattn.engine.hidden_rows.HiddenRowsMixin`, this side of every kind).

:attr:`PDConnector.stats` counts blocks and bytes sent per request. The producer ranks' counts add
up to ``(usable - first) * block_size * F * itemsize`` bytes per request, plus, with a hidden-state
drafter, ``D * usable * block_size * sum(F_name) * itemsize`` of hidden rows (``hidden_bytes_sent``).

Example
-------
>>> import cpattn
>>> from cpattn.engine.run_rank import Arrival, run_rank
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> out = cpattn.simulate(2, run_rank, "qwen3", params, cfg, [Arrival(list(range(1, 12)), SamplingParams(max_tokens=3))],
...                       pd=True, block_size=4)   # no kv_pool: the P/D connector, rank 0 -> rank 1
>>> len(out[1][0].token_ids), usable_blocks(11, 4, 1)   # blocks 0 and 1 went over; the consumer computed 8..10
(3, 2)
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cpattn.comm.group import Group
from cpattn.engine.connector import Handoff, KVConnector, Side
from cpattn.engine.handoff import recv_block_pairs, send_block_pairs
from cpattn.engine.hidden_rows import HiddenRowsMixin
from cpattn.engine.sampling import SamplingParams  # noqa: F401 - the module example's

ROLES = ("kv_producer", "kv_consumer")


def usable_blocks(num_tokens: int, block_size: int, consumer_size: int) -> int:
    """Whole blocks of a ``num_tokens`` prompt a consumer of ``consumer_size`` ranks can take: its whole spans
    (``block_size * consumer_size`` tokens), at least one token left to compute.

    >>> usable_blocks(17, 4, 2), usable_blocks(16, 4, 2), usable_blocks(1, 4, 1)
    (4, 2, 0)
    """
    return (num_tokens - 1) // (block_size * consumer_size) * consumer_size


@dataclass
class TransferStats:
    """The P/D connector's counters: blocks / bytes this rank sent (producer) or received (consumer), blocks
    fetched into the consumer's cache, and bytes sent per request id (blocks and hidden rows); of them, the
    drafter's hidden rows (``hidden_bytes_*``: with a drafter that reads the target's hidden states)."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    blocks_loaded: int = 0
    bytes_by_request: dict = field(default_factory=dict)
    hidden_bytes_sent: int = 0
    hidden_bytes_received: int = 0


class MemoryLink:
    """The producer and consumer engines in this process (each driving all its ranks): blocks handed over
    in memory, first in first out. One link joins one pair of engines."""

    def __init__(self, consumer_size: int) -> None:
        self.consumer_size = consumer_size
        self._queue: deque = deque()
        self._hidden: deque = deque()  # the drafter's hidden rows of each hand-off (HiddenRowsMixin._send_hidden)

    def send(self, conn: PDConnector, handed: Sequence[Handoff], nblocks: list[int], start: list[int]) -> list[int]:
        box = {(b, j): conn._outbox[h.request_id][j] for b, h in enumerate(handed) for j in range(start[b], nblocks[b])}
        self._queue.append(box)
        sent = [0] * len(handed)
        for (b, _), payload in box.items():
            sent[b] += payload.nbytes
        return sent

    def recv(self, conn: PDConnector, handed, nblocks, start) -> dict:
        if not self._queue:
            raise RuntimeError("MemoryLink.recv: nothing was sent; call the producer's send first")
        return self._queue.popleft()


class GroupLink:
    """Producer and consumer ranks of one world: ``producers`` / ``consumers`` are their ranks in ``world``
    (rank i of each role's group is its i-th). Blocks go rank to rank over ``world.send`` / ``recv``."""

    def __init__(self, world: Group, producers: Sequence[int], consumers: Sequence[int]) -> None:
        self.world, self.producers, self.consumers = world, list(producers), list(consumers)
        self.consumer_size = len(self.consumers)

    def send(self, conn: PDConnector, handed, nblocks, start) -> list[int]:
        s = conn.side
        return send_block_pairs(self.world, lambda b, j: conn._outbox[handed[b].request_id][j], nblocks,
                                prefill_rank=s.rank, pcp_size=s.dcp_size, decode_ranks=self.consumers,
                                start=start)

    def recv(self, conn: PDConnector, handed, nblocks, start) -> dict:
        s = conn.side
        return recv_block_pairs(self.world, nblocks, decode_rank=s.rank, dcp_size=s.dcp_size,
                                prefill_ranks=self.producers, block_size=s.block_size, width=conn.width,
                                dtype=conn.dtype, start=start)


def check_bind(link, side: Side, *, whole_blocks: bool = True) -> None:
    """The refusals of a P/D connector binding ``side``, one line each: an engine that is neither producer
    nor consumer, no ``link``, DCP blocks not whole per rank (``whole_blocks``: the connector moves blocks),
    a :class:`GroupLink` on an engine that is not its rank's."""
    if side.role not in ROLES:
        raise ValueError(f"PDConnector on an engine of kv_role={side.role!r}: it joins a kv_producer and a "
                         "kv_consumer (PDEngine, run_rank(pd=True)); for one engine pass kv_pool= or nothing")
    if link is None:
        raise ValueError("PDConnector has no link: use it in PDEngine or run_rank(pd=True), which give it one")
    if whole_blocks and side.dcp_size > 1 and side.interleave_size != side.block_size:
        raise ValueError(f"PDConnector with dcp_size={side.dcp_size} moves whole blocks per rank: interleave_size "
                         f"= block_size ({side.block_size}); got {side.interleave_size}")
    if isinstance(link, GroupLink) and side.rank is None:
        raise ValueError("PDConnector over a GroupLink: each rank runs its own engine (world=its role's group)")


class PDConnector(HiddenRowsMixin, KVConnector):
    """Whole blocks from the producer's ranks to the consumer's (module doc). ``link``: a
    :class:`GroupLink` or :class:`MemoryLink`; the P/D compositions give it (:meth:`linked`). The drafter's
    hidden rows: :class:`~cpattn.engine.hidden_rows.HiddenRowsMixin`, shared with the V4 and hybrid kinds."""

    def __init__(self, link=None) -> None:
        self.link = link

    def linked(self, link) -> PDConnector:
        out = copy.copy(self)
        out.link = link
        return out

    def bind(self, side: Side) -> PDConnector:
        from cpattn.engine.kv_rows import row_width
        from cpattn.models.family import param_dtype

        if side.family.backend.name == "v4":  # V4's rings + entries: a whole request state (connector_v4)
            from cpattn.engine.connector_v4 import V4PDConnector

            return V4PDConnector(self.link).bind(side)
        if side.family.cache == "hybrid":  # blocks + the linear layers' states (connector_hybrid)
            from cpattn.engine.connector_hybrid import HybridPDConnector

            return HybridPDConnector(self.link).bind(side)
        check_bind(self.link, side)
        bound = super().bind(side)
        bound.width = row_width(tuple(side.family.kv_layouts(side.cfg)))
        bound.dtype = param_dtype(side.params)
        bound._outbox, bound._inbox, bound._waiting = {}, {}, {}
        bound._bind_hidden(side)
        bound._stats = TransferStats()
        return bound

    @property
    def stats(self) -> TransferStats:
        return self._stats

    def _range(self, h: Handoff) -> tuple[int, int]:
        """(first block sent, blocks the consumer can use) of a hand-off: the same on both roles."""
        d = self.link.consumer_size
        usable = usable_blocks(len(h.tokens), self.side.block_size, d)
        return min(h.found // d * d, usable), usable

    # -- producer ---------------------------------------------------------------------------------
    def save(self, out, requests) -> None:
        if self.side.role == "kv_consumer":
            self._admitted(out, requests)
            return
        s, d = self.side, self.link.consumer_size
        for b, rid in enumerate(out.req_ids):
            req = requests[rid]
            if req.status != "finished" or req.finish_reason == "abort":
                continue
            table, n = out.block_tables[b], s.dcp_size
            usable = usable_blocks(req.num_prompt, s.block_size, d)
            self._outbox[rid] = {j: s.read(j % n, table[j // n]) for j in range(usable)
                                 if s.rank is None or j % n == s.rank}
            self._stage_hidden(rid, usable * s.block_size)

    def send(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_producer":
            raise ValueError(f"PDConnector.send on a {self.side.role} engine; the producer sends")
        ranges = [self._range(h) for h in handed]
        start, nblocks = [r[0] for r in ranges], [r[1] for r in ranges]
        if any(n > a for a, n in ranges):
            sent = self.link.send(self, handed, nblocks, start)
        else:
            sent = [0] * len(handed)
        st, row = self._stats, self.side.block_size * self.width * self.dtype.itemsize
        for h, nbytes in zip(handed, sent):
            st.bytes_by_request[h.request_id] = st.bytes_by_request.get(h.request_id, 0) + nbytes
            st.bytes_sent += nbytes
            st.blocks_sent += nbytes // row
        self._send_hidden(handed)  # after the blocks
        self._outbox.clear()  # staged blocks of requests not handed off (aborted, or done at the first token)

    # -- consumer ---------------------------------------------------------------------------------
    def _keep_mine(self, got: dict, num_requests: int) -> list[dict]:
        """Of the received ``got = {(b, j): block}``, the blocks this consumer rank owns (global block j on rank
        ``j % dcp_size``; every block in memory), per request ``[{j: block}]``, counted in the stats."""
        mine = [{} for _ in range(num_requests)]
        for (b, j), payload in got.items():
            if self.side.rank is None or j % self.side.dcp_size == self.side.rank:
                mine[b][j] = payload
                self._stats.blocks_received += 1
                self._stats.bytes_received += payload.nbytes
        return mine

    def recv(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_consumer":
            raise ValueError(f"PDConnector.recv on a {self.side.role} engine; the consumer receives")
        ranges = [self._range(h) for h in handed]
        start, nblocks = [r[0] for r in ranges], [r[1] for r in ranges]
        got = self.link.recv(self, handed, nblocks, start) if any(n > a for a, n in ranges) else {}
        mine = self._keep_mine(got, len(handed))
        self._recv_hidden(handed)
        for h, (first, usable), blocks in zip(handed, ranges, mine):
            if usable <= first:
                continue
            key = tuple(h.tokens)
            entry = self._inbox.setdefault(key, {"first": first, "usable": usable, "blocks": {}, "refs": set()})
            entry["blocks"].update(blocks)
            entry["first"] = min(entry["first"], first)
            entry["refs"].add(h.request_id)
            self._waiting[h.request_id] = key

    def fetch(self, tokens, start, stop):
        entry = self._inbox.get(tuple(tokens)) if self._inbox else None
        if entry is None:
            return []
        n = self.side.dcp_size
        if start < entry["first"] // n:  # spans before the first one sent: neither cached nor here
            return []
        spans = []
        for c in range(start, min(stop, entry["usable"] // n)):
            spans.append(tuple(entry["blocks"].get(c * n + r) for r in range(n)))
        self._stats.blocks_loaded += len(spans) * (n if self.side.rank is None else 1)
        return spans

    def request_finished(self, request_id) -> None:
        self._outbox.pop(request_id, None)
        self._hidden_in.pop(request_id, None)
        self._drop(request_id)

    def _drop(self, rid) -> None:
        key = self._waiting.pop(rid, None)
        entry = None if key is None else self._inbox.get(key)
        if entry is not None:
            entry["refs"].discard(rid)
            if not entry["refs"]:
                del self._inbox[key]

    def _admitted(self, out, requests) -> None:
        """Drop the inbox entries of requests that ran a step (or were aborted while waiting)."""
        ran, held = set(out.req_ids), self._hidden_in
        for rid in [r for r in held if r in ran or getattr(requests.get(r), "status", None) == "finished"]:
            del held[rid]  # the first computed row took them (LLMEngine._keep_hidden)
        if not self._waiting:
            return
        for rid in list(self._waiting):
            req = requests.get(rid)
            if req is not None and (rid in ran or req.status == "finished"):
                self._drop(rid)


# -- the hand-off of one world step (run_rank): which requests, their first tokens, then their blocks ----------
def moves_blocks(connector: KVConnector) -> bool:
    """Whether ``connector`` is (or holds) a :class:`PDConnector`: only then ``found`` is asked for."""
    members = getattr(connector, "connectors", (connector,))
    return any(isinstance(c, PDConnector) for c in members)


def producer_hand_off(world: Group, connector: KVConnector, handed: Sequence[tuple[int, Sequence[int], int]]) -> None:
    """Every producer rank, after its step: ``handed`` = (request id, prompt, first token) of the requests
    that go on (the same list on every producer rank). World rank 0 asks ``connector.found`` and sends
    every other rank a count, then ``[n, 3]`` rows (id, first token, found); then every producer rank
    sends its blocks (:meth:`PDConnector.send`)."""
    if world.rank == 0:
        ask = moves_blocks(connector)
        rows = [(rid, tok, connector.found(prompt) if ask else 0) for rid, prompt, tok in handed]
        _send_rows(world, rows, [r for r in range(1, world.size)])
    else:
        rows = _recv_rows(world)
    prompts = {rid: tuple(prompt) for rid, prompt, _ in handed}
    connector.send([Handoff(rid, prompts[rid], tok, found) for rid, tok, found in rows])


def consumer_hand_off(world: Group, connector: KVConnector, prompt_of) -> list[Handoff]:
    """Every consumer rank, before its step: the requests handed over this world step (rank 0's rows),
    their blocks received (:meth:`PDConnector.recv`); ``prompt_of(request id)`` gives a prompt."""
    handed = [Handoff(rid, tuple(prompt_of(rid)), tok, found) for rid, tok, found in _recv_rows(world)]
    connector.recv(handed)
    return handed


def _send_rows(world: Group, rows: list[tuple[int, int, int]], to: list[int]) -> None:
    t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    for dst in to:
        world.send(torch.tensor([len(rows)], dtype=torch.int64), dst)
        if rows:
            world.send(t, dst)


def _recv_rows(world: Group) -> list[tuple[int, int, int]]:
    n = int(world.recv((1,), torch.int64, 0).item())
    return [] if not n else [tuple(r) for r in world.recv((n, 3), torch.int64, 0).tolist()]
