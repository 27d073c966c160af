"""Elastic CP in the step loop: chunks of at least ``pcp_min_tokens`` new tokens (or whose context makes their
attention as large: :func:`cpattn.engine.elastic.runs_pcp`) run PCP, shorter ones DCP
attention with the decodes; tokens stay one-device greedy (tests/test_engine_loop.py's oracle) either way."""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import run_schedule
from ref.greedy import ONE_DEVICE
from test_engine_loop import expected, model

from cpattn.config import SchedulerConfig
from cpattn.engine.elastic import NEVER, pcp_min_tokens
from cpattn.engine.llm import LLMEngine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine


def schedule(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [dict(prompt=toks(30), max_tokens=4, arrive=0), dict(prompt=toks(3), max_tokens=5, arrive=0),
            dict(prompt=toks(5), max_tokens=3, arrive=4), dict(prompt=toks(21), max_tokens=3, arrive=5)]


def engine(family, policy, min_tokens=None, budget=16):
    cfg, params = model(family)
    return LLMEngine(family, params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=40, poison=True,
                     pcp_policy=policy, pcp_min_tokens=min_tokens,
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4))


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v32"])
def test_short_chunks_skip_pcp_and_tokens_stay_exact(family):
    cfg, _ = model(family)
    reqs = schedule(cfg.vocab_size)
    runs = {}
    for policy, min_tokens in (("always", None), ("elastic", 8)):
        e = engine(family, policy, min_tokens)
        ids, steps = run_schedule(e, reqs)
        assert {i: list(e.scheduler.requests[r].output) for i, r in ids.items()} == \
               {i: expected(ONE_DEVICE, family, r) for i, r in enumerate(reqs)}
        chunks = [[(q, c) for q, c, p in zip(o.query_lens, o.context_lens, o.is_prefill) if p] for o, _ in steps]
        runs[policy] = (e.stats.pcp_steps, chunks)
    always, chunks = runs["always"]
    assert always == sum(bool(c) for c in chunks)  # every step with a chunk ran PCP
    elastic, chunks = runs["elastic"]
    # only steps with a long chunk: 8 new tokens, or as many query-key pairs as a fresh 8-token chunk
    assert elastic == sum(any(q >= 8 or q * (2 * c + q) >= 64 for q, c in s) for s in chunks)
    assert any(q < 8 and q * (2 * c + q) >= 64 for s in chunks for q, c in s)  # a long prompt's short last chunk
    assert 0 < elastic < sum(bool(c) for c in chunks)


def test_never_runs_every_chunk_with_dcp_attention():
    cfg, _ = model("qwen3")
    e = engine("qwen3", "elastic", NEVER)
    ids, _ = run_schedule(e, schedule(cfg.vocab_size))
    assert e.stats.pcp_steps == 0
    assert [list(e.scheduler.requests[r].output) for r in ids.values()] == \
           [expected(ONE_DEVICE, "qwen3", r) for r in schedule(cfg.vocab_size)]


def test_the_default_threshold_is_the_planners_break_even():
    from cpattn.plan.breakeven import bench_break_even
    from cpattn.plan.profiles import get_profile

    cfg, _ = model("qwen3")
    want = bench_break_even(get_profile("cpu"), heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                            head_dim=cfg.head_dim, pcp=2)
    assert pcp_min_tokens("qwen3", cfg, 2) == want
    assert engine("qwen3", "elastic").runners[0].pcp_min_tokens == want


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="pcp_policy='sometimes'"):
        engine("qwen3", "sometimes")
    with pytest.raises(ValueError, match="pcp_min_tokens: saw -1"):
        engine("qwen3", "elastic", -1)
    with pytest.raises(ValueError, match="pass pcp_policy='elastic'"):
        engine("qwen3", "always", 5)
