"""``driver.generate_on_rank`` of a P/D pair through the step loop (``cpattn.engine.step_on_rank``: run_rank with
``pd=True`` on a world of P + N ranks), on the simulated mesh.

Float64 tiny models. On every rank: the tokens are one-device greedy's (conftest.py's ``one_device``), the
logits those of the simulated P/D ``step_generate`` (a PDEngine, the same two engines in one process) within
1e-9; the prompt logits only on the producer ranks; with a drafter the SpecStats are step_generate's; with an
in-process pool the producer stores the blocks and the consumer loads them. The gloo runs of this path:
tests/test_disagg.py, tests/test_pool_pd.py, tests/test_drafters_lossless.py, tests/test_v4_gloo.py (slow).
"""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import tiny_float64

import cpattn
from cpattn.engine import driver
from cpattn.engine.connector_pd import usable_blocks
from cpattn.engine.options import Algorithms
from cpattn.engine.pd_engine import memory_pool
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.engine.sampling import SamplingParams
from cpattn.engine.step_generate import step_generate
from cpattn.engine.step_on_rank import pd_step_on_rank

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
TOL = dict(rtol=1e-9, atol=1e-9)
BLOCK = 4
LAYOUTS = [(1, 1), (2, 1), (2, 2)]
SPEC_FIELDS = ("steps", "rows", "drafted", "accepted", "emitted", "accepted_hist")


def batch(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 4, 9)]


def configs(family, cfg, p, n, **kw):
    return driver.engine_configs(family, cfg, pcp_size=p, dcp_size=n, pd=True, block_size=BLOCK,
                                 interleave_size=BLOCK, **kw)


def on_ranks(family, params, cfg, prompts, new, p, n, pre, dec, **kw):
    return cpattn.simulate(p + n, driver.generate_on_rank, family, params, cfg, prompts, new, prefill=pre,
                           decode=dec, **kw)


def check(gens, want, ref_tokens, p):
    """Every rank: one-device tokens, want's logits; prompt logits on the producer ranks only; the roles."""
    assert [g.facts.role for g in gens] == ["prefill"] * p + ["decode"] * (len(gens) - p)
    for g in gens:
        assert torch.equal(g.tokens, ref_tokens)
        assert g.logits.dtype == want.logits.dtype == torch.float64
        assert torch.allclose(g.logits, want.logits, **TOL)
    for g in gens[:p]:
        assert torch.allclose(g.prompt_logits, want.prompt_logits, **TOL)
    assert all(g.prompt_logits is None for g in gens[p:])


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v32", "deepseek_v4", "qwen3_next"])
@pytest.mark.parametrize("p,n", LAYOUTS, ids=lambda v: str(v))
def test_pd_on_every_rank_is_the_step_loops_generation(one_device, family, p, n):
    cfg, params = tiny_float64(family, seed=2)
    prompts = batch(cfg.vocab_size)
    pre, dec = configs(family, cfg, p, n)
    want = step_generate(family, params, cfg, prompts, 5, prefill=pre, decode=dec)
    gens = on_ranks(family, params, cfg, prompts, 5, p, n, pre, dec)
    check(gens, want, one_device(family, params, cfg, prompts, 5).tokens, p)
    sent, got = [g.facts.handoff for g in gens[:p]], [g.facts.handoff for g in gens[p:]]
    assert sum(h.bytes_sent for h in sent) == sum(h.bytes_received for h in got) > 0  # over the world's send / recv
    if family in ("qwen3", "deepseek_v32"):  # per-token blocks: those the consumer can use, its tail computed
        assert sum(h.blocks_received for h in got) == sum(usable_blocks(len(q), BLOCK, n) for q in prompts)
    dec_facts = gens[p].facts
    assert dec_facts.kv_bytes > 0 and len(dec_facts.step_s) == 4 and dec_facts.ttft_s > 0
    assert gens[0].facts.prefill_s > 0 and gens[0].facts.bytes_sent["handoff"] > 0
    assert gens[p].stats.steps == want.stats.steps == 4 and gens[0].stats.steps == 0


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v4", "qwen3_next"])
@pytest.mark.parametrize("p,n", [(2, 2), (2, 1)], ids=lambda v: str(v))
def test_pd_with_a_drafter(one_device, family, p, n):
    """n-gram drafts (qwen3); drafters reading the target's hidden states, which the P/D connector sends with
    the state (DeepSeek-V4's DSpark head, Qwen3-Next's MTP): the counts of step_generate's run."""
    from test_step_generate import pd_drafting

    cfg, params, prompts, drafter, k = pd_drafting(family)
    pre, dec = configs(family, cfg, p, n, num_speculative_tokens=k, speculative_method=drafter.method)
    want = step_generate(family, params, cfg, prompts, 7, prefill=pre, decode=dec, drafter=drafter)
    gens = on_ranks(family, params, cfg, prompts, 7, p, n, pre, dec, drafter=drafter)
    check(gens, want, one_device(family, params, cfg, prompts, 7).tokens, p)
    for g in gens[p:]:
        for f in SPEC_FIELDS:
            assert getattr(g.stats, f) == getattr(want.stats, f), f
        assert g.stats.draft_digest == gens[p].stats.draft_digest  # the same drafts on every decode rank
    assert gens[p].stats.accepted > 0


