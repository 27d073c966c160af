"""The step loop's opt-in logits (``return_logits`` / ``return_prompt_logits``) against the one-device reference.

Oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone (float64 weights, a fresh
one-device full prefill per token, no step loop or engine code): its ``logits`` [N, V] per output token and
``prompt_logits`` rows of the request. The step loop's rows come from chunked prefill (DCP attention, or PCP
with the cached context), a mixed batch, preemption and recompute, drafts; float64, so they must agree to ~1e-9
and the tokens exactly. The fixed-batch driver's rows (:func:`cpattn.engine.generate`) are the second
comparison (two engine paths agreeing).
"""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import tiny_float64
from ref.greedy import ONE_DEVICE

from cpattn.config import SchedulerConfig
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import PDEngine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
N = 5
TOL = dict(rtol=1e-9, atol=1e-9)


def model(family: str):
    return tiny_float64(family, seed=1)


def prompts(vocab: int, lens=(11, 3, 17), seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def check(family: str, outs, batch, n: int = N, prompt_rows: bool = True) -> None:
    """Each final output's tokens, logits [n, V] and prompt logits [P, V] equal the request alone on one device."""
    cfg, params = model(family)
    for o, p in zip(outs, batch):
        ref = ONE_DEVICE(family, params, cfg, [p], n)  # conftest.py's one_device memo
        assert list(o.token_ids) == ref.tokens[0].tolist()
        assert o.logits.dtype == torch.float64 and o.logits.shape == ref.logits[0].shape
        assert torch.allclose(o.logits, ref.logits[0], **TOL)
        if prompt_rows:
            assert o.prompt_logits.shape == ref.prompt_logits.shape
            assert torch.allclose(o.prompt_logits, ref.prompt_logits, **TOL)


@pytest.mark.parametrize("family, dcp, pcp", [
    ("qwen3", 1, 1), ("qwen3", 2, 1), ("qwen3", 2, 2),
    pytest.param("deepseek_v32", 2, 2, marks=pytest.mark.slow),  # DSA-CP chunks
    pytest.param("deepseek_v2", 2, 1, marks=pytest.mark.slow),  # MLA
])
def test_chunked_prefill_hands_back_every_row(family, dcp, pcp):
    """A budget of 8 tokens cuts the prompts into chunks (beside decodes); every prompt position's logits
    arrive, in order, and every output token's row."""
    cfg, params = model(family)
    batch = prompts(cfg.vocab_size)
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, num_blocks=32, poison=True,
                       return_logits=True, return_prompt_logits=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False))
    check(family, engine.generate(batch, SamplingParams(max_tokens=N)), batch)
    assert engine.stats.pcp_steps > 0 if pcp > 1 else engine.stats.pcp_steps == 0


def test_preemption_keeps_the_rows_computed():
    """A pool too small for three requests: the newest is preempted and recomputed; its prompt rows and output
    rows are still one-device's (the recompute's rows past the prompt are not prompt rows)."""
    cfg, params = model("qwen3")
    batch = prompts(cfg.vocab_size, (7, 9, 6), seed=5)
    engine = LLMEngine("qwen3", params, cfg, block_size=2, num_blocks=8, poison=True, return_logits=True,
                       return_prompt_logits=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3, enable_prefix_caching=False))
    check("qwen3", engine.generate(batch, SamplingParams(max_tokens=6)), batch, n=6)
    assert engine.stats.preemptions > 0


def test_a_prefix_hit_has_only_the_computed_rows(one_device):
    """With prefix caching, a prompt whose first 8 tokens are cached gets the logits of the rest only."""
    cfg, params = model("qwen3")
    a = prompts(cfg.vocab_size, (10,))[0]
    b = a[:8] + [1, 2, 3]
    engine = LLMEngine("qwen3", params, cfg, block_size=4, num_blocks=16, return_logits=True,
                       return_prompt_logits=True, scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2))
    first = engine.generate([a], SamplingParams(max_tokens=2))[0]
    second = engine.generate([b], SamplingParams(max_tokens=2))[0]
    assert engine.stats.prefix_hit_tokens == 8
    check("qwen3", [first], [a], n=2)
    ref = one_device("qwen3", params, cfg, [b], 2)
    assert second.prompt_logits.shape[0] == 3 and torch.allclose(second.prompt_logits, ref.prompt_logits[8:], **TOL)
    assert torch.allclose(second.logits, ref.logits[0], **TOL)


def test_drafts_accepted_keep_their_rows():
    """Speculative decoding (n-gram drafts, k = 2): each output token's row is the one it was verified from."""
    cfg, params = model("qwen3")
    batch = [[1, 2, 3, 1, 2, 3, 1, 2], prompts(cfg.vocab_size, (9,))[0]]
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, block_size=4, num_blocks=32, drafter=NgramDrafter(),
                       num_speculative_tokens=2, return_logits=True, return_prompt_logits=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, enable_prefix_caching=False))
    check("qwen3", engine.generate(batch, SamplingParams(max_tokens=8)), batch, n=8)
    assert engine.stats.drafted_tokens > 0


def test_off_by_default():
    """No flag: no logits on the outputs, no chunk rows from the runner (serving cost unchanged)."""
    cfg, params = model("qwen3")
    engine = LLMEngine("qwen3", params, cfg, block_size=4, num_blocks=16)
    o = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
    assert o.logits is None and o.prompt_logits is None
    assert engine.runners[0].prompt_logits is False and engine.runners[0].chunk_logits is None


