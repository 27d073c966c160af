"""Speculative decoding with DCP verification: tokens equal plain single-device greedy generation.

The reference is conftest.py's ``one_device`` (:mod:`ref.greedy`): each token the argmax of a fresh one-device
full prefill's last row, no cache carried and no engine code (the forward is checked against Hugging Face in
test_models_hf.py). Models are float64, so
every logit matches to rounding and greedy tokens must be identical (no near-tie allowance needed).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanes import examples
import spec_pd_cases
from near_tie import check_tokens
from spec_pd_cases import prompts, spec_cases

from cpattn.comm.launch import spawn
from cpattn.graphs import buckets
from cpattn.engine.decode import accept_drafts
from cpattn.drafters.draft_model import ModelDrafter, truncated
from cpattn.drafters.ngram import NgramDrafter, ngram_lookup
from cpattn.engine.drafters import DraftSettings
from cpattn.models.generate import speculative_generate

NEW = 14


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(one_device):
    """name -> (model, params, cfg, the one-device greedy recompute of NEW tokens) for a tiny model
    (:func:`spec_pd_cases.reference`; conftest.py's ``one_device`` oracle)."""
    return lambda name: spec_pd_cases.reference(one_device, name, NEW)


def check(out, ref, k: int) -> None:
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.allclose(out.logits.double(), ref.logits.double(), rtol=1e-5, atol=1e-6)
    s = out.stats
    assert s.drafted == k * s.rows and s.emitted == s.accepted + s.rows
    assert 1.0 <= s.tokens_per_step <= 1 + k
    assert sum(s.accepted_hist) == s.rows


class ConstantDrafter:
    """Always proposes token 0: nearly every draft is rejected, so rejected KV must never be read."""

    method = "constant"
    settings = DraftSettings()
    hidden_layers = None

    def start(self, num_requests, max_len, *, graph=None):
        return self

    def propose(self, histories, k, requests, hidden=None):
        return torch.zeros(len(histories), k, dtype=torch.int64)

    def rollback(self, requests, keep_lens):
        pass


# k = 1..4, each with the n-gram drafter, the draft model and the constant drafter, over DCP 1..8 and PCP 1..8
CASES = [(k, d, dcp, pcp) for k, (dcp, pcp) in zip((1, 2, 3, 4), ((1, 3), (2, 1), (4, 5), (8, 2)))
         for d in ("ngram", "model", "constant")]


@pytest.mark.slow
@pytest.mark.parametrize("k,drafter,dcp,pcp", CASES, ids=[f"k{k}-{d}-dcp{n}-pcp{p}" for k, d, n, p in CASES])
def test_matches_plain_greedy(reference, k, drafter, dcp, pcp):
    model, params, cfg, ref = reference("qwen3")
    d = {"ngram": NgramDrafter(), "model": truncated(model, params, cfg, 1), "constant": ConstantDrafter()}[drafter]
    out = speculative_generate(model, params, cfg, prompts(), NEW, drafter=d, num_speculative_tokens=k,
                               dcp_size=dcp, pcp_size=pcp, interleave_size=2 if dcp == 4 else 1,
                               dcp_merge="a2a" if dcp == 8 else "ag_rs")
    check(out, ref, k)


def test_perfect_drafter_accepts_everything(reference):
    """The target as its own draft model: every draft accepted, 1 + k tokens per step."""
    model, params, cfg, ref = reference("qwen3")
    k = 3
    out = speculative_generate(model, params, cfg, prompts(), NEW, drafter=ModelDrafter(model, params, cfg),
                               num_speculative_tokens=k, dcp_size=2)
    check(out, ref, k)
    assert out.stats.acceptance_rate == 1.0 and out.stats.tokens_per_step == 1 + k
    assert out.stats.steps == -(-(NEW - 1) // (1 + k))


def test_ngram_accepts_on_repetition(one_device, reference):
    """Greedy decoding of a random model falls into a cycle, which prompt lookup then predicts."""
    model, params, cfg, _ = reference("qwen3")
    long = one_device(model.FAMILY, params, cfg, prompts()[:1], 40)
    out = speculative_generate(model, params, cfg, prompts()[:1], 40, drafter=NgramDrafter(), num_speculative_tokens=3)
    assert torch.equal(out.tokens, long.tokens)
    assert out.stats.acceptance_rate > 0.3 and out.stats.tokens_per_step > 1.5


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_mla_and_dsa(reference, name):
    model, params, cfg, ref = reference(name)
    out = speculative_generate(model, params, cfg, prompts(), NEW, drafter=NgramDrafter(), num_speculative_tokens=2,
                               dcp_size=2, pcp_size=2, interleave_size=2)
    check(out, ref, 2)


def test_graph_mode_buckets(reference):
    """Verification through a DecodeRunner: every step replays a bucket that is a multiple of 1 + k."""
    model, params, cfg, ref = reference("qwen3")
    for k, sizes in ((2, None), (1, [2, 4, 6])):
        out = speculative_generate(model, params, cfg, prompts(), NEW, drafter=NgramDrafter(),
                                   num_speculative_tokens=k, dcp_size=2, graph=True, capture_sizes=sizes)
        check(out, ref, k)
        assert out.stats.graph_steps == out.stats.steps
    assert all(s % 3 == 0 for s in buckets.capture_sizes(12, num_speculative_tokens=2))
    with pytest.raises(ValueError, match=r"capture_sizes: saw \[4\] .* multiples of 3"):
        speculative_generate(model, params, cfg, prompts(), 4, drafter=NgramDrafter(), num_speculative_tokens=2,
                             graph=True, capture_sizes=[4])


@pytest.mark.slow
def test_float32_logits_and_tokens(one_device, reference):
    """float32: verification logits within 1e-4 of plain decode; a differing token only at a near tie (DESIGN §5)."""
    model, params64, cfg, _ = reference("qwen3")
    params = {n: t.float() for n, t in params64.items()}
    ref = one_device(model.FAMILY, params, cfg, prompts(), NEW)  # the float32 recompute
    out = speculative_generate(model, params, cfg, prompts(), NEW, drafter=truncated(model, params, cfg, 1),
                               num_speculative_tokens=3, dcp_size=4, interleave_size=2)
    flips: list = []
    for b in range(len(prompts())):
        check_tokens(out.tokens[b], out.logits[b], ref.tokens[b], ref.logits[b], f"request {b}", flips)
    assert len(flips) <= 1, flips


def test_accept_drafts_against_a_loop():
    g = torch.Generator().manual_seed(0)
    for k in range(1, 5):
        greedy = torch.randint(0, 3, (50, k + 1), generator=g)
        other = torch.randint(0, 3, (50, k), generator=g)
        drafts = torch.where(torch.rand(50, k, generator=g) < 0.7, greedy[:, :k], other)
        want = []
        for d, t in zip(drafts.tolist(), greedy.tolist()):
            a = 0
            while a < k and d[a] == t[a]:
                a += 1
            want.append(a)
        assert accept_drafts(drafts, greedy).tolist() == want


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 4))
def test_ngram_lookup_property(history, k):
    """k tokens; when the last token occurred before, the draft starts with what followed its latest match."""
    out = ngram_lookup(history, k, max_ngram=1)
    assert len(out) == k
    earlier = [i for i in range(len(history) - 1) if history[i] == history[-1]]
    assert out[0] == (history[earlier[-1] + 1] if earlier else history[-1])


