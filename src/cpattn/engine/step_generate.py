"""A fixed batch through the step loop: every prompt submitted at step 0, stepped until all finish.

:func:`step_generate` takes :func:`cpattn.engine.driver.generate`'s arguments (the two engine configs of a
run) and returns its :class:`~cpattn.engine.result.Generation`, built from the step loop's
:class:`~cpattn.engine.outputs.RequestOutput` s (``return_logits`` / ``return_prompt_logits``,
:mod:`cpattn.engine.returns`) instead of the prefill -> hand-off -> decode composition:

- colocated: one :class:`~cpattn.engine.llm.LLMEngine` of ``max(pcp_size, dcp_size)`` ranks, its prompt
  chunks under PCP when ``pcp_size > 1`` (over the DCP group's first ``pcp_size`` ranks, or, with ``pcp_size >
  dcp_size``, over all ranks with the cache and the decodes on the first ``dcp_size``: ``runner_wide``);
- P/D (a ``kv_consumer`` decode config): :class:`~cpattn.engine.pd_engine.PDEngine` with the P/D
  connector (whole blocks producer rank to consumer rank).

The scheduler is set so the batch is the driver's: every prompt admitted and prefilled in step 0 (budget
= all prompt tokens, ``max_num_seqs = B``), prefix caching off (each prompt computed whole, so its prompt
logits are every position's). Greedy, so the tokens are the driver's, one-device's; logits agree to the
last bits (float64 runs: ~1e-12). With k drafts the requests ask for k tokens more and are stopped (aborted,
outputs cut) once they have N: so every decode step verifies k drafts per row, as the driver does (the
scheduler would cut a request's last drafts at its ``max_tokens``), and the counters match the driver's;
the drafter then also proposes once after a request's last step (drafts never verified).

What the step loop cannot give the same way (:class:`~cpattn.engine.result.RunFacts`): ``handoff`` is
empty in one engine (a PCP chunk's rows go to their DCP owners inside the step), ``prefill_s`` / ``ttft_s``
are step 0's time, ``step_s`` the later steps', ``bytes_sent`` ``{"prefill": step 0, "decode": the rest}``
(DCP rank 0); ``stats`` (:class:`~cpattn.engine.decode.SpecStats`) carries steps, drafted, accepted,
graph_steps, emitted, rows and accepted_hist as the driver counts them; its ``draft_digest`` hashes the
step loop's drafts, so it differs from the driver's.

Example
-------
>>> from cpattn.engine.driver import engine_configs
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> pre, dec = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2, block_size=4)
>>> g = step_generate("qwen3", qwen3.init_params(cfg), cfg, [[1, 2, 3], [4, 5]], 3, prefill=pre, decode=dec)
>>> g.tokens.shape, g.logits.shape[:2], g.prompt_logits.shape[0]
(torch.Size([2, 3]), torch.Size([2, 3]), 5)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import torch

from cpattn.config import EngineConfig, GuideCompatWarning, SchedulerConfig
from cpattn.engine.connector_pd import PDConnector
from cpattn.engine.decode import SpecStats
from cpattn.engine.llm import LLMEngine
from cpattn.engine.options import Algorithms
from cpattn.engine.pd_engine import PDEngine
from cpattn.engine.result import Generation, RunFacts
from cpattn.engine.sampling import SamplingParams
from cpattn.models.family import ModelFamily, get_family


def fixed_batch_scheduler(prompt_lens, max_new_tokens: int, k: int = 0, *, chunked: bool = True) -> SchedulerConfig:
    """A scheduler under which a batch runs as the driver's: all prompts prefilled in step 0, then decodes.
    ``chunked=False`` (DeepSeek-V4: a prompt, or its recompute, in one step): no chunked prefill, and the
    budget holds a whole ``max_model_len``.

    >>> fixed_batch_scheduler([3, 5], 4).max_num_batched_tokens, fixed_batch_scheduler([3, 5], 4).max_num_seqs
    (8, 2)
    >>> fixed_batch_scheduler([3, 5], 4, chunked=False).max_num_batched_tokens
    10
    """
    b, longest = len(prompt_lens), max(prompt_lens)
    max_model_len = longest + max_new_tokens + 2 * k + 1
    budget = max(sum(prompt_lens), b * (1 + k), 0 if chunked else max_model_len)
    return SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=b, enable_prefix_caching=False,
                           enable_chunked_prefill=chunked, max_model_len=max_model_len)


def _blocks(sched: SchedulerConfig, block_size: int, ranks: int) -> int:
    return sched.max_num_seqs * -(-sched.max_model_len // (block_size * ranks)) + 1


def refusal(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, drafter=None) -> str | None:
    """Why the step loop cannot run this driver-style layout (None: it can): an engine the layout rules refuse
    (a P/D producer of P ranks is an engine of DCP P: heads % P). PCP over more ranks than the DCP group runs
    for every family (:mod:`cpattn.engine.runner_wide`; DeepSeek-V4 and hybrid runners too).

    >>> from cpattn.engine.driver import engine_configs
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config.tiny()
    >>> refusal(get_family("qwen3"), cfg, *engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)) is None
    True
    >>> refusal(get_family("qwen3"), cfg, *engine_configs("qwen3", cfg, pcp_size=2, dcp_size=4)) is None
    True
    >>> refusal(get_family("qwen3"), cfg, *engine_configs("qwen3", cfg, pcp_size=4, dcp_size=2)) is None
    True
    >>> v4 = get_family("deepseek_v4").config_class.tiny()
    >>> refusal(get_family("deepseek_v4"), v4, *engine_configs("deepseek_v4", v4, pcp_size=4, dcp_size=2)) is None
    True
    """
    p, n = prefill.parallel.pcp_size, decode.parallel.dcp_size
    pd = decode.kv_transfer.kv_role == "kv_consumer"
    k = decode.speculative.num_speculative_tokens if drafter is not None else 0
    bs = decode.cache.block_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuideCompatWarning)
        return _refused_configs(family, cfg, p, n, pd, k, bs, decode, drafter)


def _refused_configs(family, cfg, p, n, pd, k, bs, decode, drafter) -> str | None:
    from cpattn.config import ConfigError
    from cpattn.engine.driver import engine_configs

    try:
        for size, pcp in ((p, p), (n, 1)) if pd else ((n, p),):
            engine_configs(family, cfg, dcp_size=size, pcp_size=pcp, one_engine=pcp > 1, block_size=bs,
                           interleave_size=bs if pd else decode.cache.cp_kv_cache_interleave_size,
                           num_speculative_tokens=k, speculative_method=getattr(drafter, "method", None))
    except (ConfigError, ValueError) as e:
        return f"the step loop's engine is refused: {str(e).splitlines()[0]}"
    return None


def speculative_k(decode: EngineConfig, drafter=None) -> int:
    """Drafts verified per decode row: the decode config's k with a drafter, else 0."""
    return decode.speculative.num_speculative_tokens if drafter is not None else 0


