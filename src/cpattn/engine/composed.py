"""The fixed-batch composition of :func:`cpattn.engine.driver.generate`: a prefill mesh, the hand-off, a decode mesh.

:func:`~cpattn.engine.driver.generate` runs through the step loop where it can
(:mod:`cpattn.engine.step_generate`; every family with PCP over more ranks than the decode's, P > N,
too: :mod:`cpattn.engine.runner_wide`); :func:`composed` runs the rest -- engines the layout rules refuse
(:func:`~cpattn.engine.step_generate.refusal`, e.g. a P/D producer whose size does not divide the heads) --
and is what
tests/test_step_generate.py compares the step loop with: P simulated ranks prefill, the KV travels in
memory (rows, or whole blocks for a P/D consumer: :func:`_simulated_pd`, the torch.distributed run's own
per-rank code), N simulated ranks decode.

>>> from cpattn.engine.batch import Prompts
>>> from cpattn.engine.driver import engine_configs
>>> from cpattn.models import qwen3
>>> from cpattn.models.family import get_family
>>> cfg = qwen3.Qwen3Config.tiny()
>>> pre, dec = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=4)
>>> composed(get_family("qwen3"), qwen3.init_params(cfg), cfg, Prompts.of([[1, 2, 3]]), 3, prefill=pre,
...          decode=dec).tokens.shape
torch.Size([1, 3])
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from cpattn.comm.sim import simulate
from cpattn.config import EngineConfig
from cpattn.engine.batch import Prompts
from cpattn.engine.decode_stage import drafter_hidden, hidden_layers, new_shard, run_decode
from cpattn.engine.driver import _disaggregated, _generation, prefill_fn
from cpattn.engine.options import Algorithms
from cpattn.engine.result import Generation, RunFacts
from cpattn.models.family import ModelFamily


def composed(family: ModelFamily, params: dict, cfg: Any, p: Prompts, max_new_tokens: int, *, prefill: EngineConfig,
             decode: EngineConfig, algorithms: Algorithms = Algorithms(), drafter=None,
             prompt_logits: bool = True) -> Generation:
    """:func:`generate`'s fixed-batch composition (prefill mesh -> hand-off -> decode mesh), for the runs the
    step loop cannot take yet and as the step loop's comparison; ``p``: checked :class:`Prompts`."""
    pcp_size, dcp_size = prefill.parallel.pcp_size, decode.parallel.dcp_size
    steps = max_new_tokens - 1
    if decode.kv_transfer.kv_role == "kv_consumer":
        return _simulated_pd(family, params, cfg, p, max_new_tokens, prefill, decode, algorithms, drafter,
                             prompt_logits)

    backend = family.backend

    def prefill_rank(g):
        out = prefill_fn(g, family, params, cfg, p, algorithms, prompt_logits, None, hidden_layers(drafter))
        return out, backend.collect(g, out), g.stats.total_sent()  # the hand-off payload, the same on every rank

    t0 = time.perf_counter()
    out, collected, sent = simulate(pcp_size, prefill_rank)[0]
    prefill_s = time.perf_counter() - t0

    def decode_rank(g):
        shard = new_shard(family, cfg, params, p, steps, decode, drafter, g)
        backend.place(shard, collected, g)
        dec = run_decode(g, family, params, cfg, shard, p, out.first_logits.argmax(-1), steps, decode, algorithms,
                         drafter, None, prompt_hidden=drafter_hidden(out, p))
        run = RunFacts(prefill_s=prefill_s, step_s=tuple(dec.step_s), bytes_sent={"prefill": sent,
                       "decode": g.stats.total_sent()}, kv_bytes=shard.kv_bytes(), runner=dec.runner)
        return _generation(out.first_logits, dec, out.prompt_logits, run)

    gens = simulate(dcp_size, decode_rank)
    for r, g in enumerate(gens[1:], 1):
        if not torch.equal(g.tokens, gens[0].tokens):
            raise RuntimeError(f"DCP rank {r} generated different tokens than rank 0; the ranks diverged")
        if g.stats.draft_digest != gens[0].stats.draft_digest:
            raise RuntimeError(f"DCP rank {r} drafted differently from rank 0; the replicated drafters diverged")
    return gens[0]


def _simulated_pd(family, params, cfg, p: Prompts, max_new_tokens, prefill, decode, algorithms, drafter,
                  prompt_logits) -> Generation:
    """P/D on a simulated world of P + N ranks, the per-rank code of a torch.distributed run; decode rank 0's
    Generation with prefill rank 0's prompt logits and prefill time. The prefill ranks wait for the decode
    in the final all-reduce, so a rank may wait longer than the default 120 s on a slow decode."""
    pcp_size = prefill.parallel.pcp_size
    gens = simulate(pcp_size + decode.parallel.dcp_size, _disaggregated, family, params, cfg, p, max_new_tokens,
                    prefill, decode, algorithms, drafter, None, prompt_logits, timeout_s=1800.0)
    first, dec = gens[0], gens[pcp_size]
    for r, g in enumerate(gens[pcp_size + 1:], 1):
        if g.stats.draft_digest != dec.stats.draft_digest:
            raise RuntimeError(f"DCP rank {r} drafted differently from rank 0; the replicated drafters diverged")
    facts = dataclasses.replace(dec.facts, prefill_s=first.facts.prefill_s,
                                bytes_sent={**first.facts.bytes_sent, **dec.facts.bytes_sent})
    return Generation(dec.tokens, dec.logits, first.prompt_logits, dec.stats, facts)
