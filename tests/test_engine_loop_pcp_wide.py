"""One LLMEngine with pcp_size > dcp_size (``cpattn.engine.runner_wide``): a world of P ranks whose DCP group is
its first N ranks. Only those hold a KV cache; a step's prefill chunks run PCP over all P ranks (the context
gathered from the DCP shards, new rows sent to their DCP owners); the decodes run DCP over the first N ranks;
ranks N..P-1 run the same scheduler, hold no KV bytes and take DCP rank 0's logits.

The oracle: the one-device greedy recompute (``one_device`` fixture, tests/ref/greedy.py) of each request alone,
float64 tiny models, so the tokens must be equal. Requests arrive at different steps; prompts of 1..30 tokens
are chunked by a budget of 12-16 tokens (several steps each, partial chunks); two share a prefix (a prefix hit:
the chunk's context gathered from the shards); blocks are NaN-poisoned; uniform decodes replay a captured
program where asked. Every rank's logits equal rank 0's at every step, the ranks outside the DCP group never
run a DCP step (their step function raises), every rank prefills every PCP step over the whole world, and no
block stays in use. Then a pool small enough to preempt (recompute in step on every rank), drafts reading
hidden states, the one-line refusals, ``generate`` against the composition (tests/test_step_generate.py has
more) and real gloo processes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import checked_logits, record_group_calls, run_schedule

from cpattn.config import SchedulerConfig
from cpattn.engine import runner_pcp
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.driver import engine_configs, generate, step_loop_runs
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
TOL = dict(rtol=1e-9, atol=1e-9)  # float64: the step loop and the composition sum partials in other orders


@functools.lru_cache(maxsize=None)
def model(family: str):
    fam = get_family(family)
    cfg = fam.config_class.tiny()
    return cfg, fam.init_params(cfg, seed=3, dtype=torch.float64)


def schedule(vocab: int, pcp: int, dcp: int, seed: int = 0) -> list[dict]:
    """Six requests over steps 0..5: 30 and 13 tokens at once (more than a step's budget: partial chunks), one
    token, pcp - 1 tokens, two sharing 8 * dcp + 2 tokens (a prefix hit of whole spans of 4-token blocks)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = toks(8 * dcp + 2)
    return [dict(prompt=toks(30), max_tokens=4, arrive=0), dict(prompt=toks(13), max_tokens=5, arrive=0),
            dict(prompt=toks(1), max_tokens=5, arrive=1), dict(prompt=toks(max(1, pcp - 1)), max_tokens=3, arrive=1),
            dict(prompt=base + toks(3), max_tokens=5, arrive=2), dict(prompt=base + toks(7), max_tokens=4, arrive=5)]


@pytest.fixture
def prefill_calls(monkeypatch):
    """Every PCP prefill call of run_prefill_rows: (PCP group rank, size), from every rank's thread."""
    return record_group_calls(monkeypatch, runner_pcp, "prefill")


def check_layout(engine: LLMEngine, pcp: int, dcp: int) -> None:
    """P runners over one world of P; the first N hold a cache and a DCP group of N, the others neither."""
    runners = engine.runners
    assert len(runners) == pcp and {r.world.size for r in runners} == {pcp}
    assert all(r.pcp_group is r.world for r in runners)
    assert [r.group is None for r in runners] == [False] * dcp + [True] * (pcp - dcp)
    assert {r.group.size for r in runners[:dcp]} == {dcp}
    assert [r.kv_bytes() == 0 for r in runners] == [False] * dcp + [True] * (pcp - dcp)
    assert all(r.graph is None for r in runners[dcp:])


def expected(one_device, family: str, sched: list[dict]):
    cfg, params = model(family)
    return lambda r: one_device.tokens(family, params, cfg, r["prompt"], r["max_tokens"])


CASES = [  # family, pcp, dcp, interleave, budget, graph_mode
    ("qwen3", 2, 1, 1, 12, "FULL_DECODE_ONLY"),  # PCP 2 prefill, one-rank decode
    ("qwen3", 4, 2, 2, 16, "NONE"),
    ("deepseek_v3", 3, 2, 1, 12, "FULL_DECODE_ONLY"),  # MLA: values in the keys; N does not divide P
    ("deepseek_v32", 4, 2, 1, 16, "NONE"),  # DSA-CP chunks, indexer keys paged on the DCP ranks only
    ("qwen3", 3, 2, 1, 12, "FULL_DECODE_ONLY"),
    pytest.param("qwen3", 4, 2, 4, 16, "FULL_DECODE_ONLY", marks=pytest.mark.slow),
    ("deepseek_v2", 2, 1, 2, 12, "FULL_DECODE_ONLY"),  # MLA, one-rank decode
    pytest.param("deepseek_v32", 2, 1, 1, 12, "FULL_DECODE_ONLY", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 4, 2, 1, 16, "NONE", marks=pytest.mark.slow),
    pytest.param("glm_moe_dsa", 3, 2, 2, 16, "NONE", marks=pytest.mark.slow),  # DSA with shared top-k layers
]


@pytest.mark.parametrize("family,pcp,dcp,interleave,budget,graph_mode", CASES)
def test_pcp_wider_than_dcp_gives_one_device_greedy_tokens(family, pcp, dcp, interleave, budget, graph_mode,
                                                           prefill_calls, one_device):
    cfg, params = model(family)
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, interleave_size=interleave,
                       graph_mode=graph_mode, num_blocks=40, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4))
    check_layout(engine, pcp, dcp)
    rows = checked_logits(engine, dcp)
    sched = schedule(cfg.vocab_size, pcp, dcp)
    want = expected(one_device, family, sched)
    ids, steps = run_schedule(engine, sched)
    for i, rid in ids.items():
        got = list(engine.scheduler.requests[rid].output)
        assert got == want(sched[i]), f"request {i} (prompt {len(sched[i]['prompt'])} tokens): {got}"
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    assert s.pcp_steps > 0 and s.eager_steps > 0 and rows[0] > 0, s
    assert s.prefix_hit_tokens > 0, s  # the shared spans: a chunk whose context comes from the DCP shards
    assert any(p and not d for o, _ in steps for p, d in zip(o.is_prefill, o.samples)), "no partial chunk ran"
    assert any(len(o.req_ids) > 1 and any(o.is_prefill) and not all(o.is_prefill) for o, _ in steps), "no mixed step"
    if graph_mode != "NONE":
        assert s.replayed_steps > 0 and engine.runners[0].graph.stats.graph == s.replayed_steps, s
    # every rank of the world prefilled every PCP step, as a PCP group of P
    assert {size for _, size in prefill_calls} == {pcp}
    assert sorted(r for r, _ in prefill_calls) == sorted(list(range(pcp)) * s.pcp_steps)
    assert [r.kv_bytes() == 0 for r in engine.runners] == [False] * dcp + [True] * (pcp - dcp)