def batch_scheduler(family: ModelFamily, prompt_lens, max_new_tokens: int, k: int = 0, *,
                    pd: bool = False) -> SchedulerConfig:
    """:func:`fixed_batch_scheduler` for ``family`` (DeepSeek-V4: unchunked); ``pd``: prefix caching back on,
    as the pool tier of the prefix cache carries a P/D hand-off (not for V4 and hybrid models).

    >>> batch_scheduler(get_family("qwen3"), [3, 5], 4, pd=True).enable_prefix_caching
    True
    """
    sched = fixed_batch_scheduler(prompt_lens, max_new_tokens, k, chunked=family.cache != "v4")
    if pd:
        sched = dataclasses.replace(sched, enable_prefix_caching=family.cache not in ("v4", "hybrid"))
    return sched


def build_engine(family: ModelFamily, params: dict, cfg: Any, prompt_lens, max_new_tokens: int, *,
                 prefill: EngineConfig, decode: EngineConfig, drafter=None, prompt_logits: bool = True, world=None,
                 algorithms: Algorithms | None = None):
    """The step-loop engine of a driver-style run (module docstring): an LLMEngine or a PDEngine, opted in
    to logits. ``world``: this rank's group (colocated under torchrun / a simulated world), else simulated.
    ``algorithms``: every engine's (:class:`~cpattn.engine.llm.LLMEngine`; None: the runners' own choices)."""
    p, n = prefill.parallel.pcp_size, decode.parallel.dcp_size
    k = speculative_k(decode, drafter)
    pd = decode.kv_transfer.kv_role == "kv_consumer"
    sched = batch_scheduler(family, prompt_lens, max_new_tokens, k, pd=pd)
    bs = decode.cache.block_size
    comp = decode.compilation
    if pd:  # the pool tier of the prefix cache carries the blocks
        return PDEngine(family, params, cfg, pcp_size=p, dcp_size=n, block_size=bs, kv_connector=PDConnector(),
                        drafter=drafter, num_speculative_tokens=k, scheduler=sched,
                        num_blocks=_blocks(sched, bs, 1), graph_mode=comp.graph_mode, graph_backend=comp.graph_backend,
                        capture_sizes=comp.capture_sizes, return_logits=True,
                        return_prompt_logits=prompt_logits, algorithms=algorithms)
    with warnings.catch_warnings():  # PCP + DCP in one engine: the driver's pair checked the guide's rules
        warnings.simplefilter("ignore", GuideCompatWarning)
        return LLMEngine(family, params, cfg, world=world, dcp_size=n, pcp_size=p, block_size=bs,
                         interleave_size=decode.cache.cp_kv_cache_interleave_size, graph_mode=comp.graph_mode,
                         graph_backend=comp.graph_backend, capture_sizes=comp.capture_sizes, scheduler=sched,
                         num_blocks=_blocks(sched, bs, n), drafter=drafter, num_speculative_tokens=k,
                         return_logits=True, return_prompt_logits=prompt_logits, algorithms=algorithms)


