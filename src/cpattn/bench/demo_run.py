"""What ``cpattn demo`` runs (see :mod:`cpattn.bench.demo`): the one-device reference, and the parallel run per rank.

:func:`reference` is the one-device run (in the parent process, before any
rank starts); :func:`demo_rank` the parallel run on one rank: the step loop
(:func:`cpattn.engine.run_rank`, timed by its hooks, :mod:`cpattn.bench.demo_loop`):
the whole batch prefilled in step 0 (TTFT), then decode steps captured
(FULL_DECODE_ONLY) and eager side by side; :func:`pool_rank` the KV-pool
phase (a cold request that stores its blocks, then a warm one sharing its
prefix).

Example
-------
>>> spec = Spec(prompt_len=16, batch=2)
>>> spec.prompt_lens, spec.world_size
([16, 12], 2)
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from cpattn.bench.demo_pool import POOL_NEW_TOKENS, pool_rank, pool_requests, shareable_blocks
from cpattn.bench.demo_setup import (EMBEDDED_STD, Spec, engine_configs, flat, graph_backend, load_model,
                                     model_config, prompts)
from cpattn.comm.group import Group
from cpattn.engine import driver
from cpattn.engine.reference import Reference, reference_generate
from cpattn.models.family import ModelFamily

# the run's parts live beside it (demo_setup, demo_pool); their names stay importable from here
__all__ = ["EMBEDDED_STD", "POOL_NEW_TOKENS", "Spec", "demo_rank", "engine_configs", "flat", "graph_backend",
           "load_model", "model_config", "one_device", "pool_rank", "pool_requests", "prompts", "reference",
           "shareable_blocks", "through_step_loop"]


# -- the one-device reference (parent process) ----------------------------------------------------


def one_device(family: ModelFamily, params: dict, cfg: Any, ps, max_new_tokens: int) -> Reference:
    """The one-device greedy run: the engine's dense-cache reference
    (:func:`~cpattn.engine.reference.reference_generate`), or, for a family whose cache is not per-token rows
    (its cache backend keeps DeepSeek-V4's rings and compressed entries), its own stages on one rank, eager
    (:func:`cpattn.engine.driver.generate`, checked against Hugging Face in tests/test_v4_engine.py)."""
    if family.backend.per_token_kv:
        return reference_generate(family, params, cfg, ps, max_new_tokens)
    pre, dec = driver.engine_configs(family, cfg)
    gen = driver.generate(family, params, cfg, [list(map(int, p)) for p in ps], max_new_tokens, prefill=pre,
                          decode=dec, prompt_logits=False)
    f = gen.facts
    return Reference(gen.tokens, gen.logits, torch.zeros(0), f.prefill_s, list(f.step_s), f.kv_bytes)


def reference(spec: Spec) -> dict:
    """The single-device greedy run every parallel run must reproduce: tokens [B, N], logits [B, N, V],
    TTFT (median of ``spec.reps`` prefills), TPOT (median step), KV bytes; and, with a KV pool, the
    tokens of every pool-phase request (:func:`pool_requests`)."""
    family, cfg, params = load_model(spec)
    tokens, cu = prompts(spec, cfg.vocab_size)
    ps = [tokens[a:b] for a, b in zip(cu, cu[1:])]
    one_device(family, params, cfg, [list(range(8))], 2)  # warm-up
    ttft = statistics.median(one_device(family, params, cfg, ps, 1).prefill_s for _ in range(spec.reps))
    ref = one_device(family, params, cfg, ps, spec.max_new_tokens)
    out = {"tokens": ref.tokens, "logits": ref.logits, "ttft_s": ttft,
           "tpot_s": statistics.median(ref.step_s) if ref.step_s else float("nan"), "kv_bytes": ref.kv_bytes}
    if spec.kv_pool is not None:
        reqs = pool_requests(spec, cfg.vocab_size)
        out["pool_tokens"] = {name: [one_device(family, params, cfg, [p], POOL_NEW_TOKENS).tokens for p in r]
                              for name, r in reqs.items() if name != "warm-up"}
    return out


# -- one rank of the parallel run --------------------------------------------------------------------


def through_step_loop(spec: Spec) -> bool:
    """Deprecated: every layout now runs through :func:`cpattn.engine.run_rank` (``--pcp W --dcp 1`` too).

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     through_step_loop(Spec(dcp=1))
    True
    """
    import warnings

    warnings.warn("cpattn.bench.demo_run.through_step_loop is deprecated: every demo layout runs through "
                  "cpattn.engine.run_rank (cpattn.bench.demo_loop.loop_rank)", DeprecationWarning, stacklevel=2)
    return True


def demo_rank(group: Group, spec: Spec) -> dict:
    """The parallel run on one rank of ``group`` (``spec.world_size`` ranks); every rank returns the full result:
    :func:`cpattn.bench.demo_loop.loop_rank` (the step loop, every layout)."""
    from cpattn.bench.demo_loop import loop_rank

    return loop_rank(group, spec)
