"""Prefill chunks under PCP that attend a cached context: the all-gather method's one causal call per part
(context and chunk together) equals the ring with separate context partials; the step loop keeps each
continuing prefill's context on every rank instead of gathering it from the DCP shards again, and falls
back to the gather when the kept rows are not the context (a preemption)."""

import pytest
import torch

import cpattn
from cpattn import pcp_plan, pcp_shard
from cpattn.config import SchedulerConfig
from cpattn.engine import runner_pcp
from cpattn.engine.kv_rows import pack_rows
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.prefill_steps import PCPStep, Prefix
from cpattn.layout.rows import cu_seqlens
from cpattn.models import qwen3
from cpattn.models.family import KVLayout


@pytest.mark.parametrize("lay", [KVLayout(2, 16, 16), KVLayout(1, 24, 16, values_in_keys=True)])
@pytest.mark.parametrize("ctx,new,p", [((37,), (29,), 2), ((5, 0, 40), (7, 13, 3), 2), ((20, 9), (17, 30), 3),
                                       ((6,), (2,), 3)])
def test_context_in_one_call_equals_the_ring_with_context_partials(lay, ctx, new, p):
    g = torch.Generator().manual_seed(sum(ctx) + p)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    ck = randn(sum(ctx), lay.num_kv_heads, lay.head_dim)
    cv = None if lay.values_in_keys else randn(sum(ctx), lay.num_kv_heads, lay.v_head_dim)
    prefix = Prefix(pack_rows((lay,), [ck], [cv], [None]), ctx)
    q, k = randn(sum(new), 4, lay.head_dim), randn(sum(new), lay.num_kv_heads, lay.head_dim)
    v = None if lay.values_in_keys else randn(sum(new), lay.num_kv_heads, lay.v_head_dim)
    plan = pcp_plan(cu_seqlens(new), p, context_lens=list(ctx))

    def run(method):
        def rank(grp):
            def mine(x):
                return None if x is None else pcp_shard(x, plan, grp.rank)
            return PCPStep(grp, plan, (lay,), prefix=prefix, method=method)(0, mine(q), mine(k), mine(v), 0.3)
        return cpattn.pcp_unshard(cpattn.simulate(p, rank), plan)

    ring, fused = run("ring"), run("allgather")
    assert fused.shape == (sum(new), 4, lay.v_head_dim)
    torch.testing.assert_close(fused, ring, rtol=0, atol=1e-12)


def _engine(budget: int, num_blocks: int):
    cfg = qwen3.Qwen3Config.tiny()
    params = qwen3.init_params(cfg, seed=3, dtype=torch.float64)
    eng = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=num_blocks, poison=True,
                    scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=2,
                                              enable_prefix_caching=False))
    return cfg, params, eng


def test_continuing_chunks_attend_their_kept_context_not_a_gather(one_device, monkeypatch):
    """A 90-token prompt in 20-token chunks under PCP 2 + DCP 2 (NaN-poisoned fresh blocks): one-device greedy
    tokens, and only chunks without a kept context gather it (none here: each chunk continues the last)."""
    calls = []
    real = runner_pcp.cached_rows
    monkeypatch.setattr(runner_pcp, "cached_rows", lambda g, s, ctx, *n: calls.append(ctx) or real(g, s, ctx, *n))
    cfg, params, eng = _engine(budget=20, num_blocks=32)
    prompt = [(7 * j + 3) % cfg.vocab_size for j in range(90)]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=3))
    while eng.has_unfinished():
        eng.step()
    want = one_device.tokens("qwen3", params, cfg, prompt, 3)  # a fresh one-device full prefill per token
    assert list(eng.scheduler.requests[rid].output) == want
    assert eng.stats.pcp_steps == 5 and [c for c in calls if any(c)] == []
    assert all(not r.pcp_context for r in eng.runners)  # nothing kept once the prefill completed


def test_a_preempted_prefill_gathers_its_context_again(one_device, monkeypatch):
    """Two long prompts on a pool too small for both: the later one is preempted mid-prefill and recomputes;
    its chunks after the recompute attend the context gathered from the shards or kept anew, never the rows
    kept before the preemption -- tokens stay one-device greedy."""
    calls = []
    real = runner_pcp.cached_rows
    monkeypatch.setattr(runner_pcp, "cached_rows", lambda g, s, ctx, *n: calls.append(ctx) or real(g, s, ctx, *n))
    cfg, params, eng = _engine(budget=24, num_blocks=14)
    prompts = [[(5 * j + i) % cfg.vocab_size for j in range(60)] for i in (1, 2)]
    ids = [eng.add_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.preemptions >= 1
    for rid, p in zip(ids, prompts):
        assert list(eng.scheduler.requests[rid].output) == \
            one_device.tokens("qwen3", params, cfg, p, 4)