def run_batch(engine, prompts, max_new_tokens: int, k: int = 0) -> tuple[list, RunFacts, SpecStats]:
    """Submit every prompt at step 0, step until each has ``max_new_tokens``: (final outputs in prompt order,
    RunFacts, SpecStats). With k drafts per step the requests ask for k more tokens and are stopped (aborted)
    once they have ``max_new_tokens``, their outputs cut there: so every decode step verifies k drafts per
    row, as the driver's decode does (a request's own ``max_tokens`` would cut its last drafts short)."""
    params = SamplingParams(max_tokens=max_new_tokens + k)
    ids = [engine.add_request(list(p), params) for p in prompts]
    main = getattr(engine, "decode", engine)  # PDEngine: the consumer's counters
    latest, times, sent = {}, [], []
    spec = SpecCount(k)
    while engine.has_unfinished():
        spec.before(main)
        t0 = time.perf_counter()
        keep_latest(engine, engine.step(), latest, max_new_tokens)
        times.append(time.perf_counter() - t0)
        sent.append(main.stats.bytes_sent)
        spec.after(main)  # a PDEngine step may not step the consumer: then nothing is counted
    facts = RunFacts(ttft_s=times[0] if times else 0.0, prefill_s=times[0] if times else 0.0, step_s=tuple(times[1:]),
                     bytes_sent={"prefill": sent[0] if sent else 0, "decode": (sent[-1] - sent[0]) if sent else 0},
                     **runner_facts(main))
    outs = [_cut(latest[i], max_new_tokens) for i in ids]
    return outs, facts, spec.stats(main)


def keep_latest(engine, outs, latest: dict, n: int) -> None:
    """Keep each of a step's outputs as its request's ``latest``; stop (abort) a request that has ``n`` tokens
    but asked for more (its k extra drafts' worth)."""
    for o in outs:
        latest[o.request_id] = o
        if not o.finished and len(o.token_ids) >= n:
            engine.abort_request(o.request_id)


def runner_facts(engine: LLMEngine) -> dict:
    """The :class:`~cpattn.engine.result.RunFacts` fields of a (decoding) engine's runner: ``kv_bytes`` (this
    rank's cache) and ``runner`` (graph mode: its capture's stats, else None)."""
    runner = engine.runners[0]
    graph = getattr(runner, "graph", None)
    return dict(kv_bytes=runner.kv_bytes(), runner=None if graph is None else graph.stats.as_dict())