def test_pd_prompt_rows_come_from_the_producer():
    """P/D (PCP 2 producer, DCP 2 consumer): the producer's prompt rows on the consumer's final outputs, the
    consumer's output rows (its recomputed first token's row included)."""
    cfg, params = model("qwen3")
    batch = prompts(cfg.vocab_size, (13, 5))
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=4, return_logits=True,
                  return_prompt_logits=True, scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2))
    check("qwen3", pd.generate(batch, SamplingParams(max_tokens=N)), batch)
    pd.close()


def test_against_the_fixed_batch_driver():
    """The same rows as :func:`cpattn.engine.generate` (PCP 2 + DCP 2 there; chunked PCP 2 + DCP 2 here)."""
    from cpattn.engine.driver import engine_configs, generate

    cfg, params = model("qwen3")
    batch = prompts(cfg.vocab_size)
    p_cfg, d_cfg = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
    fixed = generate("qwen3", params, cfg, batch, N, prefill=p_cfg, decode=d_cfg)
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=32,
                       return_logits=True, return_prompt_logits=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=3, enable_prefix_caching=False))
    outs = engine.generate(batch, SamplingParams(max_tokens=N))
    assert torch.equal(torch.tensor([o.token_ids for o in outs]), fixed.tokens)
    assert torch.allclose(torch.stack([o.logits for o in outs]), fixed.logits, **TOL)
    assert torch.allclose(torch.cat([o.prompt_logits for o in outs]), fixed.prompt_logits, **TOL)


@pytest.mark.parametrize("family, dcp, pcp", [("qwen3_next", 1, 1), ("qwen3_next", 2, 1), ("qwen3_next", 2, 2),
                                              ("qwen3_5", 2, 2)])
def test_a_hybrid_model_hands_back_every_row(one_device, family, dcp, pcp):
    """Qwen3-Next / Qwen3.5 (linear layers' states carried between chunks), chunked by a budget of 7 beside
    decodes, chunks under PCP (the scan) at pcp 2: every prompt row and output row equals the one-device greedy
    recompute of the request alone (conftest.py's ``one_device``: a fresh full prefill per token, no engine code;
    the forward's logits tests/test_qwen3_next_hf.py checks against transformers)."""
    from test_engine_loop_hybrid import model as hybrid_model, prompt

    cfg, params = hybrid_model(family)
    batch = [prompt(n, s) for n, s in ((11, 1), (3, 2), (17, 3))]
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4,
                       num_blocks=32, poison=True, return_logits=True, return_prompt_logits=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=3, enable_prefix_caching=False))
    outs = engine.generate(batch, SamplingParams(max_tokens=N))
    assert engine.stats.pcp_steps > 0 if pcp > 1 else engine.stats.pcp_steps == 0
    for o, p in zip(outs, batch):
        ref = one_device(family, params, cfg, [p], N)
        assert list(o.token_ids) == ref.tokens[0].tolist()
        assert torch.allclose(o.logits, ref.logits[0], **TOL)
        assert o.prompt_logits.shape == (len(p), cfg.vocab_size)
        assert torch.allclose(o.prompt_logits, ref.prompt_logits.reshape(-1, cfg.vocab_size)[:len(p)], **TOL)


@pytest.mark.parametrize("dcp, pcp", [(1, 1), (2, 1), (2, 2)])
def test_deepseek_v4_hands_back_every_row(one_device, dcp, pcp):
    """DeepSeek-V4 (window, CSA and HCA layers; each prompt prefilled whole, beside decodes, under PCP at pcp 2):
    every prompt row and output row equals the one-device greedy recompute of the request alone (conftest.py's
    ``one_device``: a fresh full prefill per token, no engine code); at pcp 2 a P/D pair gives the same rows (the
    producer's)."""
    from test_engine_loop_v4 import model as v4_model, prompt, sched

    cfg, params = v4_model()
    batch = [prompt(n, s) for n, s in ((5, 0), (20, 1), (9, 2))]
    engine = LLMEngine("deepseek_v4", params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, num_blocks=32,
                       return_logits=True, return_prompt_logits=True, scheduler=sched(max_num_seqs=2))
    outs = engine.generate(batch, SamplingParams(max_tokens=N))
    if pcp > 1:  # and P/D: the producer's prompt rows on the consumer's outputs (its state handed over)
        pd = PDEngine("deepseek_v4", params, cfg, pcp_size=2, dcp_size=2, block_size=4, return_logits=True,
                      return_prompt_logits=True)
        pd_outs = pd.generate(batch, SamplingParams(max_tokens=N))
        pd.close()
        for a, b in zip(pd_outs, outs):
            assert a.token_ids == b.token_ids and torch.allclose(a.prompt_logits, b.prompt_logits, **TOL)
    for o, p in zip(outs, batch):
        ref = one_device("deepseek_v4", params, cfg, [p], N)
        assert list(o.token_ids) == ref.tokens[0].tolist()
        assert torch.allclose(o.logits, ref.logits[0], **TOL)
        assert o.prompt_logits.shape == (len(p), cfg.vocab_size)
        assert torch.allclose(o.prompt_logits, ref.prompt_logits.reshape(-1, cfg.vocab_size)[:len(p)], **TOL)
