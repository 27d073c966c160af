"""DeepSeek-V4 and a hybrid model (Qwen3-Next) in one LLMEngine with 1 < pcp_size < dcp_size: a step's prompts
(V4: whole) or prefill chunks (hybrid) run PCP over the first pcp_size ranks of the DCP group, the other ranks
compute none of their rows, and the decodes run DCP over all dcp_size ranks.

V4 (:mod:`cpattn.engine.runner_v4_pcp`): DCP rank d >= P gets each prefilled request's share of the V4 state
(ring rows, the compressed entries it owns) from PCP rank d % P; hybrid (:mod:`cpattn.engine.runner_hybrid_pcp`):
the chunk's KV rows go to their DCP owners, the linear layers' states after the chunk (replicated) come from
DCP rank 0. The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone, float64 weights,
so the tokens must be equal. Requests arrive at different steps (mixed steps: a prefill with decodes), prompts
of 1 token (shorter than P) to 30; hybrid prompts are cut into chunks by a budget of 5 tokens (boundaries inside
the conv kernel's width); a small block pool forces preemptions (recompute under PCP again); freed slots and
blocks are NaN-poisoned; uniform decode steps replay a captured program in the captured cases. Every rank's
logits are checked equal at every step, and only the sub-group's ranks run the prefill. Then n-gram drafts with
prompt logits (DCP rank 0's, against one device's), drafters reading hidden states (DSpark, Qwen3-Next MTP),
real gloo processes, and the one refusal (a V4 P/D producer over a sub-group). Neither family has prefix
caching in the step loop (V4: no per-token blocks; hybrid: no state snapshots), so no prefix hit here.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import check_schedule, checked_logits, record_group_calls

from cpattn.config import SchedulerConfig
from cpattn.engine import runner_hybrid_pcp
from cpattn.engine.llm import LLMEngine
from cpattn.models.family import get_family

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
MAX_TOKENS = 6
BUDGET = {"deepseek_v4": 48, "qwen3_next": 5}  # V4: a whole prompt (<= 30) + max_tokens - 1 in one step


@functools.lru_cache(maxsize=None)
def model(family: str, heads: int | None = None):
    """The tiny config (``heads`` query heads: 6 lets DCP 3 divide them), float64 weights (Qwen3-Next: std 0.2,
    so the linear states move the logits)."""
    fam = get_family(family)
    cfg = fam.config_class.tiny(**({} if heads is None else {"num_attention_heads": heads}))
    extra = {"std": 0.2} if family == "qwen3_next" else {}
    return cfg, fam.init_params(cfg, seed=1, dtype=torch.float64, **extra)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def schedule(family: str, pcp: int) -> list[dict]:
    """Six requests over steps 0..5: prompts around V4's window 8 and ratios 4 / 16, one of pcp - 1 tokens; the
    first two outgrow their blocks while the third holds the last one (a preemption)."""
    lens, arrive, max_tokens = (10, 9, max(1, pcp - 1), 30, 5, 9), (0, 0, 1, 2, 6, 5), (6, 5, 4, 6, 3, 6)
    return [{"prompt": prompt(n, 40 + s), "arrive": a, "max_tokens": m}
            for s, (n, a, m) in enumerate(zip(lens, arrive, max_tokens))]


@pytest.fixture
def prefill_calls(monkeypatch):
    """Every prefill call of the V4 backend / the hybrid PCP chunks: (group rank, group size), from every rank."""
    v4 = type(get_family("deepseek_v4").backend)  # a frozen dataclass: its class's method
    calls = record_group_calls(monkeypatch, v4, "prefill", group_arg=1)
    return record_group_calls(monkeypatch, runner_hybrid_pcp, "hybrid_prefill", calls=calls)


CASES = [  # family, pcp, dcp, heads, captured, num_blocks (of dcp * 4 tokens: 48 or 36 of KV accounting)
    ("deepseek_v4", 2, 4, None, False, 3),
    ("deepseek_v4", 2, 3, 6, True, 3),  # P does not divide N: DCP rank 2 gets its shares from PCP rank 0
    ("qwen3_next", 2, 4, None, True, 3),
    ("qwen3_next", 2, 3, 6, False, 3),
    pytest.param("deepseek_v4", 2, 4, None, True, 3, marks=pytest.mark.slow),
    pytest.param("deepseek_v4", 2, 3, 6, False, 3, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 2, 4, None, False, 3, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 2, 3, 6, True, 3, marks=pytest.mark.slow),
    pytest.param("deepseek_v4", 3, 4, None, True, 3, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 3, 4, None, False, 3, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,pcp,dcp,heads,captured,num_blocks", CASES)
def test_pcp_over_a_sub_group_gives_one_device_greedy_tokens(one_device, prefill_calls, family, pcp, dcp, heads,
                                                             captured, num_blocks):
    cfg, params = model(family, heads)
    v4 = family == "deepseek_v4"
    sched = SchedulerConfig(max_num_batched_tokens=BUDGET[family], max_num_seqs=4, enable_prefix_caching=False,
                            enable_chunked_prefill=not v4)
    graph = dict(graph_mode="FULL_DECODE_ONLY", graph_backend="eager") if captured else {}
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=pcp, block_size=4, num_blocks=num_blocks,
                       poison=True, scheduler=sched, **graph)
    group = [r.prefill_group if v4 else r.pcp_group for r in engine.runners]
    assert [g is None for g in group] == [False] * pcp + [True] * (dcp - pcp)
    assert {g.size for g in group[:pcp]} == {pcp}
    rows = checked_logits(engine)
    reqs = schedule(family, pcp)
    steps = check_schedule(engine, reqs, lambda r: one_device.tokens(family, params, cfg, r["prompt"],
                                                                     MAX_TOKENS)[: r["max_tokens"]])
    check_steps(engine, steps, v4, captured, rows)
    for r in engine.runners:
        assert r.live == 0
    # only the PCP sub-group prefilled: pcp calls per PCP step
    assert {size for _, size in prefill_calls} == {pcp}
    assert sorted(r for r, _ in prefill_calls) == sorted(list(range(pcp)) * engine.stats.pcp_steps)


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_drafts_and_prompt_logits_under_a_sub_group(one_device, family):
    """n-gram drafts (k = 2) verified by the DCP decode after a sub-group's prefill; every prompt row's logits
    (DCP rank 0's, handed to every rank) close to one device's; tokens one device's."""
    from cpattn.drafters.ngram import NgramDrafter

    cfg, params = model(family)
    v4 = family == "deepseek_v4"
    sched = SchedulerConfig(max_num_batched_tokens=BUDGET[family], max_num_seqs=4, enable_prefix_caching=False,
                            enable_chunked_prefill=not v4)
    engine = LLMEngine(family, params, cfg, dcp_size=4, pcp_size=2, block_size=4, num_blocks=16, scheduler=sched,
                       drafter=NgramDrafter(), num_speculative_tokens=2, return_prompt_logits=True)
    check_drafts_and_prompt_logits(one_device, engine, family)


def check_steps(engine, steps, v4: bool, captured: bool, rows: list[int]) -> None:
    """What the schedule must have exercised: a mixed step, a preemption, a PCP step per prefill step, for hybrid
    models a partial chunk and a chunk boundary inside the conv kernel's width, replays when captured, and
    checked rank logits."""
    s = engine.stats
    assert any(any(o.is_prefill) and not all(o.is_prefill) for o, _ in steps), "no mixed step ran"
    prefills = [o for o, _ in steps if any(o.is_prefill)]
    assert s.preemptions > 0, "the small block pool should force a preemption (recompute)"
    assert s.pcp_steps == len(prefills) > 0, s
    if not v4:
        assert any(p and not d for o in prefills for p, d in zip(o.is_prefill, o.samples)), "no partial chunk ran"
        assert any(0 < c < 3 for o in prefills for c, p in zip(o.context_lens, o.is_prefill) if p), \
            "no chunk boundary inside the conv kernel's width"
    if captured:
        assert s.replayed_steps > 0 and s.eager_steps > 0, s
    assert rows[0] > 0


def check_drafts_and_prompt_logits(one_device, engine, family: str) -> None:
    """Two repetitive prompts through ``engine`` (an n-gram drafter, prompt logits kept): tokens one-device greedy,
    the prompt logits computed so far within 1e-9 of one device's, drafts proposed, PCP steps run."""
    from cpattn.engine.llm import SamplingParams

    cfg, params = model(family)
    prompts = [(prompt(5, 3) * 3)[:13], (prompt(4, 5) * 3)[:9]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    got: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logits is not None:
                got.setdefault(o.request_id, []).append(o.prompt_logits)
    for rid, p in zip(ids, prompts):
        assert list(engine.scheduler.requests[rid].output) == one_device.tokens(family, params, cfg, p, MAX_TOKENS)
        want = one_device(family, params, cfg, [p], 1).prompt_logits  # [L, V]
        rows = got[rid][-1]  # [m, V] the prompt's last m positions, as computed so far
        assert rows.shape[0] > 0 and torch.allclose(rows, want[-rows.shape[0]:], rtol=1e-9, atol=1e-9), rid
    s = engine.stats
    assert s.pcp_steps > 0 and s.drafted_tokens > 0, s

@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_gloo_ranks_run_a_sub_groups_prefill(one_device, family):
    """Real processes (gloo: Group.split, V4 shares over send / recv, rank 0's states over all-reduce): every
    rank gets the oracle's tokens."""
    from cpattn.comm.launch import spawn
    from engine_loop_cases import gloo_rank

    fam = get_family(family)
    cfg = fam.config_class.tiny()
    params = fam.init_params(cfg, seed=1, dtype=torch.float64)  # what gloo_rank builds on each rank
    reqs = schedule(family, 2)
    v4 = family == "deepseek_v4"
    kwargs = dict(pcp_size=2, block_size=4, num_blocks=3, graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=dict(max_num_batched_tokens=BUDGET[family], max_num_seqs=4, enable_prefix_caching=False,
                                 enable_chunked_prefill=not v4))
    per_rank = spawn(4, gloo_rank, family, cfg, 1, reqs, kwargs)
    want = {i: one_device.tokens(family, params, cfg, r["prompt"], MAX_TOKENS)[: r["max_tokens"]]
            for i, r in enumerate(reqs)}
    assert all(got == want for got in per_rank), per_rank


def test_a_v4_pd_producer_over_a_sub_group_is_refused():
    """A P/D producer stages the prefilled state on every rank (PDEngine builds it with pcp_size = dcp_size); a
    runner with 1 < pcp_size < dcp_size and a producer's connector is refused in one line."""
    import types

    import cpattn
    from cpattn.engine.runner_v4 import V4StepRunner

    cfg, params = model("deepseek_v4")
    producer = types.SimpleNamespace(side=types.SimpleNamespace(role="kv_producer"))

    def rank(g):
        try:
            V4StepRunner(g, "deepseek_v4", params, cfg, num_blocks=4, block_size=4, max_model_len=32, pcp_size=2,
                         connector=producer)
        except ValueError as e:
            return str(e)

    assert set(cpattn.simulate(4, rank)) == {"pcp_size=2 with dcp_size=4: a V4 P/D producer stages the prefill's "
                                             "state on every rank; pass pcp_size=1 or the producer's dcp_size"}


@pytest.mark.slow
def test_hidden_state_drafters_read_rank0s_rows_under_a_sub_group(one_device):
    """Drafters reading the target's hidden states under PCP 2 + DCP 4: DSpark on V4 (every handed row equal to
    the one-device prefill's, tokens one device's, drafts accepted and rejected) and Qwen3-Next's MTP (an
    identity head on repeating continuations: lossless, drafts accepted; chunked prompts, the hidden rows over
    several steps)."""
    import test_engine_loop_v4_drafters as v4d
    import test_hybrid_mtp as mtp

    rec = v4d.Recorder(v4d.random_head())
    sched = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4, enable_chunked_prefill=False,
                            enable_prefix_caching=False)
    eng = LLMEngine("deepseek_v4", v4d.v4_target(), v4d.CFG, dcp_size=4, pcp_size=2, block_size=4, num_blocks=12,
                    scheduler=sched, drafter=rec, num_speculative_tokens=2)
    prompts = v4d.arrival_prompts()
    assert v4d.run_arrivals(eng, prompts) == [v4d.oracle(tuple(p), v4d.MAX_TOKENS) for p in prompts]
    s = eng.stats
    assert s.pcp_steps > 0 and 0 < s.accepted_tokens < s.drafted_tokens, s
    v4d.check_hidden(rec)

    cfg, params = mtp.model()
    eng = LLMEngine("qwen3_next", params, cfg, dcp_size=4, pcp_size=2, block_size=4, num_blocks=16,
                    scheduler=mtp.sched(max_num_batched_tokens=8), drafter=mtp.identity_head(),
                    num_speculative_tokens=2)
    reqs = mtp.prompts()
    assert mtp.run(eng, reqs) == [mtp.greedy(one_device, tuple(p))[:mtp.TOKENS] for p in reqs]
    assert eng.stats.pcp_steps > 0 and eng.stats.accepted_tokens > 0, eng.stats
