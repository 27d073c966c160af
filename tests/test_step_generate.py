"""``step_generate`` (the fixed batch as a step-loop schedule, what ``cpattn.engine.generate`` now runs where it
can) against the fixed-batch composition it replaces (``cpattn.engine.composed``).

Float64 tiny models: the tokens must be equal, the logits and prompt logits close to ~1e-9 (the two
compositions sum attention partials in other orders), for the layouts both run: one device, DCP, PCP + DCP
in one engine, P/D, and with n-gram drafts; for paged-cache families, DeepSeek-V4 (its own cache) and a
hybrid model (paged KV + recurrent states).
"""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import tiny_float64

from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.driver import engine_configs, generate
from cpattn.engine.family import get_family
from cpattn.engine.step_generate import step_generate

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
TOL = dict(rtol=1e-9, atol=1e-9)


def model(family: str):
    return tiny_float64(family, seed=2)


def batch(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 4, 9)]


@pytest.mark.parametrize("family, layout", [
    ("qwen3", dict()), ("qwen3", dict(dcp_size=2)), ("qwen3", dict(pcp_size=2, dcp_size=2, one_engine=True)),
    ("qwen3", dict(pcp_size=2, dcp_size=2)),
    ("qwen3", dict(pcp_size=4, dcp_size=2)),  # PCP wider than DCP: the cache on the first 2 of 4 ranks (runner_wide)
    pytest.param("deepseek_v3", dict(pcp_size=2, dcp_size=1), marks=pytest.mark.slow),  # MLA: one-rank decode
    pytest.param("qwen3", dict(pcp_size=2, dcp_size=2, pd=True, interleave_size=4), marks=pytest.mark.slow),
    pytest.param("deepseek_v32", dict(pcp_size=2, dcp_size=2), marks=pytest.mark.slow),  # DSA-CP
    pytest.param("deepseek_v2", dict(dcp_size=2), marks=pytest.mark.slow),  # MLA
    ("deepseek_v4", dict(pcp_size=2, dcp_size=2)),  # its own cache kind (window rings + compressed entries)
    pytest.param("deepseek_v4", dict(dcp_size=2), marks=pytest.mark.slow),
    pytest.param("deepseek_v4", dict(pcp_size=2, dcp_size=2, pd=True, interleave_size=4), marks=pytest.mark.slow),
    ("qwen3_next", dict(pcp_size=2, dcp_size=2)),  # hybrid: paged KV + recurrent states
    ("deepseek_v4", dict(pcp_size=2, dcp_size=4)),  # PCP over a sub-group: ranks 2, 3 get their V4 shares
    ("qwen3_next", dict(pcp_size=2, dcp_size=4)),  # PCP over a sub-group: rank 0's linear states to ranks 2, 3
    ("deepseek_v4", dict(pcp_size=3, dcp_size=2)),  # PCP wider than DCP: V4 state on ranks 0, 1 only (runner_wide)
    ("qwen3_next", dict(pcp_size=4, dcp_size=2)),  # PCP wider than DCP: KV rows + linear states on ranks 0, 1 only
    pytest.param("qwen3_next", dict(dcp_size=2), marks=pytest.mark.slow),
])
def test_the_step_loop_gives_the_drivers_generation(family, layout):
    cfg, params = model(family)
    prompts = batch(cfg.vocab_size)
    pre, dec = engine_configs(family, cfg, block_size=4, **layout)
    want = composed(get_family(family), params, cfg, Prompts.of(prompts), 5, prefill=pre, decode=dec)
    got = step_generate(family, params, cfg, prompts, 5, prefill=pre, decode=dec)
    routed = generate(family, params, cfg, prompts, 5, prefill=pre, decode=dec)  # the public entry: the step loop
    assert torch.equal(routed.tokens, got.tokens) and torch.equal(routed.logits, got.logits)
    assert torch.equal(got.tokens, want.tokens)
    assert got.logits.shape == want.logits.shape and torch.allclose(got.logits, want.logits, **TOL)
    assert torch.allclose(got.prompt_logits, want.prompt_logits, **TOL)
    assert got.stats.steps == want.stats.steps == 4  # one prefill step, then one decode step per token
    assert got.facts.kv_bytes > 0 and len(got.facts.step_s) == 4