@pytest.mark.parametrize("family,pcp,dcp", [("qwen3", 4, 2), ("deepseek_v3", 2, 1)])
def test_preemption_recomputes_in_step_on_every_rank(family, pcp, dcp, one_device):
    """A pool too small for the running requests: the newest is preempted and recomputed (a PCP prefill again),
    every rank's scheduler in step (the engine checks every rank samples rank 0's tokens), tokens exact."""
    cfg, params = model(family)
    g = torch.Generator().manual_seed(5)
    sched = [dict(prompt=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), max_tokens=6, arrive=0)
             for n in (9, 11, 7)]
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=2, num_blocks=14 // dcp,
                       poison=True, scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3))
    checked_logits(engine, dcp)
    ids, _ = run_schedule(engine, sched)
    want = expected(one_device, family, sched)
    for i, rid in ids.items():
        assert list(engine.scheduler.requests[rid].output) == want(sched[i]), i
    s = engine.stats
    assert s.preemptions > 0 and s.pcp_steps > 0 and s.blocks_used == 0, s


def test_elastic_short_chunks_run_dcp_with_the_decodes(one_device):
    """pcp_policy="elastic": chunks shorter than pcp_min_tokens run DCP on the first N ranks with the decodes
    (no data-parallel prefill over the world: its ranks past N hold no cache), the rest PCP over all P."""
    cfg, params = model("qwen3")
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=3, block_size=4, num_blocks=40, poison=True,
                       pcp_policy="elastic", pcp_min_tokens=8,
                       scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4))
    checked_logits(engine, 2)
    sched = schedule(cfg.vocab_size, 3, 2, seed=1)
    ids, steps = run_schedule(engine, sched)
    want = expected(one_device, "qwen3", sched)
    for i, rid in ids.items():
        assert list(engine.scheduler.requests[rid].output) == want(sched[i]), i
    s = engine.stats
    assert s.pcp_steps > 0 and s.dp_prefill_steps == 0 and s.blocks_used == 0, s
    assert any(0 < q < 8 for o, _ in steps for q, p in zip(o.query_lens, o.is_prefill) if p), "no short chunk ran"


def test_refusals_name_the_layout(tmp_path):
    """A P/D connector needs every rank's blocks (a pool alone works: tests/test_step_on_rank_pool.py); a world
    of another size; StepRunner's own dcp_size check (DeepSeek-V4 and hybrid runners take this layout too:
    tests/test_engine_loop_pcp_wide_v4_hybrid.py)."""
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.connector import PoolConnector
    from cpattn.engine.connector_pd import PDConnector
    from cpattn.engine.pooling import PoolSpec
    from cpattn.engine.runner import StepRunner

    cfg, params = model("qwen3")
    for connector in (PDConnector(), PoolConnector(PoolSpec(f"lmdb:{tmp_path}")) + PDConnector()):
        with pytest.raises(ValueError, match="a P/D connector hands a producer rank's blocks to a consumer rank"):
            LLMEngine("qwen3", params, cfg, dcp_size=1, pcp_size=2, block_size=4, interleave_size=4,
                      kv_connector=connector)
    with pytest.raises(ValueError, match="world: a group of 2 ranks, but the config's max.pcp_size, dcp_size. is 4"):
        LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=4, world=SimMesh(2).groups()[0])
    with pytest.raises(ValueError, match="pass dcp_size in 1..1 with pcp_size=1"):
        StepRunner(SimMesh(1).groups()[0], "qwen3", params, cfg, num_blocks=4, block_size=4, max_model_len=8,
                   dcp_size=2)


