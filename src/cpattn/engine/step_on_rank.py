"""One rank of a fixed batch through the step loop: :func:`step_on_rank` (P/D, or colocated with a KV pool).

What :func:`cpattn.engine.driver.generate_on_rank` runs, under torchrun / gloo or on the simulated mesh alike,
for a P/D pair (a ``kv_consumer`` decode config on a world of ``P + N`` ranks) and for a colocated run with a
KV pool (``pool``: on a world of ``max(P, N)`` ranks). The run is
:func:`~cpattn.engine.run_rank.run_rank`, the layout picked from the decode config:

- **P/D** (``pd=True``): world ranks ``0 .. P-1`` are the producer engine (PCP over them), ranks
  ``P .. P+N-1`` the consumer engine (DCP); the whole blocks go producer rank to consumer rank (the P/D
  connector), or through the KV pool (opened on every rank: the producer stores, the consumer loads).
- **colocated** (``pd=False``): one engine over the world, DCP over its N ranks, its prompt chunks PCP
  over the first P (:func:`~cpattn.engine.step_generate.build_engine`'s layout); the pool is its prefix
  cache's second tier (:class:`~cpattn.engine.connector.PoolConnector`): at admission each prompt's pooled
  whole spans (``block_size * N`` tokens, one block per DCP rank; always one prompt token left to compute)
  are loaded instead of computed, and every whole block that becomes computed -- the prompt's, and those
  the decoded tokens fill -- is stored by the DCP rank that holds it (put-if-absent: a block already
  pooled is not written again).

The batch is :mod:`cpattn.engine.step_generate`'s: every prompt arrives at step 0 and is prefilled in that
step (:func:`~cpattn.engine.step_generate.batch_scheduler`, prefix caching on: the pool is its second tier;
the device tier finds nothing in a fresh engine's first step); with k drafts a request asks for k more tokens
and is stopped once it has N (:func:`~cpattn.engine.step_generate.keep_latest`, from run_rank's ``on_step``
hook), so every decode step verifies k drafts per row. So the tokens and logits are
:func:`cpattn.engine.driver.generate`'s through the step loop (:func:`~cpattn.engine.step_generate.step_generate`),
and the tokens one-device greedy's.

Every rank returns a :class:`~cpattn.engine.result.Generation`:

- tokens [B, N] and logits [B, N, V]: colocated, this rank's engine's (every rank's alike); P/D, decode
  rank 0's (world rank P), all-reduced over the world (with ``N = 1`` and no drafts nothing is handed off,
  the producer finishes each request: producer rank 0's); a decode rank whose tokens differ raises.
- prompt_logits [T, V] (None with ``prompt_logits=False``): the computed prompt positions only -- those a
  pool held are not computed, so not covered (``T`` = the prompt tokens less ``block_size`` per pooled
  block); P/D: the producer's, on the producer ranks only (None on the decode ranks).
- stats: the decoding engine's :class:`~cpattn.engine.decode.SpecStats` (colocated, or the consumer),
  counted as :func:`~cpattn.engine.step_generate.run_batch` counts them (empty on the producer ranks).
- facts: :class:`~cpattn.engine.result.RunFacts` of this rank, timed from a start line every rank meets once
  the engines are built (:class:`~cpattn.engine.step_on_rank_hooks.RankBatch`). Colocated (role "both", as
  step_generate's): ``ttft_s`` until step 0's tokens (every prompt prefilled, its blocks stored),
  ``prefill_s`` step 0's seconds, ``step_s`` each later step, ``bytes_sent`` ``{"prefill": step 0,
  "decode": the rest}`` (the engine's), ``kv_bytes`` / ``runner``, an empty ``handoff``. P/D (role
  "prefill" or "decode"): ``prefill_s`` (producer: its steps' seconds), ``ttft_s`` (producer: until its last
  first token; consumer: until its first step's tokens, the KV received), ``step_s`` (consumer: each later
  step), ``bytes_sent`` (``"prefill"`` / ``"decode"``: the role's engine; ``"handoff"``: everything this rank
  sent over the world: the blocks, the hidden rows, the hand-off's request rows and the loop's per-step
  all-reduce), ``kv_bytes`` / ``runner`` (consumer), ``handoff`` (the P/D connector's blocks and bytes sent /
  received, hidden rows included: the blocks the consumer can use, its computed tail excluded). Both:
  ``pool`` (:class:`~cpattn.engine.pooling.PoolFacts`, from the pool connector's counters: whole blocks a
  pool gave each request; blocks / bytes this rank loaded -- every block of the spans it admitted -- and
  stored -- its own; ``load_s`` / ``store_s``: the seconds its tier spent fetching and storing,
  :class:`~cpattn.engine.step_on_rank_hooks.TimedPool`; P/D: the producer stores, the consumer loads).

Example
-------
>>> import cpattn
>>> from cpattn.engine.driver import engine_configs
>>> from cpattn.engine.pd_engine import memory_pool
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> pre, dec = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=1, block_size=4, interleave_size=4, pd=True)
>>> gens = cpattn.simulate(3, step_on_rank, "qwen3", params, cfg, [list(range(1, 12)), [4, 5]], 3, prefill=pre,
...                        decode=dec)
>>> [g.facts.role for g in gens], all(torch.equal(g.tokens, gens[2].tokens) for g in gens), gens[0].tokens.shape
(['prefill', 'prefill', 'decode'], True, torch.Size([2, 3]))
>>> gens[0].prompt_logits.shape[0], gens[2].prompt_logits, gens[2].facts.handoff.blocks_received
(13, None, 2)

Colocated, DCP 2, through one in-process pool: the warm run loads the cold one's first span (2 blocks)

>>> pre, dec = engine_configs("qwen3", cfg, dcp_size=2, block_size=4, interleave_size=4)
>>> pool = memory_pool("qwen3", cfg, params, 4)
>>> cold, warm = (cpattn.simulate(2, step_on_rank, "qwen3", params, cfg, [list(range(1, 12))], 2, prefill=pre,
...                               decode=dec, pool=pool) for _ in range(2))
>>> cold[0].facts.pool.hit_blocks, warm[0].facts.pool.hit_blocks, warm[0].prompt_logits.shape[0]
((0,), (2,), 3)
>>> torch.equal(cold[0].tokens, warm[1].tokens), sum(g.facts.pool.blocks_stored for g in cold)
(True, 3)
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import EngineConfig, GuideCompatWarning
from cpattn.engine.decode import SpecStats
from cpattn.engine.logits import acc_dtype
from cpattn.engine.result import Generation
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.engine.sampling import SamplingParams
from cpattn.engine.step_generate import _blocks, _cut, batch_scheduler, generation, speculative_k
from cpattn.engine.step_on_rank_hooks import RankBatch, TimedPool
from cpattn.models.family import ModelFamily, get_family, param_dtype


def step_on_rank(world: Group, model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                 prefill: EngineConfig, decode: EngineConfig, drafter=None, prompt_logits: bool = True,
                 pool=None, algorithms=None, on_step=None) -> Generation:
    """This rank of a fixed batch through run_rank (module doc); call it on every rank of the world.

    prompts: B token lists; max_new_tokens: N greedy tokens each. prefill / decode: the run's two configs
    (:func:`~cpattn.engine.driver.engine_configs`): P = ``prefill.parallel.pcp_size``, N =
    ``decode.parallel.dcp_size``, the block size (and colocated, the interleave size: a pool over DCP ranks
    needs ``interleave_size = block_size``), the decode's graph mode and speculative k. A ``kv_consumer``
    decode config (``pd=True``) is a P/D pair on ``P + N`` ranks; else one colocated engine on ``max(P, N)``
    ranks (with ``P > N`` the ranks past N hold no blocks: they look spans up as the others do, write and store none). drafter: the decoding engine's
    (under P/D one reading hidden states gets the producer's rows). pool: a
    :class:`~cpattn.engine.pooling.PoolSpec` (opened on every rank, released at the end) or an open pool.
    algorithms: every engine's (:func:`~cpattn.engine.run_rank.run_rank`; None: the runners' own choices).
    on_step: called with the decode steps so far after each step of the decoding engine that decoded (on the
    ranks that decode; progress, as the fixed-batch composition's decode calls it).
    Returns tokens [B, N], logits [B, N, V] (every rank), prompt_logits [T, V] (the computed positions;
    P/D: producer ranks), stats, facts.
    """
    family = get_family(model)
    pd = decode.kv_transfer.kv_role == "kv_consumer"
    p, n, bs = prefill.parallel.pcp_size, decode.parallel.dcp_size, decode.cache.block_size
    b, k = len(prompts), speculative_k(decode, drafter)
    # prefix caching on where the pool (or the P/D hand-off) is the prefix cache's second tier
    sched = batch_scheduler(family, [len(q) for q in prompts], max_new_tokens, k, pd=pd or pool is not None)
    comp = decode.compilation
    batch = RankBatch(world, b, max_new_tokens, k, on_step)
    layout = dict(num_blocks=_blocks(sched, bs, 1)) if pd else \
        dict(interleave_size=decode.cache.cp_kv_cache_interleave_size, num_blocks=_blocks(sched, bs, n))
    arrivals = [Arrival(list(q), SamplingParams(max_tokens=max_new_tokens + k)) for q in prompts]
    with contextlib.nullcontext() if pd else warnings.catch_warnings():
        if not pd:  # PCP + DCP in one engine: the driver's pair checked the guide's rules (as step_generate's)
            warnings.simplefilter("ignore", GuideCompatWarning)
        final = run_rank(world, family, params, cfg, arrivals, pd=pd, pcp_size=p, dcp_size=n, block_size=bs,
                         scheduler=sched, kv_connector=None if pool is None else TimedPool(pool),
                         graph_mode=comp.graph_mode, graph_backend=comp.graph_backend, algorithms=algorithms,
                         capture_sizes=comp.capture_sizes, drafter=drafter, num_speculative_tokens=k,
                         return_logits=True, return_prompt_logits=prompt_logits and (not pd or world.rank < p),
                         on_start=batch.start, before_step=batch.before, on_step=batch.after, **layout)
    facts = batch.facts(family, cfg, params, bs)
    if not pd:  # every rank of the one engine has every request's output
        return generation([_cut(final[i], max_new_tokens) for i in range(b)], facts, batch.stats or SpecStats())
    handed = max_new_tokens + k > 1  # else the producer finishes every request (hands_off)
    source = p if handed else 0
    dtype = acc_dtype(param_dtype(params))
    mine = None
    if world.rank == source or (handed and world.rank >= p):
        mine = generation([_cut(final[i], max_new_tokens) for i in range(b)], facts, SpecStats())
    if world.rank == source:
        tokens, logits = mine.tokens, mine.logits.to(dtype)
    else:
        tokens = torch.zeros(b, max_new_tokens, dtype=torch.int64)
        logits = torch.zeros(b, max_new_tokens, cfg.vocab_size, dtype=dtype)
    tokens, logits = world.all_reduce(tokens), world.all_reduce(logits)  # the source's, on every rank
    if mine is not None and not torch.equal(mine.tokens, tokens):
        raise RuntimeError(f"world rank {world.rank} generated different tokens than rank {source}; the ranks diverged")
    plogits = None
    if world.rank < p and prompt_logits and all(batch.prompt.get(i) is not None for i in range(b)):
        plogits = torch.cat([batch.prompt[i] for i in range(b)])
    return Generation(tokens, logits, plogits, batch.stats or SpecStats(), facts)


def pd_step_on_rank(world: Group, model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                    prefill: EngineConfig, decode: EngineConfig, drafter=None, prompt_logits: bool = True,
                    pool=None, algorithms=None) -> Generation:
    """:func:`step_on_rank` of a P/D pair (the P/D entry, kept): ``decode`` must be a ``kv_consumer`` config
    (:func:`~cpattn.engine.driver.engine_configs` with ``pd=True``) and the world ``P + N`` ranks."""
    if decode.kv_transfer.kv_role != "kv_consumer":
        raise ValueError(f"pd_step_on_rank: the decode config's kv_role is {decode.kv_transfer.kv_role!r}; pass a P/D "
                         "pair (engine_configs(..., pd=True)) or call step_on_rank for a colocated run")
    return step_on_rank(world, model, params, cfg, prompts, max_new_tokens, prefill=prefill, decode=decode,
                        drafter=drafter, prompt_logits=prompt_logits, pool=pool, algorithms=algorithms)
