"""DeepSeek-V4 in the step loop (LLMEngine over V4StepRunner) against one-device greedy generation.

The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone: each token the argmax of
a fresh one-device full prefill's last row (an empty V4Cache; no cache carried, no step loop), float64
weights. Whatever the arrivals, the batch mix (decodes and a new prefill in one step), preemptions
(recompute) and aborts, each request's tokens must equal it, for layouts 1, DCP 2 and PCP 2 + DCP 2. A freed
slot's rows are NaN-poisoned, so a read of a finished or preempted request's state turns the logits NaN and the
tokens wrong.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import check_schedule, run_arrivals
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lanes import examples

from cpattn.config import SchedulerConfig
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.drafters import DraftSettings
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.models import deepseek_v4 as v4

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
MAX_TOKENS = 6
LAYOUTS = {"one": (1, 1), "dcp2": (2, 1), "pcp2_dcp2": (2, 2)}
BUDGET = 48  # a whole prompt (<= 40) + max_tokens - 1 fits one step: V4 prefills a prompt in one chunk


def sched(**over) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": BUDGET, "max_num_seqs": 4, "enable_chunked_prefill": False,
                              "enable_prefix_caching": False, **over})


@functools.lru_cache(maxsize=None)
def model():
    """The tiny V4 config (sliding, CSA, HCA layers; window 8, ratios 4 / 16), float64 weights."""
    cfg = v4.DeepseekV4Config.tiny()
    return cfg, v4.init_params(cfg, seed=1, dtype=torch.float64)


def reference(one_device, prompt: tuple[int, ...]) -> list[int]:
    """MAX_TOKENS one-device greedy tokens of ``prompt`` alone (``one_device``: conftest.py's session oracle)."""
    cfg, params = model()
    return one_device.tokens("deepseek_v4", params, cfg, list(prompt), MAX_TOKENS)


def expected(one_device, req: dict) -> list[int]:
    ref = reference(one_device, tuple(req["prompt"]))[: req["max_tokens"]]
    for j, t in enumerate(ref):
        if t in req.get("stop", ()):
            return ref[: j + 1]
    return ref


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(layout: str, num_blocks: int, **kw) -> LLMEngine:
    cfg, params = model()
    n, pcp = LAYOUTS[layout]
    return LLMEngine("deepseek_v4", params, cfg, dcp_size=n, pcp_size=pcp, block_size=4, num_blocks=num_blocks,
                     scheduler=kw.pop("scheduler", sched()), **kw)


def check_run(one_device, eng: LLMEngine, schedule: list[dict]) -> list:
    """Run the schedule (:func:`engine_loop_cases.check_schedule`); assert too that no runner holds state."""
    steps = check_schedule(eng, schedule, lambda req: expected(one_device, req))
    assert [r.live for r in eng.runners] == [0] * len(eng.runners)
    return steps


def staggered(one_device) -> list[dict]:
    """Five requests arriving over five steps (prompt lengths around the window 8 and the HCA ratio 16)."""
    lens, arrive, max_tokens = (5, 20, 9, 30, 14), (0, 0, 2, 3, 5), (6, 6, 6, 5, 4)
    reqs = [{"prompt": prompt(n, s), "arrive": a, "max_tokens": m}
            for s, (n, a, m) in enumerate(zip(lens, arrive, max_tokens))]
    reqs[2]["abort"] = 4  # while it decodes
    last = reference(one_device, tuple(reqs[4]["prompt"]))[:4]
    assert last[3] not in last[:3]
    reqs[4]["stop"] = (last[3],)  # its 4th (last) token: "stop" wins over "length", the schedule unchanged
    return reqs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staggered_schedule_matches_one_device(one_device, layout):
    n = LAYOUTS[layout][0]
    eng = engine(layout, num_blocks=12 // n)  # 48 tokens of KV accounting: the requests do not all fit
    schedule = staggered(one_device)
    steps = check_run(one_device, eng, schedule)
    s = eng.stats
    assert s.preemptions > 0, "the small block pool should force a preemption (recompute)"
    assert any(any(o.is_prefill) and not all(o.is_prefill) for o, _ in steps), "no mixed step ran"
    assert s.pcp_steps == (0 if LAYOUTS[layout][1] == 1 else len([o for o, _ in steps if any(o.is_prefill)]))
    reasons = {i: eng.scheduler.requests[i].finish_reason for i in range(len(schedule))}
    assert reasons == {0: "length", 1: "length", 2: "abort", 3: "length", 4: "stop"}, reasons
    assert 0 < len(eng.scheduler.requests[2].output) < 6  # aborted after some tokens


def test_lone_one_token_prompt_under_pcp2(one_device):
    """A step whose only prompt is 1 token leaves PCP rank 1 no token: V4's blocks run on t = 0 rows."""
    schedule = [{"prompt": prompt(1, 7), "arrive": 0, "max_tokens": 4}, {"prompt": prompt(6, 8), "arrive": 3,
                                                                        "max_tokens": 3}]
    check_run(one_device, engine("pcp2_dcp2", num_blocks=16), schedule)


class OracleDrafter:
    """Drafts the one-device continuation of each request, every third draft wrong (so some are rejected)."""

    method, settings, hidden_layers = "ngram", DraftSettings(), None

    def __init__(self, one_device, prompts):
        self.one_device, self.prompts = one_device, [tuple(p) for p in prompts]

    def start(self, num_requests, max_len, graph=None):
        return self

    def rollback(self, slots, lens):
        pass

    def propose(self, histories, k, slots, target):
        rows = []
        for h in histories:
            p = next(p for p in self.prompts if tuple(h[:len(p)]) == p and len(h) - len(p) <= MAX_TOKENS)
            done = len(h) - len(p)
            cont = (reference(self.one_device, p) + [0] * k)[done:done + k]
            rows.append([(t + 1) % 64 if (done + j) % 3 == 2 else t for j, t in enumerate(cont)])
        return torch.tensor(rows, dtype=torch.int64).view(len(histories), k)


@pytest.mark.parametrize("layout", ["one", "dcp2"])
def test_drafts_verified_and_decode_steps_replayed(one_device, layout):
    """k = 2 drafts verified by the V4 decode program (rejected ones rewound), uniform decode steps replayed."""
    reqs = [{"prompt": prompt(n, 10 + n), "arrive": a, "max_tokens": MAX_TOKENS} for n, a in ((11, 0), (23, 0), (6, 2))]
    eng = engine(layout, num_blocks=40, drafter=OracleDrafter(one_device, [r["prompt"] for r in reqs]),
                 num_speculative_tokens=2, graph_mode="FULL_DECODE_ONLY", graph_backend="eager")
    steps = check_run(one_device, eng, reqs)
    s = eng.stats
    assert 0 < s.accepted_tokens < s.drafted_tokens, s
    assert s.replayed_steps > 0 and s.eager_steps > 0, s
    assert any(o.uniform_decode for o, r in steps if r)


def test_refused_at_construction_and_add_request():
    cfg, params = model()
    cases = [(dict(scheduler=sched(enable_prefix_caching=True)), "enable_prefix_caching=True"),
             (dict(scheduler=sched(enable_chunked_prefill=True)), "enable_chunked_prefill=True"),
             (dict(scheduler=sched(), kv_pool="mem"), "kv_pool"),
             (dict(scheduler=SchedulerConfig()), "enable_prefix_caching=True")]  # the paged defaults
    for kw, what in cases:
        with pytest.raises(ValueError, match=what) as e:
            LLMEngine("deepseek_v4", params, cfg, block_size=4, num_blocks=16, **kw)
        assert "\n" not in str(e.value) and "pass" in str(e.value)

    class HiddenDrafter(NgramDrafter):
        method, hidden_layers = "mtp", ("norm",)

    # a drafter reading hidden states runs now (tests/test_engine_loop_v4_drafters.py): the final-normed rows
    eng = LLMEngine("deepseek_v4", params, cfg, block_size=4, num_blocks=16, scheduler=sched(), drafter=HiddenDrafter(),
                    num_speculative_tokens=1)
    assert eng.runners[0].hidden_layers == ("norm",)
    eng = LLMEngine("deepseek_v4", params, cfg, block_size=4, num_blocks=64)  # None: V4's defaults
    assert not (eng.scheduler_config.enable_prefix_caching or eng.scheduler_config.enable_chunked_prefill)
    eng = engine("one", num_blocks=64)
    with pytest.raises(ValueError, match=f"max_num_batched_tokens is {BUDGET}: raise it to >= 49"):
        eng.add_request(list(range(40)), SamplingParams(max_tokens=10))
    assert not eng.has_unfinished()


@pytest.mark.slow  # seeded sampling over every layout (~2 s): slow lane; the greedy layouts stay fast
def test_seeded_sampling_is_the_same_whatever_the_layout_and_preemptions(one_device):
    """temperature > 0 (cpattn.engine.sampling: a token is a pure function of the logits, the seed and its
    output index): one device with room for everything, DCP 2 and PCP 2 + DCP 2 with a pool that preempts."""
    reqs = [{"prompt": prompt(n, 20 + n), "arrive": a} for n, a in ((7, 0), (26, 0), (12, 1), (18, 2))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=40, seed=100 + i) for i in range(4)]

    def run(layout, num_blocks):
        return run_arrivals(engine(layout, num_blocks=num_blocks), reqs, params)

    one, none = run("one", 64)
    assert none == 0
    assert one != [expected(one_device, {"prompt": r["prompt"], "max_tokens": MAX_TOKENS}) for r in reqs]  # not greedy
    for layout in ("dcp2", "pcp2_dcp2"):
        got, preempted = run(layout, 5)
        assert preempted > 0 and got == one, (layout, got, one)


requests = st.lists(st.fixed_dictionaries({
    "len": st.integers(1, 40), "max_tokens": st.integers(1, MAX_TOKENS), "arrive": st.integers(0, 6),
    "abort": st.one_of(st.none(), st.integers(0, 10))}), min_size=1, max_size=4)


def run_property(one_device, layout: str, reqs: list[dict], num_blocks: int, seed: int) -> None:
    schedule = [{"prompt": prompt(r["len"], 1000 * seed + i), "arrive": r["arrive"], "max_tokens": r["max_tokens"],
                 **({} if r["abort"] is None else {"abort": r["abort"]})} for i, r in enumerate(reqs)]
    check_run(one_device, engine(layout, num_blocks=num_blocks // LAYOUTS[layout][0]), schedule)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(12, 24), seed=st.integers(0, 3))
def test_property_arrivals_and_lengths(one_device, reqs, num_blocks, seed):
    run_property(one_device, "one", reqs, num_blocks, seed)


@pytest.mark.slow
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(12, 24), seed=st.integers(0, 50),
       layout=st.sampled_from(list(LAYOUTS)))
def test_property_arrivals_and_lengths_all_layouts(one_device, reqs, num_blocks, seed, layout):
    run_property(one_device, layout, reqs, num_blocks, seed)
