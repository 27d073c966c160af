"""One rank of a P/D fixed batch through the step loop: :func:`pd_step_on_rank`.

What :func:`cpattn.engine.driver.generate_on_rank` runs for a P/D pair (a ``kv_consumer`` decode config on a
world of ``P + N`` ranks), under torchrun / gloo or on the simulated mesh alike. The run is
:func:`~cpattn.engine.run_rank.run_rank` with ``pd=True``: world ranks ``0 .. P-1`` are the producer engine
(PCP over them), ranks ``P .. P+N-1`` the consumer engine (DCP), the whole blocks go producer rank to consumer
rank (the P/D connector), or through a KV pool (``pool``: run_rank's ``kv_pool``, opened on every rank). The
batch is :mod:`cpattn.engine.step_generate`'s: every prompt arrives at step 0 and is prefilled in that step
(:func:`~cpattn.engine.step_generate.batch_scheduler`); with k drafts a request asks for k more tokens and is
stopped once it has N (:func:`~cpattn.engine.step_generate.keep_latest`, from run_rank's ``on_step`` hook), so
every decode step verifies k drafts per row. So the tokens and logits are the simulated P/D
:func:`cpattn.engine.driver.generate`'s (:func:`~cpattn.engine.step_generate.step_generate`, a
:class:`~cpattn.engine.pd_engine.PDEngine`), and the tokens one-device greedy's.

Every rank returns a :class:`~cpattn.engine.result.Generation`:

- tokens [B, N] and logits [B, N, V]: decode rank 0's (world rank P), all-reduced over the world (with
  ``N = 1`` and no drafts nothing is handed off, the producer finishes each request: producer rank 0's). A
  decode rank whose tokens differ from rank 0's raises.
- prompt_logits [T, V]: the producer's, on the producer ranks only (None on the decode ranks, or with
  ``prompt_logits=False``); positions a pool held are not computed, so not covered.
- stats: the consumer's :class:`~cpattn.engine.decode.SpecStats`, counted as
  :func:`~cpattn.engine.step_generate.run_batch` counts them (empty on the producer ranks).
- facts: :class:`~cpattn.engine.result.RunFacts` of this rank's role, "prefill" or "decode", timed from a
  start line every rank meets once the engines are built: ``prefill_s`` (producer: its steps' seconds),
  ``ttft_s`` (producer: until its last first token; consumer: until its first step's tokens, the KV received),
  ``step_s`` (consumer: each later step), ``bytes_sent`` (``"prefill"`` / ``"decode"``: the role's engine;
  ``"handoff"``: everything this rank sent over the world: the blocks, the hidden rows, the hand-off's request
  rows and the loop's per-step all-reduce), ``kv_bytes`` / ``runner`` (consumer), ``handoff`` (the P/D
  connector's blocks and bytes sent / received, hidden rows included: the blocks the consumer can use, its
  computed tail excluded) and ``pool`` (blocks found per request, loaded, and stored: the producer stores, the
  consumer loads).

Example
-------
>>> import cpattn
>>> from cpattn.engine.driver import engine_configs
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> pre, dec = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=1, block_size=4, interleave_size=4, pd=True)
>>> gens = cpattn.simulate(3, pd_step_on_rank, "qwen3", qwen3.init_params(cfg), cfg, [list(range(1, 12)), [4, 5]],
...                        3, prefill=pre, decode=dec)
>>> [g.facts.role for g in gens], all(torch.equal(g.tokens, gens[2].tokens) for g in gens), gens[0].tokens.shape
(['prefill', 'prefill', 'decode'], True, torch.Size([2, 3]))
>>> gens[0].prompt_logits.shape[0], gens[2].prompt_logits, gens[2].facts.handoff.blocks_received
(13, None, 2)
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import EngineConfig
from cpattn.engine.connector import PoolConnector
from cpattn.engine.connector_pd import PDConnector
from cpattn.engine.decode import SpecStats
from cpattn.engine.handoff import HandoffFacts
from cpattn.engine.kv_rows import row_width
from cpattn.engine.logits import acc_dtype
from cpattn.engine.pooling import PoolFacts
from cpattn.engine.result import Generation, RunFacts
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.engine.sampling import SamplingParams
from cpattn.engine.step_generate import (
    SpecCount, _blocks, _cut, batch_scheduler, generation, keep_latest, runner_facts, speculative_k,
)
from cpattn.models.family import ModelFamily, get_family, param_dtype


def pd_step_on_rank(world: Group, model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                    prefill: EngineConfig, decode: EngineConfig, drafter=None, prompt_logits: bool = True,
                    pool=None) -> Generation:
    """This rank of a P/D fixed batch (module doc); call it on every rank of a world of ``P + N`` ranks.

    prompts: B token lists; max_new_tokens: N greedy tokens each. prefill / decode: the kv_producer and
    kv_consumer configs (:func:`~cpattn.engine.driver.engine_configs` with ``pd=True``): P =
    ``prefill.parallel.pcp_size``, N = ``decode.parallel.dcp_size``, the block size, the decode's graph mode and
    speculative k. drafter: the consumer's (one reading hidden states gets the producer's rows). pool: a
    :class:`~cpattn.engine.pooling.PoolSpec` (opened on every rank, released at the end) or an open pool.
    Returns tokens [B, N], logits [B, N, V] (every rank), prompt_logits [T, V] (producer ranks), stats, facts.
    """
    family = get_family(model)
    p, n, bs = prefill.parallel.pcp_size, decode.parallel.dcp_size, decode.cache.block_size
    k = speculative_k(decode, drafter)
    sched = batch_scheduler(family, [len(q) for q in prompts], max_new_tokens, k, pd=True)
    comp = decode.compilation
    batch = _Batch(world, len(prompts), max_new_tokens, k)
    final = run_rank(world, family, params, cfg, [Arrival(list(q), SamplingParams(max_tokens=max_new_tokens + k))
                                                  for q in prompts],
                     pd=True, pcp_size=p, dcp_size=n, block_size=bs, scheduler=sched, kv_pool=pool,
                     graph_mode=comp.graph_mode, graph_backend=comp.graph_backend, capture_sizes=comp.capture_sizes,
                     num_blocks=_blocks(sched, bs, 1), drafter=drafter, num_speculative_tokens=k,
                     return_logits=True, return_prompt_logits=prompt_logits and world.rank < p,
                     on_start=batch.start, before_step=batch.before, on_step=batch.after)
    facts = batch.facts(family, cfg, params, bs)
    handed = max_new_tokens + k > 1  # else the producer finishes every request (hands_off)
    source = p if handed else 0
    dtype = acc_dtype(param_dtype(params))
    mine = None
    if world.rank == source or (handed and world.rank >= p):
        mine = generation([_cut(final[i], max_new_tokens) for i in range(len(prompts))], facts, SpecStats())
    if world.rank == source:
        tokens, logits = mine.tokens, mine.logits.to(dtype)
    else:
        tokens = torch.zeros(len(prompts), max_new_tokens, dtype=torch.int64)
        logits = torch.zeros(len(prompts), max_new_tokens, cfg.vocab_size, dtype=dtype)
    tokens, logits = world.all_reduce(tokens), world.all_reduce(logits)  # the source's, on every rank
    if mine is not None and not torch.equal(mine.tokens, tokens):
        raise RuntimeError(f"world rank {world.rank} generated different tokens than rank {source}; the ranks diverged")
    plogits = None
    if world.rank < p and prompt_logits and all(batch.prompt.get(i) is not None for i in range(len(prompts))):
        plogits = torch.cat([batch.prompt[i] for i in range(len(prompts))])
    return Generation(tokens, logits, plogits, batch.stats or SpecStats(), facts)


class _Batch:
    """run_rank's hooks on this rank: the start line, step times, the fixed batch's stops (``keep_latest``),
    the producer's prompt logits, the consumer's SpecStats, and at the end what the connectors did."""

    def __init__(self, world: Group, b: int, n: int, k: int) -> None:
        self.world, self.b, self.n, self.spec = world, b, n, SpecCount(k)
        self.latest, self.prompt, self.hits, self.times = {}, {}, {}, []
        self.stats, self.ttft, self.engine, self.role, self.prev = None, 0.0, None, None, None

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
            if role == "decode" and len(self.times) == 1:
                self.ttft = now - self.t0  # the first tokens out, their KV in the consumer's cache
        keep_latest(engine, outs, self.latest, self.n)
        for o in outs:
            if o.finished and o.prompt_logits is not None:
                self.prompt[o.request_id] = o.prompt_logits
            if role == "prefill" and o.finished:
                self.ttft = now - self.t0  # the producer's last first token so far
        if role == "decode":
            self.spec.after(engine)
            self.stats = self.spec.stats(engine)

    def facts(self, family, cfg, params, block_size: int) -> RunFacts:
        """This rank's RunFacts (module doc), once the run ended."""
        e, decode = self.engine, self.role == "decode"
        conn = getattr(e.connector, "connectors", (e.connector,))
        pd = next((c for c in conn if isinstance(c, PDConnector)), None)
        pool = next((c for c in conn if isinstance(c, PoolConnector)), None)
        st = None if pd is None else pd.stats
        handoff = HandoffFacts() if st is None else HandoffFacts(
            blocks_sent=st.blocks_sent, bytes_sent=st.bytes_sent, blocks_received=st.blocks_received,
            bytes_received=st.bytes_received)
        pfacts = PoolFacts()
        if pool is not None:
            block = block_size * row_width(tuple(family.kv_layouts(cfg))) * param_dtype(params).itemsize
            pfacts = PoolFacts(hit_blocks=tuple(self.hits.get(i, 0) for i in range(self.b)),
                               blocks_loaded=pool.loaded_blocks, bytes_loaded=pool.loaded_bytes,
                               blocks_stored=pool.stored_blocks, bytes_stored=pool.stored_blocks * block)
        sent = {"decode" if decode else "prefill": e.stats.bytes_sent,
                "handoff": self.world.stats.total_sent() - self.sent0}
        common = dict(role=self.role, ttft_s=self.ttft, handoff=handoff, pool=pfacts, bytes_sent=sent)
        if not decode:
            return RunFacts(prefill_s=sum(self.times), **common)
        return RunFacts(step_s=tuple(self.times[1:]), **runner_facts(e), **common)