class SpecCount:
    """:class:`~cpattn.engine.decode.SpecStats` of an engine's decode steps, counted as the driver counts them
    (k drafts verified per decode row): call :meth:`before` just before each step, :meth:`after` after it."""

    def __init__(self, k: int = 0) -> None:
        self.spec = dict(steps=0, rows=0, drafted=0, accepted=0, hist=[0] * (k + 1), digest=0)
        self._before, self._prev = {}, None

    def before(self, engine: LLMEngine) -> None:
        """Snapshot each running request's output length (and the engine's last step) before a step."""
        reqs = engine.scheduler.requests
        self._before = {rid: len(r.output) for rid, r in reqs.items() if r.status == "running"}
        self._prev = engine.last_step

    def after(self, engine: LLMEngine) -> None:
        """Count the step's decode rows, if the engine stepped since :meth:`before`."""
        ran = engine.last_step
        if ran is not None and ran is not self._prev:
            _count(self.spec, ran[0], self._before, engine.scheduler.requests)

    def stats(self, engine: LLMEngine) -> SpecStats:
        """The counts so far, with the engine's replayed (graph) steps."""
        s = self.spec
        return SpecStats(steps=s["steps"], rows=s["rows"], drafted=s["drafted"], accepted=s["accepted"],
                         emitted=s["rows"] + s["accepted"], graph_steps=engine.stats.replayed_steps,
                         accepted_hist=s["hist"], draft_digest=s["digest"])


def _count(spec: dict, out, before: dict, reqs) -> None:
    """Add one step's decode rows to ``spec``: drafts verified, accepted (tokens gained - 1), the histogram."""
    drafts, n = [], 0
    for b, rid in enumerate(out.req_ids):
        if out.is_prefill[b] or rid not in before:
            continue
        d, gained = len(out.draft_tokens[b]), len(reqs[rid].output) - before[rid]
        a = max(0, gained - 1)
        n += 1
        spec["drafted"] += d
        spec["accepted"] += a
        spec["hist"][min(a, len(spec["hist"]) - 1)] += 1
        drafts.extend(out.draft_tokens[b])
    if n:
        spec["steps"] += 1
        spec["rows"] += n
        spec["digest"] = hash((spec["digest"], tuple(drafts)))


def _cut(o, n: int):
    """A request's output with its first ``n`` tokens (and their logits rows)."""
    if len(o.token_ids) == n:
        return o
    return dataclasses.replace(o, token_ids=o.token_ids[:n], logits=None if o.logits is None else o.logits[:n],
                               finished=True, finish_reason="length")


def generation(outs, facts: RunFacts, stats: SpecStats) -> Generation:
    """The driver's :class:`~cpattn.engine.result.Generation` from final RequestOutputs (prompt order):
    tokens [B, N], logits [B, N, V], prompt_logits [T, V] (None when any is missing)."""
    tokens = torch.tensor([list(o.token_ids) for o in outs], dtype=torch.int64)
    logits = torch.stack([o.logits for o in outs])
    prompt = None if any(o.prompt_logits is None for o in outs) else torch.cat([o.prompt_logits for o in outs])
    return Generation(tokens, logits, prompt, stats, facts)


def step_generate(model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                  prefill: EngineConfig, decode: EngineConfig, algorithms: Algorithms | None = None, drafter=None,
                  prompt_logits: bool = True, world=None) -> Generation:
    """:func:`cpattn.engine.driver.generate` through the step loop (module docstring): B prompts,
    ``max_new_tokens`` greedy tokens each; returns tokens [B, N], logits [B, N, V], prompt_logits [T, V]
    (None with ``prompt_logits=False``), stats, facts.
    ``algorithms``: every engine runs exactly these (:class:`~cpattn.engine.llm.LLMEngine`: the PCP method, DSA
    split, hand-off of the PCP rows to their DCP owners, DCP merge); None: the step loop's own (``pcp_method`` auto).
    ``world``: run on this rank's group (every rank calls it; colocated only)."""
    family = get_family(model)
    lens = [len(p) for p in prompts]
    engine = build_engine(family, params, cfg, lens, max_new_tokens, prefill=prefill, decode=decode, drafter=drafter,
                          prompt_logits=prompt_logits, world=world, algorithms=algorithms)
    try:
        outs, facts, stats = run_batch(engine, prompts, max_new_tokens, speculative_k(decode, drafter))
    finally:
        engine.close()
    return generation(outs, facts, stats)