@pytest.mark.parametrize("family,pcp,dcp", [("qwen3", 3, 2), pytest.param("deepseek_v32", 2, 1,
                                                                          marks=pytest.mark.slow)])
def test_generate_with_pcp_wider_than_dcp_is_the_compositions(family, pcp, dcp):
    """generate(pcp_size > dcp_size) runs the step loop now; the composition called explicitly agrees."""
    cfg, params = model(family)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 1, 9)]
    pre, dec = engine_configs(family, cfg, pcp_size=pcp, dcp_size=dcp, block_size=4)
    assert step_loop_runs(get_family(family), cfg, pre, dec)
    want = composed(get_family(family), params, cfg, Prompts.of(prompts), 4, prefill=pre, decode=dec)
    got = generate(family, params, cfg, prompts, 4, prefill=pre, decode=dec)
    assert torch.equal(got.tokens, want.tokens)
    assert got.logits.shape == want.logits.shape and torch.allclose(got.logits, want.logits, **TOL)
    assert torch.allclose(got.prompt_logits, want.prompt_logits, **TOL)
    assert got.stats.steps == want.stats.steps == 3 and got.facts.kv_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("method,pcp,dcp", [("eagle3", 4, 2), ("mtp", 2, 1)])
def test_drafters_reading_hidden_states_get_rank0s_rows(method, pcp, dcp):
    """A head reading the target's hidden states (Eagle3 on Qwen3, MTP on DeepSeek-V3) with PCP wider than DCP:
    the ranks outside the DCP group get DCP rank 0's decode hidden rows; tokens are one-device greedy, every
    proposal the head's drafts recomputed from scratch, drafts get accepted."""
    from spec_methods_cases import TARGET_OF, Recorder, head, prompts, reference_drafts, target

    from ref.greedy import ONE_DEVICE

    name, cfg, params = target(TARGET_OF[method])
    drafter = Recorder(head(method))
    sched = [dict(prompt=p, max_tokens=6, arrive=i) for i, p in enumerate(prompts(name))]
    engine = LLMEngine(name, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, num_blocks=24, poison=True,
                       drafter=drafter, num_speculative_tokens=2,
                       scheduler=SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3))
    ids, _ = run_schedule(engine, sched)
    for i, rid in ids.items():
        want = ONE_DEVICE.tokens(name, params, cfg, sched[i]["prompt"], 6)
        assert list(engine.scheduler.requests[rid].output) == want, (method, i)
    s = engine.stats
    assert s.pcp_steps > 0 and s.drafted_tokens > 0 and s.accepted_tokens > 0 and s.blocks_used == 0, s
    for histories, drafts in drafter.log:
        for h, d in zip(histories, drafts):
            assert d == reference_drafts(drafter.drafter, name, params, cfg, h, 2), (method, len(h))


def wide_rank(group, family: str, cfg, dcp: int, sched: list[dict], kwargs: dict) -> tuple[dict, int, int]:
    """One torchrun-style rank of a world of P: (its tokens per request, its KV bytes, blocks in use)."""
    params = get_family(family).init_params(cfg, seed=3, dtype=torch.float64)
    engine = LLMEngine(family, params, cfg, world=group, dcp_size=dcp, pcp_size=group.size,
                       scheduler=SchedulerConfig(**kwargs.pop("scheduler")), **kwargs)
    ids, _ = run_schedule(engine, sched)
    return ({i: list(engine.scheduler.requests[rid].output) for i, rid in ids.items()}, engine.runners[0].kv_bytes(),
            engine.stats.blocks_used)


@pytest.mark.slow
def test_gloo_ranks_outside_the_dcp_group_hold_no_kv(one_device):
    """Real processes (gloo): PCP 3, DCP 2; every rank the oracle's tokens, rank 2 no KV bytes, no block left."""
    from cpattn.comm.launch import spawn

    cfg, params = model("qwen3")
    sched = schedule(cfg.vocab_size, 3, 2, seed=3)
    kwargs = dict(block_size=4, num_blocks=40, graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=dict(max_num_batched_tokens=12, max_num_seqs=4))
    per_rank = spawn(3, wide_rank, "qwen3", cfg, 2, sched, kwargs)
    want = {i: one_device.tokens("qwen3", params, cfg, r["prompt"], r["max_tokens"]) for i, r in enumerate(sched)}
    assert [got for got, _, _ in per_rank] == [want] * 3
    assert [kv == 0 for _, kv, _ in per_rank] == [False, False, True]
    assert [used for _, _, used in per_rank] == [0, 0, 0]
