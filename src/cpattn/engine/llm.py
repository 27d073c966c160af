"""``LLMEngine``: requests arrive, the engine steps (vLLM's ``LLMEngine`` shape).

Each :meth:`LLMEngine.step` is one turn of the loop::

    scheduler.schedule()  ->  SchedulerOutput (rows: query / context lens, block tables, drafts)
        ->  StepRunner.execute on every DCP rank  ->  sampled tokens (the same on every rank)
        ->  scheduler.update  ->  RequestOutput per row, finished ones marked

The scheduler (:mod:`cpattn.engine.scheduler`) and its block manager
(:mod:`cpattn.engine.blocks`) are host-side and deterministic, so under
torchrun every rank runs its own copy and they agree without talking; on
the simulated mesh one copy drives ``dcp_size`` runner threads. Greedy
sampling (``temperature=0``, the default): each request's tokens equal one-device greedy generation of that
request alone, whatever the arrivals, the budget (so the chunk
boundaries), the batch mix, preemptions and prefix-cache hits. Sampled requests
(:class:`~cpattn.engine.sampling.SamplingParams` temperature / top_p / top_k / seed): output token i
is a function of the logits, the seed and i (:mod:`cpattn.engine.sampling`), so a seeded request
gets the same tokens under all of those too, and with or without speculative decoding.

Example
-------
>>> from cpattn.config import SchedulerConfig
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> engine = LLMEngine("qwen3", qwen3.init_params(cfg), cfg, dcp_size=2, block_size=4, num_blocks=16,
...                    scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4))
>>> a = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=3))   # 10 tokens: 2 chunks
>>> finished = []
>>> while engine.has_unfinished():
...     if engine.stats.steps == 2:  # arrives once a's prompt is cached; shares its first 8 tokens
...         b = engine.add_request(list(range(1, 9)) + [20, 21], SamplingParams(max_tokens=2))
...     finished += [o for o in engine.step() if o.finished]
>>> [(o.request_id, len(o.token_ids), o.finish_reason) for o in finished]
[(0, 3, 'length'), (1, 2, 'length')]
>>> engine.stats.prefix_hit_tokens, engine.stats.blocks_used   # b found a's first span; nothing leaked
(8, 0)
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import SimMesh, run_ranks
from cpattn.config import EngineConfig, SchedulerConfig
from cpattn.engine.blocks import BlockManager
from cpattn.engine.decode_stage import graph_backend as pick_backend
from cpattn.engine.drafters import check_drafter
from cpattn.engine.elastic import resolve as resolve_pcp
from cpattn.engine.elastic_measure import measure as measure_pcp
from cpattn.engine.outputs import (CUMULATIVE, EngineStats, RequestOutput, RequestOutputKind, drain,
                                   one_token_outputs, step_outputs)
from cpattn.engine.driver import engine_configs
from cpattn.engine.connector import Side, from_args as connector_args
from cpattn.engine.options import Algorithms, engine_algorithms
from cpattn.engine.proposer import Proposer
from cpattn.engine.returns import Returns
from cpattn.engine.runner import StepResult, StepRunner
from cpattn.engine.runner_wide import check_engine
from cpattn.engine.sampling import SamplingParams, engine_seed as _engine_seed
from cpattn.engine.scheduler import ModelOutput, Scheduler
from cpattn.models.family import ModelFamily, get_family
from cpattn.dcp.layer_merges import ENGINE_MERGE


KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def _default_blocks(sched: SchedulerConfig, span: int) -> int:
    """Enough blocks for max_num_seqs sequences of max_model_len (4096 when unset)."""
    return sched.max_num_seqs * -(-(sched.max_model_len or 4096) // span)


class LLMEngine:
    """The step loop over one DCP group (module docstring).

    Arguments
    ---------
    model, params, cfg: a family (or its name), its weights, its config.
    config: the engine's :class:`~cpattn.config.EngineConfig` (DCP size, PCP size: 1..the DCP size, more for paged
        families: PCP over ``pcp_size`` ranks, the decodes DCP over the first ``dcp_size``, :mod:`~.runner_wide`;
        block and interleave sizes, graph mode); None: built from ``dcp_size`` / ``pcp_size`` (> 1: one engine with
        PCP + DCP, a step's prefill chunks run PCP over the first ``pcp_size`` ranks of the DCP group, the decodes
        DCP over all of them; for DeepSeek-V4 and hybrid models too) / ``block_size`` / ``interleave_size`` /
        ``graph_mode`` / ``graph_backend`` ("auto": a compiler where the group can be traced) / ``capture_sizes``
        by :func:`cpattn.engine.driver.engine_configs`.
    scheduler: the :class:`~cpattn.config.SchedulerConfig` (budget, request cap, chunking, prefix caching).
    world: this rank's group under torchrun (every rank builds the engine and calls the same methods
        in the same order); None: a simulated mesh of ``max(dcp_size, pcp_size)`` threads in this process.
    num_blocks: KV blocks per rank (default: ``max_num_seqs`` sequences of ``max_model_len``).
    kv_pool: a KV pool (a :class:`~cpattn.engine.pooling.PoolSpec` or an open pool) as the prefix
        cache's second tier (:mod:`cpattn.engine.pool_tier`): spans not on the device are fetched from
        it at admission, computed blocks are stored after each step (DCP needs ``interleave_size =
        block_size``). Under torchrun each rank stores its own blocks, then the group meets at a barrier,
        so every rank's scheduler finds the same spans at the next admission. ``engine.close()``
        releases a pool the engine opened. kv_role: "kv_both" (fetch and store), "kv_producer" (the
        same: the pool is also its prefix cache) or "kv_consumer" (fetch only: a P/D decode role, whose
        ranks never race the producer's stores).
        kv_connector: instead of ``kv_pool``, any :class:`~cpattn.engine.connector.KVConnector` (a pool, the
        P/D connector, their sum); the engine binds its own copy (``engine.connector``).
    drafter: a drafter (:class:`~cpattn.drafters.ngram.NgramDrafter`, a draft model, or an MTP /
        Eagle3 / DSpark head, which gets the target's hidden states) with ``num_speculative_tokens`` =
        k >= 1 (or the config's); None: plain decode.
    pcp_policy: with ``pcp_size > 1``, "always" (every prefill chunk runs PCP) or "elastic" (only chunks of
        at least ``pcp_min_tokens`` new tokens; None: the planner's break-even, :mod:`cpattn.engine.elastic`;
        "measure": timed on ``world`` when the engine is built, :mod:`cpattn.engine.elastic_measure`).
    merge: the DCP merge of the attention step. poison: NaN-fill blocks as they are handed out.
    algorithms: None (the runners choose: PCP "ring", "allgather" for a chunk with cached context), or an
        :class:`~cpattn.engine.options.Algorithms` every runner uses exactly (``engine.algorithms``): the DCP merge
        is its ``dcp_merge`` (a non-default ``merge`` that disagrees is a ValueError); what each runner honours:
        :class:`~cpattn.engine.runner.StepRunner` (DSA: no ``pcp_method``, one all-gather merge), hybrid likewise
        (no DSA), DeepSeek-V4 none (:class:`~cpattn.engine.runner_v4.V4StepRunner`).
    seed: the engine's generator, which gives each request added without a seed its own
        (:mod:`cpattn.engine.sampling`); None: a random one (under torchrun rank 0's, shared).
    return_logits / return_prompt_logits: opt-in, off by default (no cost then): each RequestOutput also
        carries the raw logits row of every output token / the logits of every prompt position computed
        (:mod:`cpattn.engine.returns`).
    hidden_layers: without a drafter, the target hidden states to keep anyway (a drafter's
        ``hidden_layers``): a P/D producer keeps each request's prompt rows for its connector, which hands
        them to the consumer's drafter (:mod:`cpattn.engine.connector_pd`). With a drafter: its own.

    ``engine.last_step`` is ``(SchedulerOutput, replayed)`` of the latest step (what ran, and whether
    it replayed a captured program); ``engine.stats`` the counters.
    """

    def __init__(self, model: ModelFamily | str, params: dict, cfg: Any, *, config: EngineConfig | None = None,
                 scheduler: SchedulerConfig | None = None, world: Group | None = None, dcp_size: int = 1,
                 pcp_size: int = 1, block_size: int = 16, interleave_size: int = 1, graph_mode: str = "NONE",
                 graph_backend: str = "auto", capture_sizes=None, num_blocks: int | None = None,
                 merge: str = ENGINE_MERGE, drafter=None, num_speculative_tokens: int = 0, kv_pool=None,
                 poison: bool = False, seed: int | None = None, kv_role: str = "kv_both",
                 pcp_policy: str = "always", pcp_min_tokens: int | str | None = None, kv_connector=None,
                 return_logits: bool = False, return_prompt_logits: bool = False,
                 hidden_layers: tuple | None = None, algorithms: Algorithms | None = None) -> None:
        family = get_family(model)
        merge, algorithms = engine_algorithms(algorithms, merge)  # checked before anything is built
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role={kv_role!r}; pass one of {', '.join(KV_ROLES)} (vLLM's kv_transfer_config roles)")
        if config is None:
            config = engine_configs(family, cfg, dcp_size=dcp_size, pcp_size=pcp_size, one_engine=pcp_size > 1,
                                    block_size=block_size, interleave_size=interleave_size, graph_mode=graph_mode,
                                    graph_backend=graph_backend, capture_sizes=capture_sizes,
                                    num_speculative_tokens=num_speculative_tokens,
                                    speculative_method=getattr(drafter, "method", None))[1]
        sched = scheduler or SchedulerConfig()
        v4 = family.backend.name == "v4"  # DeepSeek-V4: its own runner; what it cannot do is refused here
        if v4:
            from cpattn.engine.runner_v4 import v4_scheduler_config  # here: cpattn.v4 imports cpattn.engine

            sched = v4_scheduler_config(family, scheduler, kv_pool=kv_pool or kv_connector, drafter=drafter)
        hybrid = family.backend.name == "hybrid"  # Qwen3-Next / Qwen3.5: paged KV + state slots (runner_hybrid)
        if hybrid:
            from cpattn.engine.runner_hybrid import HybridStepRunner, hybrid_scheduler_config

            sched = hybrid_scheduler_config(family, scheduler, kv_pool=kv_pool or kv_connector, drafter=drafter)
        k = config.speculative.num_speculative_tokens
        if drafter is None and k:
            raise ValueError(f"num_speculative_tokens={k} needs a drafter: pass drafter= (e.g. NgramDrafter()) or k=0")
        check_drafter(drafter, k)
        n, pcp = config.parallel.dcp_size, config.parallel.pcp_size
        ranks = check_engine(family, pcp, n, world, kv_pool or kv_connector)  # max(pcp, n): runner_wide's refusals
        pcp_min = resolve_pcp(pcp_policy, pcp_min_tokens, family, cfg, pcp, measure=lambda: measure_pcp(
            family, params, cfg, world, pcp_size=pcp, dcp_size=n, block_size=config.cache.block_size,
            interleave_size=config.cache.cp_kv_cache_interleave_size, budget=sched.max_num_batched_tokens))
        block, inter = config.cache.block_size, config.cache.cp_kv_cache_interleave_size
        nb = num_blocks if num_blocks is not None else _default_blocks(sched, block * n)
        self.family, self.config, self.scheduler_config, self.algorithms = family, config, sched, algorithms
        self.connector = connector_args(kv_pool, kv_connector)  # the scheduler's second tier (cpattn.engine.connector)
        layers = hidden_layers if drafter is None else drafter.hidden_layers  # the target hidden rows kept
        if self.connector is not None:
            barrier = None if world is None or n == 1 else (lambda: world.all_reduce(torch.zeros(1)))
            self.connector = self.connector.bind(Side(
                family, cfg, params, block, inter, n, None if world is None else world.rank, kv_role,
                sched.enable_prefix_caching, barrier=barrier,
                read=lambda r, bid: self.runners[0 if self._mesh is None else r].shard.read_block(bid),
                hidden_layers=layers, hidden=lambda rid: self._hidden.get(rid)))
        self.pool = getattr(self.connector, "pool", None)
        self.tier2, self.kv_role = self.connector, kv_role
        self.blocks = BlockManager(nb, block, dcp_size=n, interleave_size=inter,
                                   identity=None if self.pool is None else self.pool.identity,
                                   enable_caching=sched.enable_prefix_caching)
        if v4:
            from cpattn.engine.runner_v4 import V4Scheduler, V4StepRunner
        sched_cls = V4Scheduler if v4 else Scheduler  # V4: whole prompts only
        self.scheduler = sched_cls(self.blocks, max_num_batched_tokens=sched.max_num_batched_tokens,
                                   max_num_seqs=sched.max_num_seqs, enable_chunked_prefill=sched.enable_chunked_prefill,
                                   num_speculative_tokens=k, tier2=self.connector)
        self._hidden: dict[Hashable, tuple[int, dict]] = {}  # target hidden rows not yet given to the drafter
        self.max_model_len = sched.max_model_len or nb * block * n
        self._mesh = None if world is not None else SimMesh(ranks)
        groups = [world] if world is not None else self._mesh.groups()
        capture = pick_backend(config, family, groups[0]) if config.compilation.captures else None
        self.proposer = Proposer(drafter, k, max_num_seqs=sched.max_num_seqs, max_len=self.max_model_len + k + 1,
                                 graph=capture) if drafter is not None else None  # graph mode: draft steps captured
        sizes = config.compilation.capture_sizes

        make = V4StepRunner if v4 else HybridStepRunner if hybrid else StepRunner  # V4 / hybrid: own runners
        if v4 and pcp_policy != "always":
            raise ValueError(f"pcp_policy={pcp_policy!r}: a deepseek_v4 prompt is prefilled in one step by its own "
                             "runner; pass pcp_policy='always'")
        extra = {"connector": self.connector} if v4 else {"pcp_min_tokens": pcp_min}  # V4 P/D: the runner hands off
        extra.update({"dcp_size": n} if pcp > n else {})  # the DCP group, the world's first n (runner_wide)
        if hybrid:  # hybrid P/D: the runner stages / installs the linear states (connector_hybrid)
            extra["connector"] = self.connector

        def runner(g: Group) -> StepRunner:  # a capture runs the step: every rank builds at once
            return make(g, family, params, cfg, num_blocks=nb, block_size=block, interleave_size=inter,
                        max_model_len=self.max_model_len, merge=merge, capture=capture,
                        capture_sizes=list(sizes) if sizes else None, max_num_seqs=sched.max_num_seqs,
                        num_speculative_tokens=k, pcp_size=pcp, poison=poison, **extra,
                        hidden_layers=layers, algorithms=algorithms)

        self._groups = groups
        self.runners = run_ranks(self._mesh, groups, runner, what="LLMEngine") if len(groups) > 1 \
            else [runner(groups[0])]  # one rank: its errors as raised
        for r in self.runners if return_prompt_logits else ():
            r.prompt_logits = True
        self._prompts: dict[Hashable, tuple[int, ...]] = {}
        self.returns = Returns(return_logits, return_prompt_logits)  # logprobs, logits, prompt logits
        self._token_ids: dict[Hashable, tuple[int, ...]] = {}  # unfinished requests' output tokens, as last returned
        self._kinds: dict[Hashable, RequestOutputKind] = {}  # unfinished requests not CUMULATIVE (outputs.step_outputs)
        self._seeds = torch.Generator().manual_seed(_engine_seed(seed, world))
        self._counts = {"replayed_steps": 0, "eager_steps": 0, "bytes_sent": 0, "last_step_bytes": 0,
                        "drafted_tokens": 0, "accepted_tokens": 0, "pcp_steps": 0}
        self.last_step: tuple | None = None  # (SchedulerOutput, replayed) of the latest step
        self.step_times: dict[str, float] = {}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; returns its id (0, 1, ... unless given). Checked now, not at its first step."""
        p = params or SamplingParams()
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params: saw {type(p).__name__}; expected a cpattn.engine.SamplingParams")
        ids = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids
        prompt = list(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt_token_ids must be int token ids; got {prompt[:4]!r}...")
        vocab = getattr(self.runners[0].cfg, "vocab_size", None)
        bad = [t for t in prompt if vocab is not None and not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:4]} are outside the vocabulary [0, {vocab})")
        if len(prompt) + p.max_tokens - 1 > self.max_model_len:
            raise ValueError(f"request needs {len(prompt)} prompt + {p.max_tokens} max_tokens - 1 tokens; "
                             f"max_model_len is {self.max_model_len}: shorten it or raise max_model_len")
        if p.seed is None:  # every unseeded request draws one, so the stream depends on the arrival order only
            p = replace(p, seed=int(torch.randint(0, 2 ** 63 - 1, (), generator=self._seeds)))
        rid = self.scheduler.add_request(prompt, max_tokens=p.max_tokens, stop_token_ids=p.stop_token_ids,
                                         req_id=request_id, sampling=None if p.greedy else p)  # None: argmax
        self._prompts[rid] = tuple(prompt)
        self.returns.add(rid, p.logprobs)
        if p.output_kind is not CUMULATIVE:
            self._kinds[rid] = p.output_kind
        return rid

    def abort_request(self, request_id: Hashable) -> bool:
        """Stop a request now (its blocks freed); False if it had already finished."""
        self.returns.drop(request_id)
        self._token_ids.pop(request_id, None)
        self._kinds.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Submit every prompt now and step until all finish (vLLM's ``LLM.generate``): the final
        :class:`RequestOutput` of each, in prompt order. The fixed-batch run of
        :func:`cpattn.engine.generate` as a schedule: the same greedy tokens."""
        return drain(self, prompts, params)

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and commit one step; the :class:`RequestOutput` of every row it ran.

        ``engine.step_times`` then holds the step's host seconds by phase: schedule, prepare (the
        input tensors), forward (the model step, eager or replayed), sample, update (commit, drafts),
        outputs (counters and the RequestOutput objects); ``total``: the whole call."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        results = self._execute(out)
        t2 = time.perf_counter()
        self._keep_hidden(out, results[0].hidden)
        outputs = self._with_drafts(out, results[0].outputs)
        r, returns = results[0], self.returns
        had = returns.before(out, self.scheduler.requests)
        done = self.scheduler.update(outputs)
        returns.after(had, self.scheduler.requests, r.logits, r.chunk_logits, out)
        t3 = time.perf_counter()
        times = {"schedule": t1 - t0, "prepare": r.prepare_s, "forward": r.forward_s, "sample": r.sample_s,
                 "update": t3 - t2}
        if self.proposer is not None:
            gone = [r for r in list(self.proposer.slots) if self.scheduler.requests[r].status != "running"]
            self.proposer.release(gone)
            for r in [r for r in self._hidden if self.scheduler.requests[r].status == "finished"]:
                del self._hidden[r]
        if out.req_ids:
            self._counts["replayed_steps" if results[0].replayed else "eager_steps"] += 1
        self._counts["last_step_bytes"] = results[0].bytes_sent
        self._counts["bytes_sent"] += results[0].bytes_sent
        self.last_step = (out, results[0].replayed)
        self._counts["pcp_steps"] += results[0].pcp_rows > 0
        if self.connector is not None:  # the worker side: a pool stores, the P/D producer stages its blocks
            self.connector.save(out, self.scheduler.requests)
            if self._hidden and self.proposer is None:  # a P/D producer's rows: its connector has staged them
                for r in [r for r in self._hidden if self.scheduler.requests[r].status == "finished"]:
                    del self._hidden[r]
        steady = had is None and not done and getattr(outputs, "one_token_per_row", False)  # a token a row
        kinds = self._kinds or None
        outs = one_token_outputs(out, outputs.tokens, self._prompts, self._token_ids, kinds) if steady else None
        if outs is None:
            outs = step_outputs(out.req_ids, self.scheduler.requests, self._prompts, self._token_ids,
                                None if had is None else returns.fields, kinds)
        t4 = time.perf_counter()
        self.step_times = {**times, "outputs": t4 - t3, "total": t4 - t0}
        return outs

    def close(self) -> None:
        """Release what the KV connector opened (a pool from a PoolSpec; idempotent)."""
        if self.connector is not None:
            self.connector.close()

    def _keep_hidden(self, out, hidden: dict | None) -> None:
        """Gather each request's final hidden rows (position order) until its next proposal; a row
        that does not continue them (a recompute after preemption) starts over, from the rows the KV
        connector handed over for the positions before it, if any (a P/D consumer's prompt blocks)."""
        if hidden is None:
            return
        for b, rid in enumerate(out.req_ids):
            rows = hidden.get(rid)
            if rows is None:
                continue
            start, held = self._hidden.get(rid, (out.context_lens[b], None))
            n = 0 if held is None else next(iter(held.values())).shape[0]
            if held is None or start + n != out.context_lens[b]:
                got = None if self.connector is None or not out.context_lens[b] else \
                    self.connector.hidden_rows(rid, out.context_lens[b])
                self._hidden[rid] = (out.context_lens[b], rows) if got is None else \
                    (got[0], {k: torch.cat([got[1][k], rows[k].reshape(rows[k].shape[0], -1)]) for k in rows})
            else:
                self._hidden[rid] = (start, {k: torch.cat([held[k], rows[k]]) for k in held})

    def _with_drafts(self, out, outputs: dict) -> dict:
        """Count verified drafts; with a drafter, attach each sampled request's next drafts."""
        for b, rid in enumerate(out.req_ids) if any(out.draft_tokens) else ():  # no drafts: nothing to count
            d = len(out.draft_tokens[b])
            if d and outputs[rid].sampled:
                self._counts["drafted_tokens"] += d
                self._counts["accepted_tokens"] += len(outputs[rid].sampled) - 1
        if self.proposer is None:
            return outputs
        reqs = self.scheduler.requests
        self.proposer.release([r for r in list(self.proposer.slots) if reqs[r].status != "running"])  # preempted
        hist = {rid: [*reqs[rid].tokens, *o.sampled] for rid, o in outputs.items()
                if o.sampled and reqs[rid].status == "running"}
        hidden = None
        if self.proposer.hidden_layers is not None:
            hidden = {rid: self._hidden.pop(rid) for rid in hist}
        drafts = self.proposer.propose(hist, hidden) if hist else {}
        return {rid: ModelOutput(o.sampled, tuple(drafts.get(rid, ()))) for rid, o in outputs.items()}

    def _execute(self, out) -> list[StepResult]:
        if self._mesh is None or len(self.runners) == 1:
            results = [r.execute(out) for r in self.runners]
        else:
            results = run_ranks(self._mesh, self._groups, lambda g: self.runners[g.rank].execute(out),
                                what="LLMEngine")
        for r, res in enumerate(results[1:], 1):
            if {k: v.sampled for k, v in res.outputs.items()} != {k: v.sampled for k, v in results[0].outputs.items()}:
                raise RuntimeError(f"DCP rank {r} sampled different tokens than rank 0; the ranks diverged")
        return results

    @property
    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        pool = {} if self.tier2 is None else {"pool_hit_tokens": self.scheduler.tier2_hit_tokens,
                                              "pool_blocks_stored": self.connector.stored_blocks}
        dp = getattr(self.runners[0], "dp_stats", None)  # every rank counts the same DP prefill steps
        if dp is not None:
            pool.update(dp_prefill_steps=dp.steps, dp_prefill_tokens=dp.tokens)
        return EngineStats(steps=s.steps, prefix_hit_tokens=s.prefix_hit_tokens, **pool,
                           prefix_query_tokens=s.prefix_query_tokens, preemptions=s.preemptions,
                           blocks_used=s.blocks_used, blocks_free=s.blocks_free, running=s.running,
                           waiting=s.waiting, **self._counts)
