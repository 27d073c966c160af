"""One LLMEngine with 1 < pcp_size < dcp_size: a step's PCP chunks run over the first pcp_size ranks of the
DCP group (``StepRunner.pcp_group``), the other ranks compute none of the chunks' rows, and the decodes run
DCP over all dcp_size ranks.

The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone (a fresh one-device full
prefill per token, no step loop or engine code), float64 tiny models, so the tokens must be equal. Requests
arrive at different steps, prompts of 1..60 tokens (some shorter than pcp_size) are chunked by budgets of
16-64 tokens, two share a prefix (a prefix hit: the chunk's context is gathered from the DCP shards), blocks
are NaN-poisoned, uniform decode steps replay a captured program. Every rank's logits are checked equal at
every step. Then ``generate`` with pcp_size=2, dcp_size=4 (now the step loop) against the fixed-batch composition
(``cpattn.engine.composed``), and the one-line refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import checked_logits, record_group_calls, run_schedule
from ref.greedy import ONE_DEVICE

from cpattn.config import SchedulerConfig
from cpattn.engine import runner_pcp
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.driver import engine_configs, generate, step_loop_runs
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
MAX_TOKENS = 6
TOL = dict(rtol=1e-9, atol=1e-9)  # float64: the step loop and the composition sum partials in other orders


@functools.lru_cache(maxsize=None)
def model(family: str, heads: int | None = None):
    """A tiny float64 model; ``heads``: query heads (12 lets DCP sizes 3, 4 and 6 divide them)."""
    fam = get_family(family)
    cfg = fam.config_class.tiny(**({} if heads is None else {"num_attention_heads": heads}))
    return cfg, fam.init_params(cfg, seed=1, dtype=torch.float64)


def reference(family: str, heads: int | None, prompt: tuple[int, ...]) -> list[int]:
    """The request alone: conftest.py's ``one_device`` memo (no cache of its own here)."""
    cfg, params = model(family, heads)
    return ONE_DEVICE.tokens(family, params, cfg, list(prompt), MAX_TOKENS)


def schedule(vocab: int, pcp: int, dcp: int, seed: int = 0) -> list[dict]:
    """Seven requests over steps 0..7: 60, 37 and 1 token at once (more than a step's budget: partial chunks),
    pcp - 1 tokens, two sharing 4 * dcp + 2 tokens (a prefix hit of one whole span of 4-token blocks)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = toks(4 * dcp + 2)
    return [dict(prompt=toks(60), max_tokens=3, arrive=0), dict(prompt=toks(37), max_tokens=5, arrive=0),
            dict(prompt=toks(1), max_tokens=6, arrive=0), dict(prompt=toks(max(1, pcp - 1)), max_tokens=4, arrive=1),
            dict(prompt=base + toks(5), max_tokens=6, arrive=2), dict(prompt=base + toks(11), max_tokens=5, arrive=6),
            dict(prompt=toks(pcp + 1), max_tokens=6, arrive=7)]


@pytest.fixture
def prefill_calls(monkeypatch):
    """Every PCP prefill call of run_prefill_rows: (PCP group rank, size), from every rank's thread."""
    return record_group_calls(monkeypatch, runner_pcp, "prefill")


CASES = [  # family, pcp, dcp, heads, interleave, budget
    ("qwen3", 2, 4, None, 2, 16),
    ("qwen3", 2, 3, 6, 1, 24),  # P does not divide N
    ("deepseek_v3", 2, 4, None, 4, 32),  # MLA: values in the keys
    ("deepseek_v32", 2, 4, None, 1, 16),  # DSA-CP chunks (top-4 of up to 60 keys), indexer keys paged
    pytest.param("qwen3", 3, 6, 12, 2, 64, marks=pytest.mark.slow),
    ("qwen3", 2, 6, 12, 1, 32),
    pytest.param("deepseek_v3", 3, 6, 12, 1, 24, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 2, 3, None, 2, 16, marks=pytest.mark.slow),
    pytest.param("deepseek_v2", 2, 4, None, 2, 64, marks=pytest.mark.slow),
    pytest.param("glm_moe_dsa", 2, 4, None, 2, 16, marks=pytest.mark.slow),  # DSA with shared top-k layers
]


