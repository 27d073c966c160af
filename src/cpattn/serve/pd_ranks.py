"""One-server P/D (``kv_both``) on real ranks: a prefill engine on ranks ``0 .. P-1``, a decode engine on ``P ..``.

:class:`RankPD` is the engine every rank of a ``--pcp P --dcp D`` world of
``P + D`` gloo ranks runs, behind the same add_request / abort_request /
has_unfinished / step / stats as :class:`~cpattn.engine.pd_engine.PDEngine`,
so rank 0's :class:`~cpattn.serve.engine_loop.EngineLoop` serves it with a
:class:`~cpattn.serve.ranks.Mirror` and the other ranks :func:`~cpattn.serve.ranks.follow`
it, unchanged. Every rank hears every add and abort (the mirrored turns), so
every rank keeps the same table of requests; the engines use its integer
index as their request id (the hand-off rows are int64). One world step:

1. the producer ranks step (:func:`~cpattn.engine.run_rank.pd_role`'s prefill engine, each request
   with ``max_tokens = 1``); the requests whose first token came out and go on are handed off:
   producer rank 0's rows and the blocks (:func:`~cpattn.engine.connector_pd.producer_hand_off` /
   :func:`~cpattn.engine.connector_pd.consumer_hand_off`, as :func:`~cpattn.engine.run_rank.run_rank`);
2. the consumer ranks add them (full params) and step; the first token is checked against the
   producer's (:func:`~cpattn.engine.pd_engine.check_first`);
3. one all-reduce over the world of ``[work left, n]`` (int64, each rank its part), then the
   ``n`` bytes of consumer rank 0's (world rank P) JSON in int64 words: each of its step's outputs as
   ``[index, new token ids, finished, finish reason, new logprobs as [[token, logprob], ...] or
   null]`` and the decode engine's counters. Rank 0 rebuilds the decode role's
   :class:`~cpattn.engine.outputs.RequestOutput` objects from them (never unpickled).

Every rank thus knows "work left" after each step; an add or an abort since makes ``has_unfinished``
true (an abort's step runs with nothing to do and refreshes the decode role's counters, so
``/metrics`` shows the blocks it freed). An abort reaches whichever role holds the request: the
producer ranks abort it in the prefill engine, the consumer ranks in the decode engine (and drop any
blocks received for it).

Example (the simulated mesh, the same code the gloo ranks run)
-------
>>> import cpattn
>>> from cpattn.engine.sampling import SamplingParams
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> def rank(g):
...     e = RankPD(g, "qwen3", params, cfg, pcp_size=2, dcp_size=1, block_size=4)
...     e.add_request(list(range(1, 12)), SamplingParams(max_tokens=4), request_id="req-0")
...     outs = []
...     while e.has_unfinished():
...         outs += e.step()
...     e.close()
...     return [(o.token_ids, o.finished) for o in outs if o.token_ids]
>>> got = cpattn.simulate(3, rank)
>>> got[1:], got[0][-1][1], len(got[0][-1][0])
([[], []], True, 4)
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.connector_pd import consumer_hand_off, producer_hand_off
from cpattn.engine.outputs import EngineStats, RequestOutput
from cpattn.engine.pd_engine import PDStats, check_first, hands_off, pd_params
from cpattn.engine.run_rank import pd_role
from cpattn.engine.sampling import SamplingParams


@dataclass
class _Request:
    rid: Hashable  # the server's id ("req-N")
    prompt: tuple[int, ...]
    params: SamplingParams  # the whole request's (the producer runs it with max_tokens=1)


class RankPD:
    """This rank's part of a P/D pair over ``world`` (module doc). ``kv_connector``: None sends the blocks
    rank to rank (:class:`~cpattn.engine.connector_pd.PDConnector`); a ``PoolConnector`` of a pool every
    rank opens (LMDB, Mooncake) passes them through it. ``seed`` draws the seed of a request that brings
    none (the same draw on every rank). Other keywords: :func:`~cpattn.engine.run_rank.pd_role`'s."""

    def __init__(self, world: Group, model, params: dict, cfg: Any, *, pcp_size: int, dcp_size: int = 1,
                 seed: int = 0, **kwargs) -> None:
        self.world, self.pcp_size = world, pcp_size
        self.role, self.engine = pd_role(world, model, params, cfg, pcp_size=pcp_size, dcp_size=dcp_size, **kwargs)
        self.max_model_len = self.engine.max_model_len  # both roles' (one scheduler config)
        self._rng = random.Random(seed)
        self._requests: dict[int, _Request] = {}  # index -> request, the same on every rank
        self._index: dict[Hashable, int] = {}
        self._next = 0
        self._left = False  # work left after the latest step (the world's all-reduce)
        self._dirty = False  # an add or an abort since
        self._first: dict[int, int] = {}  # decode: the producer's first token of each handed-off request
        self._sent: dict[int, int] = {}  # world rank P: tokens of each request already reported
        self._acc: dict[int, list] = {}  # world rank 0: the decode role's tokens / logprobs of each request
        self._handed_off = 0
        self._decode_stats = EngineStats()
        self._exchange([])  # the decode role's counters reach rank 0 before the first step

    # -- the engine interface EngineLoop / follow use ------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: Hashable) -> Hashable:
        """Queue a request on the producer (checked there; the consumer ranks only record it)."""
        p = pd_params(prompt_token_ids, params, self.max_model_len, self._rng)
        i = self._next
        if self.role == "prefill":
            self.engine.add_request(prompt_token_ids, dataclasses.replace(p, max_tokens=1), request_id=i)
        self._next += 1
        self._requests[i] = _Request(request_id, tuple(prompt_token_ids), p)
        self._index[request_id] = i
        self._dirty = True
        return request_id

    def abort_request(self, request_id: Hashable) -> bool:
        """Stop a request in whichever role holds it (every rank hears the abort); False if unknown here."""
        i = self._index.pop(request_id, None)
        if i is None:
            return False
        self._requests.pop(i, None)
        self._acc.pop(i, None)
        self._sent.pop(i, None)
        self._first.pop(i, None)
        self._dirty = True
        if self.role == "decode" and i in self.engine.scheduler.requests:
            if self.engine.connector is not None:
                self.engine.connector.request_finished(i)  # blocks received for it, if it never ran
            return self.engine.abort_request(i)
        return self.role == "prefill" and self.engine.abort_request(i)

    def has_unfinished(self) -> bool:
        return self._left or self._dirty

    def step(self) -> list[RequestOutput]:
        """One world step (module doc): on rank 0 the outputs of both roles (a handed-off request shows its
        first token, unfinished, until the decode role carries on); on the other ranks []."""
        self._dirty = False
        mine: list[RequestOutput] = []
        if self.role == "prefill":
            handed = []
            for o in self.engine.step() if self.engine.has_unfinished() else []:
                r = self._requests.get(o.request_id)
                if r is None:
                    continue  # aborted meanwhile
                if o.finished and hands_off(o, r.params):
                    handed.append((o.request_id, r.prompt, o.token_ids[0]))
                    o = dataclasses.replace(o, finished=False, finish_reason=None)
                elif o.finished:
                    self._forget(o.request_id)
                mine.append(dataclasses.replace(o, request_id=r.rid))
            producer_hand_off(self.world, self.engine.connector, handed)
            self._handed_off += len(handed)
            left = self.engine.has_unfinished()
            wire = []
        else:
            for h in consumer_hand_off(self.world, self.engine.connector, lambda i: self._requests[i].prompt):
                self.engine.add_request(list(h.tokens), self._requests[h.request_id].params, request_id=h.request_id)
                self._first[h.request_id] = h.first_token
                self._handed_off += 1
            wire = []
            for o in self.engine.step() if self.engine.has_unfinished() else []:
                check_first(o, self._first)
                wire.append(self._report(o))
                if o.finished:
                    self._forget(o.request_id)
            left = self.engine.has_unfinished()
        got = self._exchange(wire, left)
        return mine + got if self.world.rank == 0 else []

    @property
    def stats(self) -> PDStats:
        """Rank 0: both roles' counters (the decode role's as of the latest step); elsewhere this rank's own."""
        own = self.engine.stats
        prefill, decode = (own, self._decode_stats) if self.role == "prefill" else (EngineStats(), own)
        return PDStats(prefill, decode, self._handed_off)

    def close(self) -> None:
        self.engine.close()

    # -- internals --------------------------------------------------------------------------------
    def _forget(self, i: int) -> None:
        r = self._requests.pop(i, None)
        if r is not None:
            self._index.pop(r.rid, None)

    def _report(self, o: RequestOutput) -> list:
        """World rank P's wire row of one decode output: only what rank 0 has not had yet."""
        k = self._sent.get(o.request_id, 0)
        self._sent[o.request_id] = len(o.token_ids)
        if o.finished:
            self._sent.pop(o.request_id)
        lp = None if o.logprobs is None else [[[t, v] for t, v in d.items()] for d in o.logprobs[k:]]
        return [o.request_id, list(o.token_ids[k:]), o.finished, o.finish_reason, lp]

    def _exchange(self, wire: list, left: bool = False) -> list[RequestOutput]:
        """The step's all-reduce of ``[work left, n]``, then world rank P's ``n`` bytes (module doc, step 3)."""
        reporter = self.world.rank == self.pcp_size
        data = json.dumps({"out": wire, "stats": dataclasses.asdict(self.engine.stats)}).encode() if reporter \
            else b""
        head = self.world.all_reduce(torch.tensor([int(left), len(data)], dtype=torch.int64)).tolist()
        self._left = head[0] > 0
        words = torch.zeros(-(-head[1] // 8), dtype=torch.int64)
        if reporter:
            words = torch.frombuffer(bytearray(data + bytes(-len(data) % 8)), dtype=torch.int64)
        words = self.world.all_reduce(words)
        if self.role == "decode":
            return []
        got = json.loads(words.numpy().tobytes()[:head[1]].decode())
        if self.world.rank != 0:  # another producer rank: only forget the requests the decode role finished
            for row in got["out"]:
                if row[2]:
                    self._forget(row[0])
            return []
        self._decode_stats = EngineStats(**got["stats"])
        return [o for o in map(self._rebuild, got["out"]) if o is not None]

    def _rebuild(self, row: list) -> RequestOutput | None:
        """Rank 0: a decode output from its wire row (None for a request aborted here meanwhile)."""
        i, new, finished, reason, lp = row
        r = self._requests.get(i)
        if r is None:
            return None
        toks, probs = self._acc.setdefault(i, ([], None if lp is None else []))
        toks.extend(new)
        if probs is not None:
            probs.extend({int(t): float(v) for t, v in d} for d in lp)
        if finished:
            self._acc.pop(i)
            self._forget(i)
        return RequestOutput(r.rid, r.prompt, tuple(toks), finished, reason,
                             None if probs is None else tuple(probs))