def test_drafts_in_the_step_loop_are_the_drivers_tokens():
    cfg, params = model("qwen3")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], batch(cfg.vocab_size)[0]]
    pre, dec = engine_configs("qwen3", cfg, dcp_size=2, block_size=4, num_speculative_tokens=2)
    want = composed(get_family("qwen3"), params, cfg, Prompts.of(prompts), 7, prefill=pre, decode=dec,
                    drafter=NgramDrafter())
    got = step_generate("qwen3", params, cfg, prompts, 7, prefill=pre, decode=dec, drafter=NgramDrafter())
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, **TOL)
    for f in ("steps", "rows", "drafted", "accepted", "emitted", "accepted_hist"):  # k drafts verified per row
        assert getattr(got.stats, f) == getattr(want.stats, f), f


def pd_drafting(family: str):
    """(cfg, params, prompts, drafter, k) of a P/D run whose drafts get accepted: qwen3 with n-gram drafts of
    repetitive prompts; drafters reading the target's hidden states (the P/D connector hands the consumer the
    prompt's rows with the state): DeepSeek-V4 with a random DSpark head (layers' streams), Qwen3-Next with the
    identity-like MTP head (final rows), tests/test_engine_loop_pd_hidden_v4_hybrid.py's."""
    if family == "qwen3":
        cfg, params = model("qwen3")
        g = torch.Generator().manual_seed(11)
        unit = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
        return cfg, params, [unit * 4, unit[:3] * 3], NgramDrafter(), 3  # repetitive: drafts get accepted
    from test_engine_loop_pd_hidden_v4_hybrid import head, model as target, schedule

    cfg, params = target(family)
    return cfg, params, [r["prompt"] for r in schedule(family)[:4]], head(family), 2


@pytest.mark.parametrize("family,pcp_size", [("qwen3", 2), ("qwen3", 1), ("deepseek_v4", 2), ("qwen3_next", 2)])
def test_pd_with_drafts_in_the_step_loop_is_the_drivers_generation(family, pcp_size):
    """P/D with a drafter (PDEngine's consumer drafts; V4 and hybrid ones reading hidden states were composed
    before their connectors handed the rows over): the composition's tokens, logits and SpecStats."""
    cfg, params, prompts, drafter, k = pd_drafting(family)
    pre, dec = engine_configs(family, cfg, pcp_size=pcp_size, dcp_size=2, pd=True, block_size=4, interleave_size=4,
                              num_speculative_tokens=k, speculative_method=drafter.method)
    from cpattn.engine.driver import step_loop_runs

    assert step_loop_runs(get_family(family), cfg, pre, dec, drafter)  # generate takes the step loop
    want = composed(get_family(family), params, cfg, Prompts.of(prompts), 7, prefill=pre, decode=dec,
                    drafter=drafter)
    got = generate(family, params, cfg, prompts, 7, prefill=pre, decode=dec, drafter=drafter)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logits, want.logits, **TOL)
    for f in ("steps", "rows", "drafted", "accepted", "emitted", "accepted_hist"):
        assert getattr(got.stats, f) == getattr(want.stats, f), f
    assert got.stats.accepted > 0


class _HiddenDrafter(NgramDrafter):
    hidden_layers = ("final",)  # as an MTP / Eagle3 head declares


def test_layouts_one_engine_cannot_run_are_refused():
    cfg = get_family("qwen3").config_class.tiny()  # refused before any weight is read
    pre, dec = engine_configs("qwen3", cfg, pcp_size=3, dcp_size=2, pd=True, interleave_size=4, block_size=4)
    with pytest.raises(ValueError, match="num_attention_heads % tp_size == 0"):  # a P/D producer of 3: 4 heads % 3
        step_generate("qwen3", {}, cfg, [[1, 2]], 2, prefill=pre, decode=dec)


@pytest.mark.parametrize("family, layout, drafter, why", [
    ("qwen3", dict(pcp_size=3, dcp_size=2, pd=True, interleave_size=4), None, "engine is refused"),  # 4 heads % 3
])
def test_generate_keeps_the_composition_for_what_the_step_loop_cannot_run(family, layout, drafter, why):
    from cpattn.engine.driver import step_loop_runs
    from cpattn.engine.step_generate import refusal

    cfg, _ = model(family)
    pre, dec = engine_configs(family, cfg, block_size=4, **layout)
    assert why in refusal(get_family(family), cfg, pre, dec, drafter)
    assert not step_loop_runs(get_family(family), cfg, pre, dec, drafter)