@pytest.mark.parametrize("p,n", LAYOUTS, ids=lambda v: str(v))
def test_pd_with_an_in_process_pool(one_device, p, n):
    """Cold then warm through one open pool: the producer stores each whole block once and starts the warm run
    from them; the consumer loads every block it can use from the pool, none crosses the link."""
    cfg, params = tiny_float64("qwen3", seed=2)
    shared = batch(cfg.vocab_size)[0] + [1, 2, 3, 4, 5, 6, 7]  # 20 tokens: 5 whole blocks
    cold, warm = [shared, shared[:9]], [shared[:18] + [9, 9, 9], shared[:9] + [8]]  # warm: block 4 of 0 is new
    pool = memory_pool("qwen3", cfg, params, BLOCK)
    pre, dec = configs("qwen3", cfg, p, n)
    for prompts, hits, stored in ((cold, (0, 0), 5), (warm, (4, 2), 1)):
        want = step_generate("qwen3", params, cfg, prompts, 4, prefill=pre, decode=dec)
        gens = on_ranks("qwen3", params, cfg, prompts, 4, p, n, pre, dec, pool=pool)
        ref = one_device("qwen3", params, cfg, prompts, 4).tokens
        for g in gens:
            assert torch.equal(g.tokens, ref) and torch.allclose(g.logits, want.logits, **TOL)
        assert all(g.facts.pool.hit_blocks == hits for g in gens[:p])
        assert sum(g.facts.pool.blocks_stored for g in gens[:p]) == stored
        assert all(g.facts.pool.blocks_stored == 0 for g in gens[p:])
        usable = tuple(usable_blocks(len(q), BLOCK, n) for q in prompts)
        assert all(g.facts.pool.hit_blocks == usable for g in gens[p:])
        assert sum(g.facts.handoff.blocks_received for g in gens[p:]) == 0
        if hits == (0, 0):  # every prompt position computed
            assert torch.allclose(gens[0].prompt_logits, want.prompt_logits, **TOL)
        else:  # the pool's positions are not computed
            assert gens[0].prompt_logits.shape[0] == sum(map(len, prompts)) - BLOCK * sum(hits)


def test_pd_with_a_drafter_and_a_pool(one_device):
    from test_step_generate import pd_drafting

    cfg, params, prompts, drafter, k = pd_drafting("qwen3")
    pre, dec = configs("qwen3", cfg, 2, 2, num_speculative_tokens=k, speculative_method=drafter.method)
    want = step_generate("qwen3", params, cfg, prompts, 7, prefill=pre, decode=dec, drafter=drafter)
    gens = on_ranks("qwen3", params, cfg, prompts, 7, 2, 2, pre, dec, drafter=drafter,
                    pool=memory_pool("qwen3", cfg, params, BLOCK))
    check(gens, want, one_device("qwen3", params, cfg, prompts, 7).tokens, 2)
    assert all(getattr(gens[2].stats, f) == getattr(want.stats, f) for f in SPEC_FIELDS)


def test_one_token_is_the_producers():
    """N = 1, no drafts: the producer finishes every request (nothing handed off); every rank gets its tokens."""
    cfg, params = tiny_float64("qwen3", seed=2)
    prompts = batch(cfg.vocab_size)
    pre, dec = configs("qwen3", cfg, 2, 1)
    want = step_generate("qwen3", params, cfg, prompts, 1, prefill=pre, decode=dec)
    gens = cpattn.simulate(3, pd_step_on_rank, "qwen3", params, cfg, prompts, 1, prefill=pre, decode=dec)
    check(gens, want, want.tokens, 2)
    assert gens[2].facts.handoff.bytes_received == 0 and gens[2].facts.step_s == ()


