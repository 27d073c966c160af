"""The driver: prefill -> hand-off -> decode, composed once for every topology.

Two :class:`~cpattn.config.EngineConfig` describe the run: the prefill
engine (its ``pcp_size`` = P) and the decode engine (its ``dcp_size`` = N,
``tp_size = N``, block and interleave sizes, speculative decoding, graph
mode). They may be one config (one engine opting in to PCP with DCP). Both
are checked once, before any rank starts (:mod:`cpattn.engine.checks`).

Topologies (each through the step loop where it runs the layout, under any ``algorithms`` and ``on_step``, with
no ``prefix``; else through the fixed-batch composition, :func:`composed_on_rank`):

- **colocated** (:func:`generate_on_rank` on ``max(P, N)`` ranks): the step loop on that world, as
  :func:`generate` (with ``on_step`` or a KV ``pool``: :mod:`cpattn.engine.step_on_rank`); the composition
  runs a size-1 stage on every rank alone, a full-size one over the
  world, and moves rows inside it (:func:`cpattn.engine.handoff.exchange`);
- **disaggregated** (:func:`generate_on_rank` on ``P + N`` ranks; ranks ``[0, P)`` prefill, ``[P, P + N)``
  decode): the step loop's P/D (:mod:`cpattn.engine.step_on_rank`: ``run_rank(pd=True)``; the usable whole
  blocks of each prompt go producer rank to consumer rank, or through a KV pool the producer stores and the
  consumer loads); the composition's :func:`_disaggregated` sends every whole block point to point
  (``world.send`` / ``recv``), past those a pool or a whole-block ``prefix`` holds;
- **simulated** (:func:`generate`): the step loop (:mod:`cpattn.engine.step_generate`: one engine or a P/D
  pair); else (:mod:`cpattn.engine.composed`, the layouts :func:`cpattn.engine.step_generate.refusal` names)
  P simulated ranks prefill, the KV travels in memory, N simulated ranks decode; any P and N.

Every rank returns the same :class:`~cpattn.engine.result.Generation`
(tokens, the logits they came from, prompt logits, speculative counts) with
its own :class:`~cpattn.engine.result.RunFacts`.

Example
-------
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> prefill_cfg, decode_cfg = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
>>> out = generate("qwen3", qwen3.init_params(cfg), cfg, [[1, 2, 3], [4, 5]], 4, prefill=prefill_cfg, decode=decode_cfg)
>>> out.tokens.shape
torch.Size([2, 4])
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import SimMesh, simulate
from cpattn.config import EngineConfig
from cpattn.engine import checks
from cpattn.engine.batch import Prompts
from cpattn.engine.decode import DecodeOut, SpecStats
from cpattn.engine.decode_stage import drafter_hidden, hidden_layers, new_shard, run_decode
from cpattn.engine.drafters import TargetHidden, check_drafter
from cpattn.models.family import ModelFamily, get_family, param_dtype
from cpattn.engine.backends.paged import handoff, request_order  # noqa: F401 - public here, they lived here
from cpattn.engine.handoff import (  # noqa: F401 - re-exported: they were importable from here
    HandoffFacts, deal_blocks, exchange, place_blocks, place_rows, recv_blocks, recv_hidden, request_blocks,
    send_blocks, send_hidden,
)
from cpattn.engine.kv_rows import row_width  # noqa: F401 - kept importable from here
from cpattn.engine.logits import acc_dtype
from cpattn.engine.options import Algorithms
from cpattn.engine.paged_cache import PagedShard  # noqa: F401 - kept importable from here
from cpattn.engine.prefill import PrefillOut, gather_unshard, prefill  # noqa: F401 - kept importable from here
from cpattn.engine.pooling import PoolFacts, load_owned, load_prefix, open_for_run, release, store_blocks
from cpattn.engine.prefill_steps import Prefix
from cpattn.engine.result import Generation, RunFacts
from cpattn.layout.rows import cu_seqlens, request_of


def engine_configs(model: ModelFamily | str, cfg: Any, *, pcp_size: int = 1, dcp_size: int = 1, block_size: int = 4,
                   interleave_size: int = 1, num_speculative_tokens: int = 0, speculative_method: str | None = None,
                   graph_mode: str = "NONE", capture_sizes=None, graph_backend: str = "auto", pd: bool = False,
                   one_engine: bool = False) -> tuple[EngineConfig, EngineConfig]:
    """The (prefill, decode) engine configs of a run, validated by the guide's rules.

    pd: the two engines are a P/D pair (kv_producer / kv_consumer, whole
    blocks: pass ``interleave_size = block_size``). one_engine: one config
    with ``pcp_size = dcp_size`` and ``allow_pcp_with_dcp`` (returned twice).
    Speculative decoding and graph mode belong to the decode engine.

    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> p, d = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2, block_size=8, interleave_size=8, pd=True)
    >>> p.kv_transfer.kv_role, d.kv_transfer.kv_role, d.parallel.tp_size
    ('kv_producer', 'kv_consumer', 2)
    """
    family = get_family(model)
    m = family.model_config(cfg)
    common = dict(attention=m.attention, num_attention_heads=m.num_attention_heads, num_kv_heads=m.num_kv_heads,
                  tp_splits_kv_heads=False, block_size=block_size, cp_kv_cache_interleave_size=interleave_size)
    method = speculative_method or ("draft" if num_speculative_tokens else None)
    dec = dict(speculative_method=method, num_speculative_tokens=num_speculative_tokens, graph_mode=graph_mode,
               capture_sizes=capture_sizes, graph_backend=graph_backend)
    if one_engine:
        both = EngineConfig.create(tp_size=dcp_size, pcp_size=pcp_size, dcp_size=dcp_size, allow_pcp_with_dcp=True,
                                   **common, **dec)
        return both, both
    roles = ({"kv_transfer": "pd", "kv_role": "kv_producer"}, {"kv_transfer": "pd", "kv_role": "kv_consumer"}) \
        if pd else ({}, {})
    return (EngineConfig.create(pcp_size=pcp_size, **common, **roles[0]),
            EngineConfig.create(tp_size=dcp_size, dcp_size=dcp_size, **common, **dec, **roles[1]))


def _single() -> Group:
    return SimMesh(1).groups()[0]


def stage_group(world: Group, size: int) -> Group:
    """The world for a stage over every rank, this rank alone for a size-1 stage (run replicated).

    >>> stage_group(SimMesh(1).groups()[0], 1).size
    1
    """
    return world if size == world.size and size > 1 else _single()


def _generation(first_logits, dec: DecodeOut, prompt_logits, facts) -> Generation:
    first = first_logits.argmax(-1)
    tokens = torch.cat([first[:, None], dec.tokens], 1)
    logits = torch.cat([first_logits[:, None], dec.logits], 1) if dec.logits.numel() else first_logits[:, None]
    return Generation(tokens, logits, prompt_logits, dec.stats, facts)


def _prepare(model, params, cfg, prompts, max_new_tokens, prefill_cfg, decode_cfg, drafter, world_size, topology,
             pool=None):
    family = get_family(model)
    p = prompts if isinstance(prompts, Prompts) else Prompts.of(prompts, vocab_size=cfg.vocab_size)
    check_drafter(drafter, decode_cfg.speculative.num_speculative_tokens)
    check_run = getattr(family.backend, "check_run", None)  # a kind's own refusals, before any rank starts
    if check_run is not None:
        check_run(family, drafter=drafter)
    checks.check(family, cfg, prefill_cfg, decode_cfg, world_size=world_size, topology=topology, drafter=drafter,
                 max_new_tokens=max_new_tokens, pool=pool is not None)
    return family, p


def generate_on_rank(world: Group, model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                     prefill: EngineConfig, decode: EngineConfig, algorithms: Algorithms | None = None,
                     drafter=None, prompt_logits: bool = True, prefix: Prefix | None = None,
                     pool=None, on_step=None) -> Generation:
    """One rank of a run over a real (or simulated) world; call it on every rank (see module doc).

    With no ``prefix``, a run goes through the step loop where it can run the layout
    (:func:`step_loop_runs`), as :func:`generate` does (the same tokens; its engines run exactly ``algorithms``,
    None: their own choices). Colocated without a ``pool`` or ``on_step``: :func:`cpattn.engine.step_generate.step_generate` on
    ``world`` (no hand-off in its facts). P/D (with or without a ``pool`` or a drafter), colocated with a
    ``pool`` or with ``on_step`` (called with the decode steps so far after each decoding step):
    :func:`cpattn.engine.step_on_rank.step_on_rank`, :func:`cpattn.engine.run_rank.run_rank`
    over ``world`` (colocated, the pool is the prefix cache's second tier: whole spans of ``block_size * N`` tokens
    loaded at admission, every whole block computed -- decoded tokens' too -- stored, prompt logits of the computed
    positions; P/D, the producer stores, the consumer loads). The rest (a ``prefix``, a layout the step loop
    refuses) through :func:`composed_on_rank` (``algorithms`` None: ``Algorithms()``), whose arguments
    these are; a caller measuring its hand-off stage (``facts.handoff``) calls it. Checked before anything runs.
    Example (every rank of a simulated world):

    >>> import cpattn
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config.tiny()
    >>> pre, dec = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
    >>> outs = cpattn.simulate(2, generate_on_rank, "qwen3", qwen3.init_params(cfg), cfg, [[1, 2, 3]], 3,
    ...                        prefill=pre, decode=dec)
    >>> outs[0].tokens.shape, bool((outs[0].tokens == outs[1].tokens).all())
    (torch.Size([1, 3]), True)
    """
    topology = checks.topology(prefill, decode, world.size)
    pd = topology == "disaggregated"
    if prefix is None:
        family, p = _prepare(model, params, cfg, prompts, max_new_tokens, prefill, decode, drafter, world.size,
                             topology, pool)
        if step_loop_runs(family, cfg, prefill, decode, drafter):
            if pd or pool is not None or on_step is not None:  # here: the step loop imports this module
                from cpattn.engine.step_on_rank import step_on_rank

                return step_on_rank(world, family, params, cfg, p.lists(), max_new_tokens, prefill=prefill,
                                    decode=decode, drafter=drafter, prompt_logits=prompt_logits, pool=pool,
                                    algorithms=algorithms, on_step=on_step)
            from cpattn.engine.step_generate import step_generate

            return step_generate(family, params, cfg, p.lists(), max_new_tokens, prefill=prefill, decode=decode,
                                 drafter=drafter, prompt_logits=prompt_logits, world=world, algorithms=algorithms)
    return composed_on_rank(world, model, params, cfg, prompts, max_new_tokens, prefill=prefill, decode=decode,
                            algorithms=algorithms or Algorithms(), drafter=drafter, prompt_logits=prompt_logits,
                            prefix=prefix, pool=pool, on_step=on_step)


def composed_on_rank(world: Group, model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
                     prefill: EngineConfig, decode: EngineConfig, algorithms: Algorithms = Algorithms(),
                     drafter=None, prompt_logits: bool = True, prefix: Prefix | None = None,
                     pool=None, on_step=None) -> Generation:
    """One rank of the fixed-batch composition (prefill stage, hand-off, decode stage; module doc); call it on
    every rank.

    prompts: B token lists; max_new_tokens: N >= 1 greedy tokens per prompt
    (the first from the prefill). prefix: cached KV of each prompt's first
    ``prefix.context_lens[b]`` tokens, on every rank (engines on the same
    ranks); only the rest is prefilled (prompt logits then cover the rest).
    pool: a KV pool (:class:`~cpattn.engine.pooling.PoolSpec`, opened on
    every rank, or an open :class:`~cpattn.pool.KVPool`): each prompt's
    cached whole blocks become the prefix, and after the hand-off every
    decode rank stores the new whole blocks it owns. On P/D the prefill ranks
    start from the prefix (the pool's, or ``prefix`` in whole blocks), the
    decode ranks take their own blocks of it from the pool (or ``prefix``)
    and receive only the blocks after it (:func:`_disaggregated`).
    Picklable arguments only (``model`` may be the family name), so it
    serves :func:`cpattn.comm.launch.spawn` and torchrun.
    """
    topology = checks.topology(prefill, decode, world.size)
    family, p = _prepare(model, params, cfg, prompts, max_new_tokens, prefill, decode, drafter, world.size, topology,
                         pool)
    if prefix is not None and pool is not None:
        raise ValueError("pass a cached prefix or a KV pool, not both")
    if topology == "disaggregated":
        return _disaggregated(world, family, params, cfg, p, max_new_tokens, prefill, decode, algorithms, drafter,
                              on_step, prefix=prefix, pool=pool)
    steps = max_new_tokens - 1
    pcp_size, dcp_size = prefill.parallel.pcp_size, decode.parallel.dcp_size
    pg, dg = stage_group(world, pcp_size), stage_group(world, dcp_size)
    world.all_reduce(torch.zeros(1)) if world.size > 1 else None  # start together: times are from here
    sent0 = world.stats.total_sent()
    t0 = time.perf_counter()
    pool, opened = _open_pool(pool, family, cfg, params, decode)
    pfacts = PoolFacts()
    if pool is not None:
        prefix, pfacts = load_prefix(world, p, pool)
    out = prefill_fn(pg, family, params, cfg, p, algorithms, prompt_logits, prefix, hidden_layers(drafter))
    prefill_s, sent1 = time.perf_counter() - t0, world.stats.total_sent()
    shard = new_shard(family, cfg, params, p, steps, decode, drafter, dg)
    facts = handoff_stage(world, family, pg, dg, shard, out, algorithms, prefix)
    ttft = time.perf_counter() - t0
    if pool is not None and (dcp_size > 1 or world.rank == 0):  # a replicated decode cache is stored once
        stored = store_blocks(shard, p, pool, rank=dg.rank, dcp_size=dcp_size, skip=pfacts.hit_blocks)
        pfacts = dataclasses.replace(pfacts, blocks_stored=stored.blocks_stored, bytes_stored=stored.bytes_stored,
                                     store_s=stored.store_s)
    if opened:
        release(pool)
    sent2 = world.stats.total_sent()
    dec = run_decode(dg, family, params, cfg, shard, p, out.first_logits.argmax(-1), steps, decode, algorithms,
                     drafter, on_step, prompt_hidden=drafter_hidden(out, p, prefix))
    run = RunFacts(ttft_s=ttft, prefill_s=prefill_s, step_s=tuple(dec.step_s),
                   bytes_sent={"prefill": sent1 - sent0, "handoff": sent2 - sent1,
                               "decode": world.stats.total_sent() - sent2},
                   kv_bytes=shard.kv_bytes(), handoff=facts, runner=dec.runner, pool=pfacts)
    return _generation(out.first_logits, dec, out.prompt_logits, run)


def _open_pool(pool, family, cfg, params, decode_cfg: EngineConfig):  # (open pool or None, whether opened here)
    return open_for_run(pool, family, cfg, params, decode_cfg.cache.block_size)  # keyed by the weights' digest


def prefill_fn(pg: Group, family, params, cfg, p: Prompts, algorithms: Algorithms, prompt_logits: bool,
               prefix: Prefix | None = None, hidden_layers: tuple | None = None) -> PrefillOut:
    """The prefill stage as the driver calls it (a seam for timing harnesses): the family's cache backend's
    prefill; ``hidden_layers``: the hidden states a drafter reads, computed under the prefill's layout and
    gathered in request order."""
    return family.backend.prefill(pg, family, params, cfg, p, algorithms=algorithms, prompt_logits=prompt_logits,
                                  prefix=prefix, hidden_layers=hidden_layers)


def handoff_stage(world: Group, family: ModelFamily, pg: Group, dg: Group, shard, out,
                  algorithms: Algorithms = Algorithms(), prefix: Prefix | None = None) -> HandoffFacts:
    """The hand-off as :func:`generate_on_rank` runs it (engines on the same ranks): the family's cache
    backend's (:func:`handoff` for the paged cache)."""
    return family.backend.handoff(world, pg, dg, shard, out, algorithms, prefix)


def _pd_prefix(family, prefix: Prefix | None, block_size: int) -> None:
    if prefix is None:
        return
    if not family.backend.per_token_kv:
        raise ValueError(f"prefix: a cached prefix across P/D needs per-token KV rows; {family.name} keeps its own "
                         f"cache (ModelFamily.cache={family.cache!r}); run without a prefix")
    if any(c % block_size for c in prefix.context_lens):
        raise ValueError(f"prefix.context_lens={prefix.context_lens}: P/D moves whole blocks, so a cached prefix "
                         f"across P/D is whole blocks of block_size={block_size}; cut it to a multiple of {block_size}")


def _disaggregated(world, family, params, cfg, p: Prompts, max_new_tokens, prefill_cfg, decode_cfg, algorithms,
                   drafter, on_step, prompt_logits: bool = False, prefix: Prefix | None = None,
                   pool=None) -> Generation:
    """P/D: world ranks [0, P) prefill and send whole blocks point to point, [P, P + N) receive and decode.

    With a KV pool (or a whole-block ``prefix``, on every rank): the prefill ranks load every cached whole
    block of each prompt (:func:`~cpattn.engine.pooling.load_prefix`) and prefill only the rest; each decode
    rank loads the cached blocks it owns from the pool itself (:func:`~cpattn.engine.pooling.load_owned`;
    the world agrees on the counts) and receives only the blocks after them -- the prefix never crosses the
    P/D link -- then stores the new whole blocks it owns, as the colocated path does.

    Every rank returns decode rank 0's tokens and logits; prompt logits (``prompt_logits``) stay on the
    prefill ranks (None on decode ranks). A decode rank whose own tokens differ from rank 0's raises."""
    pcp_size, dcp_size = prefill_cfg.parallel.pcp_size, decode_cfg.parallel.dcp_size
    bs = decode_cfg.cache.block_size
    _pd_prefix(family, prefix, bs)
    decode_ranks = list(range(pcp_size, pcp_size + dcp_size))
    pg = world.split(list(range(pcp_size)))  # every world rank splits both groups, in the same order
    dg = world.split(decode_ranks)
    steps, vocab, backend = max_new_tokens - 1, cfg.vocab_size, family.backend
    world.all_reduce(torch.zeros(1))
    t0 = time.perf_counter()
    pool, opened = _open_pool(pool, family, cfg, params, decode_cfg)
    pfacts = PoolFacts()
    if world.rank < pcp_size:
        if pool is not None:
            prefix, pfacts = load_prefix(world, p, pool)
        if opened:
            release(pool)
        out = prefill_fn(pg, family, params, cfg, p, algorithms, prompt_logits, prefix, hidden_layers(drafter))
        prefill_s, sent0 = time.perf_counter() - t0, world.stats.total_sent()
        facts = backend.send(world, pg, out, decode_ranks, bs)  # with the first logits; only blocks past the prefix
        if out.hidden is not None and pg.rank == 0:  # the drafter's prompt hidden states go with the KV
            send_hidden(out.hidden, decode_ranks, world)
        tokens = torch.zeros(p.num_requests, max_new_tokens, dtype=torch.int64)
        # in the decode ranks' logits dtype (float64 in a float64 run): the all_reduce below pairs them
        logits = torch.zeros(p.num_requests, max_new_tokens, vocab, dtype=acc_dtype(param_dtype(params)))
        run = RunFacts(prefill_s=prefill_s, handoff=facts, role="prefill", pool=pfacts,
                       bytes_sent={"prefill": pg.stats.total_sent(), "handoff": world.stats.total_sent() - sent0})
        dec_stats, mine, plogits = None, None, out.prompt_logits
    else:
        dtype = param_dtype(params)
        shard = new_shard(family, cfg, params, p, steps, decode_cfg, drafter, dg)
        held = None  # whole blocks per request this rank's cache holds before the hand-off
        if pool is not None:
            placed, held, pfacts = load_owned(world, p, pool, rank=dg.rank, dcp_size=dcp_size)
            place_blocks(shard, placed)
        elif prefix is not None:
            ctx = prefix.context_lens
            req = request_of(cu_seqlens(ctx))  # [R] request of each prefix row
            pos = torch.cat([torch.arange(c) for c in ctx])
            place_rows(shard, prefix.rows, req, pos, rank=dg.rank, dcp_size=dcp_size)
            held = [c // bs for c in ctx]
        extra = {} if held is None else {"start": held}
        first_logits, facts = backend.recv(world, shard, p, cfg, prefill_ranks=list(range(pcp_size)), decode_group=dg,
                                           dtype=dtype, **extra)
        ctx = tuple(n * bs for n in held) if held is not None else (0,) * p.num_requests
        layers = hidden_layers(drafter)
        hidden = None
        if layers is not None:
            names = [*sorted(layers), "norm"]
            hidden = recv_hidden(names, p.cu_seqlens[-1] - sum(ctx), dtype, 0, world)
        ttft = time.perf_counter() - t0
        if pool is not None:  # decode rank d owns global blocks j % N == d: each block stored once
            stored = store_blocks(shard, p, pool, rank=dg.rank, dcp_size=dcp_size, skip=tuple(held))
            pfacts = dataclasses.replace(pfacts, blocks_stored=stored.blocks_stored,
                                         bytes_stored=stored.bytes_stored, store_s=stored.store_s)
            if opened:
                release(pool)
        dec = run_decode(dg, family, params, cfg, shard, p, first_logits.argmax(-1), steps, decode_cfg, algorithms,
                         drafter, on_step,
                         prompt_hidden=None if hidden is None else TargetHidden.packed(hidden, p.suffix(ctx).cu_seqlens,
                                                                                       list(ctx)))
        gen = _generation(first_logits, dec, None, None)
        tokens = gen.tokens if dg.rank == 0 else torch.zeros_like(gen.tokens)
        logits = gen.logits if dg.rank == 0 else torch.zeros_like(gen.logits)
        run = RunFacts(ttft_s=ttft, step_s=tuple(dec.step_s), kv_bytes=shard.kv_bytes(), handoff=facts,
                       runner=dec.runner, role="decode", pool=pfacts, bytes_sent={"decode": dg.stats.total_sent()})
        dec_stats, mine, plogits = dec.stats, gen.tokens, None
    tokens, logits = world.all_reduce(tokens), world.all_reduce(logits)  # decode rank 0's, on every rank
    if mine is not None and not torch.equal(mine, tokens):
        raise RuntimeError(f"DCP rank {dg.rank} generated different tokens than rank 0; the ranks diverged")
    return Generation(tokens, logits, plogits, dec_stats or SpecStats(), run)


def step_loop_runs(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, drafter=None) -> bool:
    """Whether :func:`generate`'s run goes through the step loop (:func:`cpattn.engine.step_generate.refusal`
    names what it cannot run yet; those runs keep the fixed-batch composition below)."""
    from cpattn.engine.step_generate import refusal  # here: it imports the step loop, which imports this module

    return refusal(family, cfg, prefill, decode, drafter) is None


def generate(model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int, *,
             prefill: EngineConfig, decode: EngineConfig, algorithms: Algorithms | None = None, drafter=None,
             prompt_logits: bool = True) -> Generation:
    """A run on simulated meshes: P ranks prefill, the KV travels in memory, N ranks decode (any P, N).

    Runs through the step loop (:func:`cpattn.engine.step_generate.step_generate`: every prompt submitted at
    step 0, drained; its engines run exactly ``algorithms``, None: their own choices) where it can
    (:func:`step_loop_runs`), else through :func:`cpattn.engine.composed.composed` (``algorithms`` None:
    ``Algorithms()``): the KV moves as request-order rows, each decode rank keeping its own tokens; a P/D
    consumer's run is :func:`composed_on_rank`'s per-rank P/D code (:func:`_disaggregated`) on one simulated
    world of P + N ranks, whole blocks point to point. Checked before any rank starts. Returns decode rank 0's
    :class:`~cpattn.engine.result.Generation` (every rank's tokens are checked equal).
    """
    pcp_size, dcp_size = prefill.parallel.pcp_size, decode.parallel.dcp_size
    family, p = _prepare(model, params, cfg, prompts, max_new_tokens, prefill, decode, drafter, pcp_size + dcp_size,
                         "simulated")
    if step_loop_runs(family, cfg, prefill, decode, drafter):
        from cpattn.engine.step_generate import step_generate  # here: it imports the step loop, which imports this

        return step_generate(family, params, cfg, p.lists(), max_new_tokens, prefill=prefill, decode=decode,
                             drafter=drafter, prompt_logits=prompt_logits, algorithms=algorithms)
    from cpattn.engine.composed import composed

    return composed(family, params, cfg, p, max_new_tokens, prefill=prefill, decode=decode,
                    algorithms=algorithms or Algorithms(), drafter=drafter, prompt_logits=prompt_logits)
