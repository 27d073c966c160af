"""Hybrid linear-attention models in the step loop (LLMEngine over HybridStepRunner) against one-device generation.

The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone: each token the argmax of a
fresh one-device full prefill's last row (dense KV, zero linear states; no cache carried, no step loop), float64
weights of the tiny Qwen3-Next config
(linear, full, linear, linear; conv kernel 4). Whatever the arrivals, the token budget (so where prompts are
cut into chunks: boundaries inside the conv kernel's width too), the batch mix, preemptions (recompute) and
aborts, each request's tokens must equal it, for layouts 1, DCP 2 and PCP 2 + DCP 2 (every prefill chunk under
PCP: ring attention over the cached context, the linear scan from the request's slot). A freed slot is
NaN-poisoned, so a read of a finished or preempted request's state, or a chunk that did not continue its
request's state, turns the tokens wrong.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import check_schedule, run_arrivals
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpattn.config import SchedulerConfig
from cpattn.engine.llm import LLMEngine
from cpattn.models import qwen3_5, qwen3_next as qn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
MAX_TOKENS = 6
LAYOUTS = {"one": (1, 1), "dcp2": (2, 1), "pcp2_dcp2": (2, 2)}
BUDGET = 7  # small: prompts are cut into chunks, and a step's decodes leave chunks of 1 or 2 tokens (< K - 1 = 3)


def sched(**over) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": BUDGET, "max_num_seqs": 4, "enable_prefix_caching": False,
                              **over})


@functools.lru_cache(maxsize=None)
def model(family: str = "qwen3_next"):
    """The tiny config of ``family``, float64 weights (std 0.2: the states move the logits)."""
    mod = qn if family == "qwen3_next" else qwen3_5
    cfg = (qn.Qwen3NextConfig if family == "qwen3_next" else qwen3_5.Qwen3_5Config).tiny()
    return cfg, mod.init_params(cfg, seed=1, std=0.2, dtype=torch.float64)


def reference(one_device, prompt: tuple[int, ...], family: str = "qwen3_next") -> list[int]:
    """MAX_TOKENS one-device greedy tokens of ``prompt`` alone (``one_device``: conftest.py's session oracle)."""
    cfg, params = model(family)
    return one_device.tokens(family, params, cfg, list(prompt), MAX_TOKENS)


def expected(one_device, req: dict, family: str = "qwen3_next") -> list[int]:
    ref = reference(one_device, tuple(req["prompt"]), family)[: req["max_tokens"]]
    for j, t in enumerate(ref):
        if t in req.get("stop", ()):
            return ref[: j + 1]
    return ref


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(layout: str, num_blocks: int, family: str = "qwen3_next", **kw) -> LLMEngine:
    cfg, params = model(family)
    n, pcp = LAYOUTS[layout]
    return LLMEngine(family, params, cfg, dcp_size=n, pcp_size=pcp, block_size=4, num_blocks=num_blocks,
                     scheduler=kw.pop("scheduler", sched()), poison=True, **kw)


def check_run(one_device, eng: LLMEngine, schedule: list[dict], family: str = "qwen3_next") -> list:
    """Run the schedule (:func:`engine_loop_cases.check_schedule`); assert too that no slot leaks."""
    steps = check_schedule(eng, schedule, lambda req: expected(one_device, req, family))
    for r in eng.runners:
        assert r.live == 0 and sorted(r._free) == list(range(eng.scheduler_config.max_num_seqs))
        assert all(bool(t.isnan().all()) for t in (*r.states.conv, *r.states.state)), "a slot left unpoisoned"
    return steps


def staggered(one_device) -> list[dict]:
    """Five requests arriving over five steps, prompts of 5 to 17 tokens (several chunks each at budget 7)."""
    lens, arrive, max_tokens = (5, 13, 9, 17, 11), (0, 0, 2, 3, 5), (6, 6, 6, 5, 4)
    reqs = [{"prompt": prompt(n, s), "arrive": a, "max_tokens": m}
            for s, (n, a, m) in enumerate(zip(lens, arrive, max_tokens))]
    reqs[2]["abort"] = 11  # after some tokens, in every layout
    last = reference(one_device, tuple(reqs[4]["prompt"]))[:4]
    assert last[3] not in last[:3]
    reqs[4]["stop"] = (last[3],)  # its 4th (last) token: "stop" wins over "length", the schedule unchanged
    return reqs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staggered_chunked_schedule_matches_one_device(one_device, layout):
    n = LAYOUTS[layout][0]
    eng = engine(layout, num_blocks=8 // n)  # 32 tokens of KV accounting: the requests do not all fit
    schedule = staggered(one_device)
    steps = check_run(one_device, eng, schedule)
    s = eng.stats
    assert s.preemptions > 0, "the small block pool should force a preemption (recompute)"
    assert any(any(o.is_prefill) and not all(o.is_prefill) for o, _ in steps), "no mixed step ran"
    chunks = [(o.context_lens[b], o.query_lens[b]) for o, _ in steps for b in range(len(o.req_ids))
              if o.is_prefill[b]]
    # a chunk continuing after 1 or 2 tokens: its conv window (K = 4) spans the boundary and the zeros before
    assert any(0 < c < 3 for c, q in chunks), "no chunk boundary inside the conv kernel's width"
    assert any(c > 0 and c % 4 and q > 1 for c, q in chunks), "no chunk continuing mid-block"
    assert s.pcp_steps == (0 if LAYOUTS[layout][1] == 1 else len([o for o, _ in steps if any(o.is_prefill)]))
    reasons = {i: eng.scheduler.requests[i].finish_reason for i in range(len(schedule))}
    assert reasons == {0: "length", 1: "length", 2: "abort", 3: "length", 4: "stop"}, reasons
    assert 0 < len(eng.scheduler.requests[2].output) < 6  # aborted after some tokens


@pytest.mark.parametrize("layout", ["one", "dcp2"])
def test_eager_captured_decode_replays_uniform_steps(one_device, layout):
    reqs = [{"prompt": prompt(n, 10 + n), "arrive": a, "max_tokens": MAX_TOKENS} for n, a in ((11, 0), (6, 0), (3, 3))]
    eng = engine(layout, num_blocks=40, graph_mode="FULL_DECODE_ONLY", graph_backend="auto")  # auto: eager here
    check_run(one_device, eng, reqs)
    assert eng.stats.replayed_steps > 0 and eng.stats.eager_steps > 0, eng.stats


def test_qwen3_5_dcp2_matches_one_device(one_device):
    reqs = [{"prompt": prompt(n, 30 + n), "arrive": a, "max_tokens": MAX_TOKENS} for n, a in ((12, 0), (5, 1), (9, 2))]
    check_run(one_device, engine("dcp2", num_blocks=6, family="qwen3_5"), reqs, family="qwen3_5")


def test_refused_at_construction():
    cfg, params = model()
    cases = [(dict(scheduler=sched(enable_prefix_caching=True)), "enable_prefix_caching=True"),
             (dict(scheduler=SchedulerConfig()), "enable_prefix_caching=True"),  # the paged defaults
             (dict(scheduler=sched(), kv_pool="mem"), "kv_pool"),
             (dict(scheduler=sched(), graph_mode="FULL_DECODE_ONLY", graph_backend="inductor"), "graph backend")]
    for kw, what in cases:
        with pytest.raises(ValueError, match=what) as e:
            LLMEngine("qwen3_next", params, cfg, block_size=4, num_blocks=16, **kw)
        msg = str(e.value)
        assert "\n" not in msg and ("pass" in msg or "use" in msg), msg
    eng = LLMEngine("qwen3_next", params, cfg, block_size=4, num_blocks=64)  # None: prefix caching off
    assert not eng.scheduler_config.enable_prefix_caching and eng.scheduler_config.enable_chunked_prefill


requests = st.lists(st.fixed_dictionaries({
    "len": st.integers(1, 20), "max_tokens": st.integers(1, MAX_TOKENS), "arrive": st.integers(0, 6),
    "abort": st.one_of(st.none(), st.integers(0, 10))}), min_size=1, max_size=4)


def run_property(one_device, layout: str, reqs: list[dict], num_blocks: int, budget: int,
                 seed: int) -> None:
    schedule = [{"prompt": prompt(r["len"], 1000 * seed + i), "arrive": r["arrive"], "max_tokens": r["max_tokens"],
                 **({} if r["abort"] is None else {"abort": r["abort"]})} for i, r in enumerate(reqs)]
    eng = engine(layout, num_blocks=num_blocks // LAYOUTS[layout][0], scheduler=sched(max_num_batched_tokens=budget))
    check_run(one_device, eng, schedule)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(8, 20), budget=st.integers(2, 12), seed=st.integers(0, 3))
def test_property_arrivals_budgets_and_lengths(one_device, reqs, num_blocks, budget, seed):
    run_property(one_device, "one", reqs, num_blocks, budget, seed)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(8, 20), budget=st.integers(2, 12), seed=st.integers(0, 50),
       layout=st.sampled_from(list(LAYOUTS)))
def test_property_arrivals_budgets_and_lengths_all_layouts(one_device, reqs, num_blocks, budget, seed, layout):
    run_property(one_device, layout, reqs, num_blocks, budget, seed)


def test_serve_builds_a_hybrid_engine_without_prefix_caching():
    """``cpattn serve --model-type qwen3_next``: the server's scheduler config (prefix caching on) is turned off
    for a hybrid family, and the engine serves a request."""
    from cpattn.serve.cli import build_engine, check_args, parser

    a = parser().parse_args(["--model-type", "qwen3_next", "--dcp", "2"])
    eng = build_engine(a, check_args(a))
    assert type(eng.runners[0]).__name__ == "HybridStepRunner" and not eng.scheduler_config.enable_prefix_caching
    (out,) = eng.generate([[1, 2, 3, 4, 5]])
    assert out.finished and len(out.token_ids) > 0 and eng.stats.blocks_used == 0


@pytest.mark.slow  # seeded sampling over every layout (~1.5 s): slow lane; the greedy layouts stay fast
def test_seeded_sampling_is_the_same_whatever_the_layout_and_preemptions(one_device):
    """temperature > 0: a token is a pure function of the logits, the seed and its output index, so one device
    with room for everything, DCP 2 and PCP 2 + DCP 2 with a pool that preempts give the same tokens."""
    from cpattn.engine.llm import SamplingParams

    reqs = [{"prompt": prompt(n, 20 + n), "arrive": a} for n, a in ((7, 0), (15, 0), (10, 1), (4, 2))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=40, seed=100 + i) for i in range(4)]

    def run(layout, num_blocks):
        return run_arrivals(engine(layout, num_blocks=num_blocks), reqs, params)

    one, none = run("one", 64)
    assert none == 0
    assert one != [expected(one_device, {"prompt": r["prompt"], "max_tokens": MAX_TOKENS}) for r in reqs]  # not greedy
    for layout in ("dcp2", "pcp2_dcp2"):
        got, preempted = run(layout, 4)
        assert preempted > 0 and got == one, (layout, got, one)