def test_what_still_runs_the_composition():
    """Other algorithms run the step loop too (the usable blocks cross the link); the fixed-batch composition
    (what a given prefix still gets, called here directly) sends every block, the partial last one too.
    The same tokens."""
    cfg, params = tiny_float64("qwen3", seed=2)
    prompts = batch(cfg.vocab_size)
    pre, dec = configs("qwen3", cfg, 1, 1)
    step = on_ranks("qwen3", params, cfg, prompts, 3, 1, 1, pre, dec)
    other = on_ranks("qwen3", params, cfg, prompts, 3, 1, 1, pre, dec, algorithms=Algorithms(pcp_method="allgather"))
    old = cpattn.simulate(2, driver.composed_on_rank, "qwen3", params, cfg, prompts, 3, prefill=pre, decode=dec,
                          algorithms=Algorithms(pcp_method="allgather"))
    for gens in (other, old):
        assert torch.equal(step[0].tokens, gens[0].tokens) and torch.equal(step[1].tokens, gens[1].tokens)
    usable = sum(usable_blocks(len(q), BLOCK, 1) for q in prompts)
    assert step[1].facts.handoff.blocks_received == other[1].facts.handoff.blocks_received == usable
    assert old[1].facts.handoff.blocks_received == sum(-(-len(q) // BLOCK) for q in prompts)


def test_an_on_step_abort_returns_the_last_output():
    """run_rank's on_step hook may stop a request: its output of that step is what run_rank returns."""
    cfg, params = tiny_float64("qwen3", seed=2)
    arrivals = [Arrival(list(range(1, 12)), SamplingParams(max_tokens=8)),
                Arrival([4, 5], SamplingParams(max_tokens=3))]

    def stop_at_2(role, engine, outs):
        for o in outs:
            if role == "decode" and o.request_id == 0 and not o.finished and len(o.token_ids) >= 2:
                engine.abort_request(0)

    full = cpattn.simulate(2, run_rank, "qwen3", params, cfg, arrivals, pd=True, block_size=BLOCK)
    cut = cpattn.simulate(2, run_rank, "qwen3", params, cfg, arrivals, pd=True, block_size=BLOCK, on_step=stop_at_2)
    assert cut[0] == full[0] == {}
    got, whole = cut[1][0], full[1][0]
    assert got.finished and got.finish_reason == "abort" and len(got.token_ids) == 2
    assert got.token_ids == whole.token_ids[:2] and cut[1][1] == full[1][1]


@pytest.mark.parametrize("pd", [False, True])
def test_on_step_reports_each_decode_step_through_the_step_loop(pd, one_device, monkeypatch):
    """``generate_on_rank(on_step=)``: the step loop (the composition is never called), ``on_step(steps so far)``
    after each decoding step on every decoding rank (1, 2, ..., N - 1: the first token is the prefill's), the
    tokens one device's; colocated DCP 2 and P/D 1 -> 2."""
    cfg, params = tiny_float64("qwen3", seed=2)
    prompts = batch(cfg.vocab_size)
    if pd:
        pre, dec = configs("qwen3", cfg, 1, 2)
    else:
        pre, dec = driver.engine_configs("qwen3", cfg, dcp_size=2, block_size=BLOCK)

    def refused(*_, **__):
        raise AssertionError("composed_on_rank ran")

    monkeypatch.setattr(driver, "composed_on_rank", refused)
    seen: dict[int, list[int]] = {}

    def run(group):
        calls = seen.setdefault(group.rank, [])
        return driver.generate_on_rank(group, "qwen3", params, cfg, prompts, 5, prefill=pre, decode=dec,
                                       on_step=calls.append)

    gens = cpattn.simulate(3 if pd else 2, run)
    want = one_device("qwen3", params, cfg, prompts, 5).tokens
    assert all(torch.equal(g.tokens, want) for g in gens)
    decoding = [1, 2] if pd else [0, 1]
    assert {r: seen.get(r, []) for r in range(len(gens))} == \
        {r: [1, 2, 3, 4] if r in decoding else [] for r in range(len(gens))}
