"""What :func:`cpattn.engine.step_on_rank.step_on_rank` hangs on run_rank: the fixed batch's hooks
(:class:`RankBatch`) and a pool connector that times its tier (:class:`TimedPool`).

- :class:`RankBatch`: run_rank's ``on_start`` / ``before_step`` / ``on_step`` on this rank: the start line
  (an all-reduce over the world once every engine is built), each step's seconds, the fixed batch's stops
  (:func:`~cpattn.engine.step_generate.keep_latest`), the prompt logits of the finished requests, the
  :class:`~cpattn.engine.decode.SpecStats` of the decoding engine (colocated, or the P/D consumer), the spans
  a pool gave each request at admission, and at the end this rank's :class:`~cpattn.engine.result.RunFacts`.
- :class:`TimedPool`: a :class:`~cpattn.engine.connector.PoolConnector` whose bound copy counts the
  seconds its :class:`~cpattn.engine.pool_tier.PoolTier` spends in ``fetch`` (the lookup and the load of a
  prompt's pooled spans, at admission) and ``store`` (reading the whole blocks out of the cache and writing
  them, after each step; the DCP group's barrier after it is not counted). The seam is the connector's own
  tier, wrapped at bind: nothing is timed inside the engine, and a run without a pool times nothing.

Example
-------
>>> import torch
>>> from cpattn.engine.llm import LLMEngine, SamplingParams
>>> from cpattn.engine.pd_engine import memory_pool
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> engine = LLMEngine("qwen3", params, cfg, block_size=4, kv_connector=TimedPool(memory_pool("qwen3", cfg, params, 4)))
>>> _ = engine.generate([list(range(1, 12))], SamplingParams(max_tokens=2))
>>> engine.connector.stored_blocks, engine.connector.store_s > 0, engine.connector.load_s > 0  # a lookup, no hit
(3, True, True)
"""

from __future__ import annotations

import time

import torch

from cpattn.comm.group import Group
from cpattn.engine.connector import PoolConnector
from cpattn.engine.connector_pd import PDConnector
from cpattn.engine.handoff import HandoffFacts
from cpattn.engine.kv_rows import row_width
from cpattn.engine.pooling import PoolFacts
from cpattn.engine.result import RunFacts
from cpattn.engine.step_generate import SpecCount, keep_latest, runner_facts
from cpattn.models.family import param_dtype

DECODING = ("decode", "colocated")  # the run_rank roles whose engine decodes


class _TimedTier:
    """A PoolTier whose fetch and store add their seconds to ``load_s`` / ``store_s`` (the rest delegated)."""

    def __init__(self, tier) -> None:
        self.tier, self.load_s, self.store_s = tier, 0.0, 0.0

    def fetch(self, *args):
        return self._timed("fetch", "load_s", args)

    def store(self, *args):
        return self._timed("store", "store_s", args)

    def _timed(self, method: str, seconds: str, args: tuple):
        t0 = time.perf_counter()
        try:
            return getattr(self.tier, method)(*args)
        finally:
            setattr(self, seconds, getattr(self, seconds) + time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self.tier, name)


class TimedPool(PoolConnector):
    """:class:`~cpattn.engine.connector.PoolConnector` (same arguments, same behaviour) whose bound copy has
    ``load_s`` (seconds in its tier's fetch: lookups and loads) and ``store_s`` (its tier's stores)."""

    def bind(self, side) -> TimedPool:
        bound = super().bind(side)
        bound.tier = _TimedTier(bound.tier)
        return bound

    @property
    def load_s(self) -> float:
        return 0.0 if self.tier is None else self.tier.load_s

    @property
    def store_s(self) -> float:
        return 0.0 if self.tier is None else self.tier.store_s