def test_errors_name_the_problem(reference):
    model, params, cfg, _ = reference("qwen3")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_generate(model, params, cfg, prompts(), 4, drafter=NgramDrafter(), num_speculative_tokens=0)
    with pytest.raises(TypeError, match="start"):
        speculative_generate(model, params, cfg, prompts(), 4, drafter=object(), num_speculative_tokens=1)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)


@pytest.mark.slow
def test_on_gloo_ranks(reference):
    """Two real gloo ranks: PCP prefill, then DCP verification with each drafter (one spawn, three cases).

    The third case replays a graph compiled by torch.compile (aot_eager) for every step: 3 requests x 2
    rows fill the one capture size 6, and smaller batches are padded to it.
    """
    model, params, cfg, ref = reference("qwen3")
    args = ("qwen3", params, cfg, prompts(), NEW)
    cases = [(args, {"drafter": NgramDrafter(), "num_speculative_tokens": 3}),
             (args, {"drafter": truncated("qwen3", params, cfg, 1), "num_speculative_tokens": 2,
                     "interleave_size": 2, "dcp_merge": "a2a"}),
             # verification captured with torch.compile (aot_eager, fullgraph) over gloo collectives
             (args, {"drafter": NgramDrafter(), "num_speculative_tokens": 1, "graph": "aot_eager",
                     "capture_sizes": [6]})]
    for per_rank in spawn(2, spec_cases, cases):
        for (_, kw), out in zip(cases, per_rank):
            check(out, ref, kw["num_speculative_tokens"])
        assert per_rank[2].stats.graph_steps == per_rank[2].stats.steps
