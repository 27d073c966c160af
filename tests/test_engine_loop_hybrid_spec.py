"""Speculative decoding on hybrid models (Qwen3-Next) in the step loop: drafts verified with per-position states.

A decode row of 1 + d tokens (the last token and d drafts) runs the linear layers token by token, keeping the
state after each position; after acceptance of a drafts the runner commits the state after position a, not
after the whole row. The oracle: one-device greedy generation without drafts (tests/test_engine_loop_hybrid.py's
model; conftest.py's ``one_device``, a fresh full prefill per token), float64 weights. An n-gram drafter
over prompts that repeat themselves gets some drafts accepted and some rejected (a rejected draft whose state were committed turns the next tokens wrong).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_loop_hybrid import LAYOUTS, engine, model, prompt, sched

from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.llm import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
TOKENS = 16


def greedy(one_device, prompt_: tuple[int, ...]) -> list[int]:
    """TOKENS one-device greedy tokens, no drafts (conftest.py's ``one_device``: a full prefill per token)."""
    cfg, params = model()
    return one_device.tokens("qwen3_next", params, cfg, list(prompt_), TOKENS)


def prompts(one_device) -> list[list[int]]:
    """Prompts whose greedy continuations repeat some of their n-grams (the n-gram drafter gets drafts
    accepted, and many rejected): a prompt followed by its own first greedy tokens, and a repeated pattern."""
    def own(seed):
        p = prompt(6, seed)
        return p + greedy(one_device, tuple(p))[:10]

    return [own(103), prompt(4, 201) * 5, own(100)]


def run(eng, reqs, params) -> list[list[int]]:
    ids = [eng.add_request(p, params[i]) for i, p in enumerate(reqs)]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.blocks_used == 0
    return [list(eng.scheduler.requests[i].output) for i in ids]


@pytest.mark.parametrize(("layout", "k"), [("one", 1), ("one", 2), ("one", 3), ("dcp2", 1), ("dcp2", 3),
                                         ("pcp2_dcp2", 2)])  # PCP 2 + DCP 2: every prefill chunk under PCP
def test_ngram_drafts_give_the_greedy_tokens(one_device, layout, k):
    reqs = prompts(one_device)
    eng = engine(layout, num_blocks=64 // LAYOUTS[layout][0], drafter=NgramDrafter(), num_speculative_tokens=k,
                 scheduler=sched(max_num_batched_tokens=16))
    got = run(eng, reqs, [SamplingParams(max_tokens=TOKENS)] * len(reqs))
    assert got == [greedy(one_device, tuple(p)) for p in reqs]
    s = eng.stats
    assert s.drafted_tokens > s.accepted_tokens > 0, (s.drafted_tokens, s.accepted_tokens)


def test_drafts_with_a_preemption(one_device):
    """A pool too small for every request: a preempted request recomputes from context 0 in a fresh slot."""
    reqs = prompts(one_device)
    eng = engine("dcp2", num_blocks=5, drafter=NgramDrafter(), num_speculative_tokens=2, scheduler=sched())
    got = run(eng, reqs, [SamplingParams(max_tokens=TOKENS)] * len(reqs))
    assert eng.stats.preemptions > 0 and eng.stats.accepted_tokens > 0, eng.stats
    assert got == [greedy(one_device, tuple(p)) for p in reqs]


@pytest.mark.slow  # seeded sampling (~2 s): slow lane; the greedy n-gram drafts above stay fast
def test_seeded_sampling_with_drafts_is_the_same_as_without(one_device):
    """temperature > 0: the emitted tokens do not depend on the drafts (cpattn.engine.sampling's verify)."""
    reqs = prompts(one_device)
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.3, seed=7 + i) for i in range(len(reqs))]
    plain = run(engine("one", num_blocks=64), reqs, params)
    assert plain != [greedy(one_device, tuple(p)) for p in reqs]  # not greedy
    for layout in ("one", "dcp2"):
        eng = engine(layout, num_blocks=64 // LAYOUTS[layout][0], drafter=NgramDrafter(), num_speculative_tokens=3)
        assert run(eng, reqs, params) == plain, layout
        assert eng.stats.drafted_tokens > eng.stats.accepted_tokens > 0, eng.stats


def test_captured_decode_with_drafts_replays(one_device):
    reqs = prompts(one_device)
    eng = engine("one", num_blocks=64, drafter=NgramDrafter(), num_speculative_tokens=2,
                 graph_mode="FULL_DECODE_ONLY", graph_backend="eager")
    got = run(eng, reqs, [SamplingParams(max_tokens=TOKENS)] * len(reqs))
    assert got == [greedy(one_device, tuple(p)) for p in reqs]
    assert eng.stats.replayed_steps > 0 and eng.stats.accepted_tokens > 0, eng.stats


@pytest.mark.slow  # ~1.5 s: slow lane; test_engine_loop's hidden-state drafters stay fast
def test_a_drafter_reading_hidden_states_is_served(one_device):
    """A drafter declaring ``hidden_layers`` (was refused) gets the target's rows; MTP: tests/test_hybrid_mtp.py."""
    class Head(NgramDrafter):  # n-gram drafts, and the residual stream after layer 1 handed to each proposal
        hidden_layers = (1,)

    reqs = prompts(one_device)
    eng = engine("dcp2", num_blocks=32, drafter=Head(), num_speculative_tokens=2)
    got = run(eng, reqs, [SamplingParams(max_tokens=TOKENS)] * len(reqs))
    assert got == [greedy(one_device, tuple(p)) for p in reqs]
    assert eng.stats.accepted_tokens > 0, eng.stats


@pytest.mark.slow  # a draft model (~2 s): slow lane; the n-gram drafts above stay fast
def test_draft_model_drafts_give_the_greedy_tokens(one_device):
    """A draft model (a tiny dense Qwen3 over the same vocabulary) is a token drafter too: lossless. A random
    draft model's drafts are (nearly) all rejected, so this covers its path and the rollback; the n-gram tests
    above cover acceptance."""
    from cpattn.drafters.draft_model import ModelDrafter
    from cpattn.models import qwen3

    cfg, _ = model()
    dcfg = qwen3.Qwen3Config.tiny(vocab_size=cfg.vocab_size)
    drafter = ModelDrafter("qwen3", qwen3.init_params(dcfg, seed=3, dtype=torch.float64), dcfg)
    reqs = prompts(one_device)
    eng = engine("dcp2", num_blocks=32, drafter=drafter, num_speculative_tokens=2)
    got = run(eng, reqs, [SamplingParams(max_tokens=TOKENS)] * len(reqs))
    assert got == [greedy(one_device, tuple(p)) for p in reqs]
    assert eng.stats.drafted_tokens > eng.stats.accepted_tokens, eng.stats