class RankBatch:
    """run_rank's hooks on this rank for a fixed batch of ``b`` requests of ``n`` tokens, ``k`` drafts per
    decode row (module doc); ``on_step(decode steps so far)`` after each step that decoded; :meth:`facts` once
    the run ended."""

    def __init__(self, world: Group, b: int, n: int, k: int, on_step=None) -> None:
        self.world, self.b, self.n, self.spec, self.on_step = world, b, n, SpecCount(k), on_step
        self.latest, self.prompt, self.hits, self.times = {}, {}, {}, []
        self.stats, self.ttft, self.engine, self.role, self.prev, self.sent_first = None, 0.0, None, None, None, 0

    def start(self, role: str, engine) -> None:
        self.world.all_reduce(torch.zeros(1))  # every rank, its engine built: the start line
        self.role, self.engine = role, engine
        self.sent0, self.t0 = self.world.stats.total_sent(), time.perf_counter()

    def before(self, role: str, engine) -> None:
        self.spec.before(engine)
        self.prev, self.t = engine.last_step, time.perf_counter()

    def after(self, role: str, engine, outs) -> None:
        now = time.perf_counter()
        if engine.last_step is not None and engine.last_step is not self.prev:  # the engine stepped
            self.times.append(now - self.t)
            out, span = engine.last_step[0], engine.config.parallel.dcp_size
            for rid, loads in zip(out.req_ids, out.loads or ()):  # spans a pool gave at admission
                self.hits[rid] = self.hits.get(rid, 0) + len(loads) * span
            if role in DECODING and len(self.times) == 1:
                self.ttft = now - self.t0  # the first tokens out, their KV in the decoding engine's cache
                self.sent_first = engine.stats.bytes_sent
        keep_latest(engine, outs, self.latest, self.n)
        for o in outs:
            if o.finished and o.prompt_logits is not None:
                self.prompt[o.request_id] = o.prompt_logits
            if role == "prefill" and o.finished:
                self.ttft = now - self.t0  # the producer's last first token so far
        if role in DECODING:
            steps = self.spec.spec["steps"]
            self.spec.after(engine)
            self.stats = self.spec.stats(engine)
            if self.on_step is not None and self.stats.steps > steps:  # a step that decoded: progress
                self.on_step(self.stats.steps)

    def pool_facts(self, family, cfg, params, block_size: int) -> PoolFacts:
        """What this rank's pool connector did (an empty PoolFacts without one): whole blocks a pool gave each
        request at admission (``len(spans) * dcp_size``), blocks / bytes this rank loaded (every block of
        the spans it admitted: each DCP rank loads a span's N blocks) and stored (its own blocks), and the
        seconds of both (a :class:`TimedPool`'s; 0 for an untimed connector)."""
        conn = getattr(self.engine.connector, "connectors", (self.engine.connector,))
        pool = next((c for c in conn if isinstance(c, PoolConnector)), None)
        if pool is None:
            return PoolFacts()
        block = block_size * row_width(tuple(family.kv_layouts(cfg))) * param_dtype(params).itemsize
        return PoolFacts(hit_blocks=tuple(self.hits.get(i, 0) for i in range(self.b)),
                         blocks_loaded=pool.loaded_blocks, bytes_loaded=pool.loaded_bytes,
                         blocks_stored=pool.stored_blocks, bytes_stored=pool.stored_blocks * block,
                         load_s=getattr(pool, "load_s", 0.0), store_s=getattr(pool, "store_s", 0.0))

    def facts(self, family, cfg, params, block_size: int) -> RunFacts:
        """This rank's RunFacts (:mod:`cpattn.engine.step_on_rank`'s doc), once the run ended."""
        e, role = self.engine, self.role
        pfacts = self.pool_facts(family, cfg, params, block_size)
        if role == "colocated":  # as step_generate's: step 0 prefills every prompt, the later steps decode
            sent = {"prefill": self.sent_first, "decode": e.stats.bytes_sent - self.sent_first}
            return RunFacts(ttft_s=self.ttft, prefill_s=self.times[0] if self.times else 0.0,
                            step_s=tuple(self.times[1:]), bytes_sent=sent, pool=pfacts, **runner_facts(e))
        conn = getattr(e.connector, "connectors", (e.connector,))
        pd = next((c for c in conn if isinstance(c, PDConnector)), None)
        st = None if pd is None else pd.stats
        handoff = HandoffFacts() if st is None else HandoffFacts(
            blocks_sent=st.blocks_sent, bytes_sent=st.bytes_sent, blocks_received=st.blocks_received,
            bytes_received=st.bytes_received)
        sent = {role: e.stats.bytes_sent, "handoff": self.world.stats.total_sent() - self.sent0}
        common = dict(role=role, ttft_s=self.ttft, handoff=handoff, pool=pfacts, bytes_sent=sent)
        if role == "prefill":
            return RunFacts(prefill_s=sum(self.times), **common)
        return RunFacts(step_s=tuple(self.times[1:]), **runner_facts(e), **common)
