"""DeepSeek-V4 and a hybrid model (Qwen3-Next) in one LLMEngine with pcp_size > dcp_size
(``cpattn.engine.runner_wide``): a world of P ranks whose DCP group is its first N ranks.

A step's prompts (V4: whole) or prefill chunks (hybrid) run PCP over all P ranks; only the first N hold state:
V4's rings and compressed entries (each DCP rank places its share of the state every PCP rank collected,
:mod:`cpattn.engine.runner_v4_pcp`), the hybrid model's KV rows of its full-attention layers (sent to their DCP
owners over the world) and its linear layers' slot states (replicated on the DCP ranks; a chunk continuing a
cached context starts, on every PCP rank, from DCP rank 0's: :mod:`cpattn.engine.runner_hybrid_pcp`). The
decodes run DCP over the first N ranks; ranks N..P-1 hold 0 bytes, run no decode step and take DCP rank 0's
outputs, and their scheduler (the same deterministic copy) stays in step.

The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone, float64 weights, so the
tokens must be equal. The schedule is tests/test_engine_loop_pcp_sub_v4_hybrid.py's: requests arriving at
different steps (mixed steps), prompts of 1 to 30 tokens (hybrid: cut into chunks by a budget of 5, boundaries
inside the conv kernel's width), a block pool small enough to preempt (recompute under PCP over the world
again), NaN-poisoned blocks and slots, captured decode replayed where asked. Every rank's logits equal rank 0's
at every step; every rank of the world runs every PCP prefill; nothing is held at the end. Then n-gram drafts
with prompt logits, ``generate`` against the composition (tests/test_step_generate.py has more), the refusal
that stays (a KV connector) and real gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import check_schedule
from test_engine_loop_pcp_sub_v4_hybrid import (BUDGET, MAX_TOKENS, check_drafts_and_prompt_logits, check_steps,
                                                checked_logits, model, prompt, schedule)
from test_engine_loop_pcp_sub_v4_hybrid import prefill_calls  # noqa: F401  (the fixture, shared)

from cpattn.config import SchedulerConfig
from cpattn.engine.llm import LLMEngine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine


def engine_of(family: str, pcp: int, dcp: int, *, captured: bool = False, num_blocks: int | None = None,
              **kwargs) -> LLMEngine:
    """An engine of PCP ``pcp`` over DCP ``dcp``; ``num_blocks`` default: 48 tokens of KV accounting (blocks of
    ``dcp`` * 4 tokens), small enough for the schedule to preempt."""
    cfg, params = model(family)
    v4 = family == "deepseek_v4"
    sched = SchedulerConfig(max_num_batched_tokens=BUDGET[family], max_num_seqs=4, enable_prefix_caching=False,
                            enable_chunked_prefill=not v4)
    graph = dict(graph_mode="FULL_DECODE_ONLY", graph_backend="eager") if captured else {}
    return LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, scheduler=sched,
                     num_blocks=12 // dcp if num_blocks is None else num_blocks, **graph, **kwargs)


def check_layout(engine: LLMEngine, family: str, pcp: int, dcp: int) -> None:
    """P runners over one world of P, PCP over all of it; the first N hold state and a DCP group of N, the
    others neither (no decode program, no graph); the ranks past N get a step function that fails if run."""
    runners, v4 = engine.runners, family == "deepseek_v4"
    assert len(runners) == pcp and {r.world.size for r in runners} == {pcp}
    assert all((r.prefill_group if v4 else r.pcp_group) is r.world for r in runners)
    assert [r.group is None for r in runners] == [False] * dcp + [True] * (pcp - dcp)
    assert {r.group.size for r in runners[:dcp]} == {dcp}
    assert [r.kv_bytes() == 0 for r in runners] == [False] * dcp + [True] * (pcp - dcp)
    assert all(r.graph is None for r in runners[dcp:])

    def no_step(*_, **__):
        raise AssertionError("a rank outside the DCP group ran a DCP step")

    for r in runners[dcp:]:
        assert (r.holder, r.program) == (None, None) if v4 else r.states.state_bytes() == 0
        if not v4:
            r._step = no_step


def check_drained(engine: LLMEngine, family: str, pcp: int, dcp: int) -> None:
    """No request holds a slot, every slot is free (V4: every DCP rank's cache rows at length 0); the ranks
    past N still hold 0 bytes."""
    for r in engine.runners:
        assert r.live == 0 and sorted(r._free) == list(range(engine.scheduler_config.max_num_seqs))
        if family == "deepseek_v4" and r.holder is not None:
            assert set(r.holder.cache.seq_lens) == {0}
    assert [r.kv_bytes() == 0 for r in engine.runners] == [False] * dcp + [True] * (pcp - dcp)


CASES = [  # family, pcp, dcp, captured
    ("deepseek_v4", 2, 1, True),  # PCP 2 prefill, one-rank decode
    ("deepseek_v4", 4, 2, False),
    ("deepseek_v4", 3, 2, True),  # N does not divide P
    ("qwen3_next", 2, 1, False),
    ("qwen3_next", 4, 2, True),
    ("qwen3_next", 3, 2, False),
    pytest.param("deepseek_v4", 2, 1, False, marks=pytest.mark.slow),
    pytest.param("deepseek_v4", 4, 2, True, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 2, 1, True, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 3, 2, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,pcp,dcp,captured", CASES)
def test_pcp_wider_than_dcp_gives_one_device_greedy_tokens(one_device, prefill_calls, family, pcp, dcp, captured):
    cfg, params = model(family)
    v4 = family == "deepseek_v4"
    engine = engine_of(family, pcp, dcp, captured=captured, poison=True)
    check_layout(engine, family, pcp, dcp)
    rows = checked_logits(engine)
    steps = check_schedule(engine, schedule(family, pcp), lambda r: one_device.tokens(
        family, params, cfg, r["prompt"], MAX_TOKENS)[: r["max_tokens"]])
    check_steps(engine, steps, v4, captured, rows)
    check_drained(engine, family, pcp, dcp)
    # every rank of the world prefilled every PCP step, as a PCP group of P
    assert {size for _, size in prefill_calls} == {pcp}
    assert sorted(r for r, _ in prefill_calls) == sorted(list(range(pcp)) * engine.stats.pcp_steps)


@pytest.mark.parametrize("family,pcp,dcp", [("deepseek_v4", 3, 2), ("qwen3_next", 3, 2)])
def test_drafts_and_prompt_logits_with_pcp_wider_than_dcp(one_device, family, pcp, dcp):
    """n-gram drafts (k = 2) verified by the DCP decode on the first N ranks (the ranks past N: DCP rank 0's
    rows, V4 commits / hybrid state commits only where the state is); every prompt row's logits close to one
    device's; tokens one device's."""
    from cpattn.drafters.ngram import NgramDrafter

    cfg, params = model(family)
    engine = engine_of(family, pcp, dcp, num_blocks=32, drafter=NgramDrafter(), num_speculative_tokens=2,
                       return_prompt_logits=True)
    check_layout(engine, family, pcp, dcp)
    check_drafts_and_prompt_logits(one_device, engine, family)
    engine.step()  # the scheduler reports the finishes: the runners drop the slots
    check_drained(engine, family, pcp, dcp)


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_generate_with_pcp_wider_than_dcp_is_the_compositions(family):
    """generate(pcp_size > dcp_size) runs the step loop for V4 and hybrid models now; the composition called
    explicitly agrees (tokens equal, logits and prompt logits to 1e-9)."""
    from cpattn.engine.batch import Prompts
    from cpattn.engine.composed import composed
    from cpattn.engine.driver import engine_configs, generate, step_loop_runs
    from cpattn.models.family import get_family

    cfg, params = model(family)
    prompts = [prompt(n, 60 + n) for n in (13, 1, 9)]
    pre, dec = engine_configs(family, cfg, pcp_size=3, dcp_size=2, block_size=4)
    assert step_loop_runs(get_family(family), cfg, pre, dec)
    want = composed(get_family(family), params, cfg, Prompts.of(prompts), 4, prefill=pre, decode=dec)
    got = generate(family, params, cfg, prompts, 4, prefill=pre, decode=dec)
    assert torch.equal(got.tokens, want.tokens)
    assert got.logits.shape == want.logits.shape and torch.allclose(got.logits, want.logits, rtol=1e-9, atol=1e-9)
    assert torch.allclose(got.prompt_logits, want.prompt_logits, rtol=1e-9, atol=1e-9)
    assert got.stats.steps == want.stats.steps == 3 and got.facts.kv_bytes > 0  # decode steps


def test_a_kv_connector_with_pcp_wider_than_dcp_stays_refused():
    """The ranks past N hold no blocks, so a P/D connector is refused in one line (V4 and hybrid as paged)."""
    from cpattn.engine.connector_pd import PDConnector

    for family in ("deepseek_v4", "qwen3_next"):
        cfg, params = model(family)
        with pytest.raises(ValueError, match="pcp_size=3 with dcp_size=2: a P/D connector hands a producer rank"):
            engine_of(family, 3, 2, kv_connector=PDConnector())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_gloo_ranks_outside_the_dcp_group_hold_no_state(one_device, family):
    """Real processes (gloo): PCP 3, DCP 2 on 3 ranks; every rank the oracle's tokens, rank 2 no bytes, no
    block left."""
    from cpattn.comm.launch import spawn
    from test_engine_loop_pcp_wide import model as seed3, wide_rank

    cfg, params = seed3(family)  # what wide_rank builds on each rank
    reqs = schedule(family, 3)
    kwargs = dict(block_size=4, num_blocks=6, graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=dict(max_num_batched_tokens=BUDGET[family], max_num_seqs=4, enable_prefix_caching=False,
                                 enable_chunked_prefill=family != "deepseek_v4"))
    per_rank = spawn(3, wide_rank, family, cfg, 2, reqs, kwargs)
    want = {i: one_device.tokens(family, params, cfg, r["prompt"], MAX_TOKENS)[: r["max_tokens"]]
            for i, r in enumerate(reqs)}
    assert [got for got, _, _ in per_rank] == [want] * 3
    assert [kv == 0 for _, kv, _ in per_rank] == [False, False, True]
    assert [used for _, _, used in per_rank] == [0, 0, 0]
