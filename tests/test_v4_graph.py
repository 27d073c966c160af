"""Graph mode for DeepSeek-V4: the decode step captured whole (FULL_DECODE_ONLY, CPU torch.compile).

The step's host plan (ring slots, closing windows, entry slots, visible
entries per rank) is built before the captured region into per-token
buffers (:mod:`cpattn.v4.decode`); inside, only static-shape tensor ops.

- ``check_static`` (aot_eager, fullgraph, no recompile across contents) on a
  one-layer CSA model (window with sinks, both compressors, the indexer's
  static top-k, sparse entries; the ops' own aot_eager checks are in test_v4_ops):
  three batches of 6 rows -- different requests and tokens, every request's
  step closing a window, padding rows -- compiled once, equal to eager;
- the engine's decode loop through a :class:`~cpattn.graphs.DecodeRunner`
  with a ``torch.compile(fullgraph=True)`` backend, on a 2-layer model (CSA
  and HCA: every code path of the three kinds): 3 requests verifying
  1 + 1 rows each (6 tokens) replayed at capture size 8 (2 padding rows)
  every step, one compile in all, the tokens of eager plain greedy decoding
  and its logits within 1e-5 (the captured MoE sums every expert densely).
  Padding rows are inert: their request is -1 and every slot -1 (the
  layer-level bit-for-bit check is in test_v4_decode).
"""

from __future__ import annotations

import pytest
import torch

from cpattn.comm.sim import SimMesh
from cpattn.engine import Algorithms, Prompts, driver
from cpattn.engine.decode import decode, make_runner
from cpattn.drafters.ngram import NgramDrafter
from cpattn.graphs import check_static
from cpattn.graphs.backends import CompileBackend
from cpattn.models import deepseek_v4 as v4
from cpattn.models import generate as gen
from near_tie import check_tokens

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
CFG = v4.DeepseekV4Config.tiny(num_hidden_layers=2, layer_types=("csa", "hca"), mlp_layer_types=("hash_moe", "moe"),
                               hc_sinkhorn_iters=3)
CSA_ONLY = v4.DeepseekV4Config.tiny(num_hidden_layers=1, layer_types=("csa",), mlp_layer_types=("moe",),
                                    hc_sinkhorn_iters=3)
# 6, 38, 14 tokens: a 2-row step closes a CSA window in every request (positions 7, 39, 15) and an HCA one in the last
PROMPTS = [[3, 9, 4, 1, 7, 2], [(5 * i + 2) % 64 for i in range(38)], [(7 * i + 1) % 64 for i in range(14)]]


def prefilled(cfg, steps: int, k: int):
    """One rank's params, prompts, decode config and a decode cache holding the prompts."""
    params = v4.init_params(cfg, seed=1, std=0.2)
    g, p = SimMesh(1).groups()[0], Prompts.of(PROMPTS)
    _, dec = driver.engine_configs(v4.FAMILY, cfg, num_speculative_tokens=k)
    out = driver.prefill_fn(g, v4.FAMILY, params, cfg, p, Algorithms(), False)
    cache = driver.new_shard(v4.FAMILY, cfg, params, p, steps, dec, NgramDrafter() if k else None, g)
    v4.FAMILY.stages.handoff(g, cache, out)
    return g, params, p, cache, out.first_logits.argmax(-1)


def test_decode_step_passes_check_static():
    g, params, _, cache, _ = prefilled(CSA_ONLY, 8, 1)
    prog = v4.FAMILY.stages.decode_program(g, params, CSA_ONLY, cache)
    gen_ = torch.Generator().manual_seed(0)

    def batch(requests, lens):  # 2 rows per request, padded to 6 rows as a capture size would be
        b = prog.batch(requests, lens, torch.randint(0, CFG.vocab_size, (2 * len(requests),), generator=gen_))
        t = b["tokens"].shape[0]
        out = {n: torch.cat([b[n], torch.full((6 - t, *f.shape), f.pad, dtype=f.dtype)]) for n, f in
               prog.fields.items()}
        out["cu_seqlens_q"] = torch.tensor([0, 2, 4, 6][: len(requests) + 1] + [t] * (3 - len(requests)),
                                           dtype=torch.int32)
        return out

    # each batch runs on a fresh copy of the prefilled cache: steps right after the prompts
    batches = [batch([0, 1, 2], [6, 38, 14]), batch([0, 2], [6, 14]), batch([1], [38])]
    outs = check_static(prog.step, prog.state, batches, compiler="aot_eager", atol=1e-5, rtol=1e-5)
    for o, rows in zip(outs, (6, 4, 2)):
        assert torch.isfinite(o[0][:rows]).all()


def test_decode_runner_replays_the_captured_step():
    steps, k = 10, 1
    g, params, p, cache, first = prefilled(CFG, steps, k)
    backend = CompileBackend("eager", name="dynamo")  # torch.compile(fullgraph=True, dynamic=False)
    runner = make_runner(g, v4.FAMILY, params, CFG, cache, num_speculative_tokens=k, max_requests=3,
                         capture_sizes=[8], backend=backend)
    res = decode(g, v4.FAMILY, params, CFG, cache, p.lists(), first, steps, drafter=NgramDrafter(max_ngram=2),
                 num_speculative_tokens=k, runner=runner)
    eager = gen.generate(v4, params, CFG, PROMPTS, steps + 1)
    flips: list = []  # float32, padded rows: equal up to a near tie (DESIGN.md §5), at most one
    for b in range(len(PROMPTS)):
        check_tokens(res.tokens[b], res.logits[b], eager.tokens[b, 1:], eager.logits[b, 1:], f"request {b}", flips,
                     rel=1e-5)
    assert len(flips) <= 1, flips
    assert runner.stats.graph == res.stats.steps and runner.stats.eager == 0
    assert runner.stats.padded_tokens == 2 * res.stats.steps and backend.compiles == 1