@pytest.mark.parametrize("family,pcp,dcp,heads,interleave,budget", CASES)
def test_pcp_over_a_sub_group_gives_one_device_greedy_tokens(family, pcp, dcp, heads, interleave, budget,
                                                             prefill_calls):
    cfg, params = model(family, heads)
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, interleave_size=interleave,
                       graph_mode="FULL_DECODE_ONLY", num_blocks=48, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4))
    assert [r.pcp_group is None for r in engine.runners] == [False] * pcp + [True] * (dcp - pcp)
    assert {r.pcp_group.size for r in engine.runners[:pcp]} == {pcp}
    rows = checked_logits(engine)
    sched = schedule(cfg.vocab_size, pcp, dcp)
    ids, steps = run_schedule(engine, sched)
    for i, rid in ids.items():
        got = list(engine.scheduler.requests[rid].output)
        want = reference(family, heads, tuple(sched[i]["prompt"]))[: sched[i]["max_tokens"]]
        assert got == want, f"request {i} (prompt {len(sched[i]['prompt'])} tokens): {got} != {want}"
    graph = engine.runners[0].graph
    for out, replayed in steps:
        assert not (replayed and not out.uniform_decode), f"a step with {out.eager_reason} replayed"
        if out.uniform_decode and out.num_scheduled_tokens <= graph.sizes[-1]:
            assert replayed, f"a uniform decode step of {out.num_scheduled_tokens} tokens ran eagerly"
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    assert s.pcp_steps > 0 and s.replayed_steps > 0 and s.eager_steps > 0, s
    assert graph.stats.graph == s.replayed_steps > 0, graph.stats
    assert s.prefix_hit_tokens > 0, s  # the shared span: a chunk whose context comes from the shards
    assert any(p and not d for o, _ in steps for p, d in zip(o.is_prefill, o.samples)), "no partial chunk ran"
    assert rows[0] > 0
    # only the PCP sub-group prefilled: pcp calls per PCP step, each of the step's chunk tokens
    assert {size for _, size in prefill_calls} == {pcp}
    assert len(prefill_calls) == pcp * s.pcp_steps
    assert sorted(r for r, _ in prefill_calls) == sorted(list(range(pcp)) * s.pcp_steps)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                    pytest.param("deepseek_v32", marks=pytest.mark.slow)])
def test_generate_with_pcp_2_dcp_4_is_the_compositions(family):
    """generate(pcp_size=2, dcp_size=4) runs the step loop now; the composition called explicitly agrees."""
    cfg, params = model(family)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 1, 9, 30)]
    pre, dec = engine_configs(family, cfg, pcp_size=2, dcp_size=4, block_size=4)
    assert step_loop_runs(get_family(family), cfg, pre, dec)
    want = composed(get_family(family), params, cfg, Prompts.of(prompts), 5, prefill=pre, decode=dec)
    got = generate(family, params, cfg, prompts, 5, prefill=pre, decode=dec)
    assert torch.equal(got.tokens, want.tokens)
    assert got.logits.shape == want.logits.shape and torch.allclose(got.logits, want.logits, **TOL)
    assert torch.allclose(got.prompt_logits, want.prompt_logits, **TOL)
    assert got.stats.steps == want.stats.steps == 4


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_drafters_reading_hidden_states_get_the_sub_groups_rows(method):
    """A head reading the target's hidden states (Eagle3 on Qwen3, MTP on DeepSeek-V3) under PCP 2 + DCP 4: the
    ranks outside the PCP group get DCP rank 0's hidden rows; every proposal equals the head's drafts recomputed
    from scratch, tokens are one-device greedy, drafts get accepted."""
    from spec_methods_cases import TARGET_OF, Recorder, head, prompts, reference_drafts, target

    name, cfg, params = target(TARGET_OF[method])
    drafter = Recorder(head(method))
    sched = [dict(prompt=p, max_tokens=6, arrive=i) for i, p in enumerate(prompts(name))]
    engine = LLMEngine(name, params, cfg, dcp_size=4, pcp_size=2, block_size=4, num_blocks=24, poison=True,
                       drafter=drafter, num_speculative_tokens=2,
                       scheduler=SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3))
    ids, _ = run_schedule(engine, sched)
    for i, rid in ids.items():
        want = ONE_DEVICE.tokens(name, params, cfg, sched[i]["prompt"], 6)
        assert list(engine.scheduler.requests[rid].output) == want, (method, i)
    s = engine.stats
    assert s.pcp_steps > 0 and s.drafted_tokens > 0 and s.accepted_tokens > 0 and s.blocks_used == 0, s
    assert drafter.log
    for histories, drafts in drafter.log:
        for h, d in zip(histories, drafts):
            assert d == reference_drafts(drafter.drafter, name, params, cfg, h, 2), (method, len(h))


def test_v4_and_hybrid_run_a_sub_group_and_pcp_over_dcp():
    """Hybrid models and DeepSeek-V4 take 1 < pcp_size < dcp_size too (tests/test_engine_loop_pcp_sub_v4_hybrid.py)
    and pcp_size > dcp_size (tests/test_engine_loop_pcp_wide_v4_hybrid.py): generate runs the step loop for both."""
    for name in ("qwen3_next", "deepseek_v4"):
        cfg = get_family(name).config_class.tiny()
        for pcp, dcp in ((2, 4), (4, 2)):
            pre, dec = engine_configs(name, cfg, pcp_size=pcp, dcp_size=dcp, block_size=4)
            assert step_loop_runs(get_family(name), cfg, pre, dec), (name, pcp, dcp)


@pytest.mark.slow
def test_gloo_ranks_split_the_pcp_sub_group():
    """Real processes (gloo, Group.split over torch.distributed): every rank gets the oracle's tokens."""
    from cpattn.comm.launch import spawn
    from engine_loop_cases import gloo_rank

    cfg, params = model("qwen3")
    sched = schedule(cfg.vocab_size, 2, 4, seed=3)
    kwargs = dict(pcp_size=2, block_size=4, num_blocks=48, graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=dict(max_num_batched_tokens=16, max_num_seqs=4))
    per_rank = spawn(4, gloo_rank, "qwen3", cfg, 1, sched, kwargs)
    want = {i: reference("qwen3", None, tuple(r["prompt"]))[: r["max_tokens"]] for i, r in enumerate(sched)}
    assert all(got == want for got in per_rank), per_rank
