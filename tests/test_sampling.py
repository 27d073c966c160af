"""Sampling in the step loop (cpattn.engine.sampling): distributions, seeds across layouts, drafts, logprobs.

The distribution tests count tokens over many seeds and compare them with the float64 softmax of the
same logits (``reference_probs``: plain loops) by a chi-square test. scipy is not installed, so the
critical value is the Wilson-Hilferty approximation of the chi-square quantile (accurate to ~1% for
df >= 3 at these tails): at alpha = 1e-4, z = 3.719. The draws are a pure function of the seeds, so
each test's statistic is fixed: the test does not flake, and a wrong distribution (a tested case
below) lands far above the bound.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpattn.config import SchedulerConfig
from cpattn.engine import SamplingParams as FromPackage
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.sampling import (draw, probs, reference_probs, reference_sample, reference_verify, sample,
                                    token_logprobs, verify)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine

Z = 3.719  # the normal quantile of 1 - 1e-4


def critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at 1 - 1e-4 with ``df`` degrees of freedom."""
    return df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: list[int], p: list[float]) -> tuple[float, int]:
    """(statistic, df) of ``counts`` against ``p``; a token of probability 0 must never be counted."""
    n = sum(counts)
    assert all(c == 0 for c, q in zip(counts, p) if q == 0), f"a token of probability 0 was drawn: {counts}"
    cats = [i for i, q in enumerate(p) if q > 0]
    return sum((counts[i] - n * p[i]) ** 2 / (n * p[i]) for i in cats), len(cats) - 1


def assert_distribution(tokens, p: list[float], what: str) -> None:
    counts = [0] * len(p)
    for t in tokens:
        counts[t] += 1
    stat, df = chi2(counts, p)
    if df == 0:
        return
    assert stat < critical(df), f"{what}: chi-square {stat:.1f} >= {critical(df):.1f} (df {df}); counts {counts}"


LOGITS = [2.0, 1.5, 1.0, 0.6, 0.0, -0.4, -1.0, -2.0]  # a tiny vocabulary of 8
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.6, -1, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.8, 5, 0.9), (2.0, 8, 0.5)]
N = 10_000


# -- the pure functions ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_sampled_tokens_follow_the_float64_softmax(temperature, top_k, top_p):
    p = reference_probs(LOGITS, temperature, top_k, top_p)
    dist = probs(torch.tensor(LOGITS, dtype=torch.float64).expand(N, -1), temperature, top_k, top_p)
    assert torch.allclose(dist[0], torch.tensor(p, dtype=torch.float64), rtol=0, atol=1e-12)
    assert_distribution(sample(dist, [draw(s, 0) for s in range(N)]).tolist(), p, f"T={temperature} k={top_k} "
                        f"p={top_p}")
    # the draws of one seed over output positions are as good as over seeds
    assert_distribution(sample(dist, [draw(12345, i) for i in range(N)]).tolist(), p, "one seed, many positions")


def test_the_chi_square_test_sees_a_wrong_temperature():
    """The bound has power: draws at T = 1.0 are refused against the softmax at T = 1.15."""
    dist = probs(torch.tensor(LOGITS, dtype=torch.float64).expand(N, -1), 1.0, 0, 1.0)
    counts = [0] * len(LOGITS)
    for t in sample(dist, [draw(s, 0) for s in range(N)]).tolist():
        counts[t] += 1
    stat, df = chi2(counts, reference_probs(LOGITS, 1.15, 0, 1.0))
    assert stat > 3 * critical(df), stat


def test_probs_and_sample_equal_the_loop_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=g, dtype=torch.float64) * 2
    logits[3, :6] = logits[3].max() + 1  # a 6-way tie on top: top-k 5 and top-p 0.2 keep all of it
    params = [(0.3 + (r % 7) * 0.3, [0, -1, 1, 5, 40, 50][r % 6], [1.0, 0.95, 0.6, 0.2, 1e-9][r % 5])
              for r in range(64)]
    dist = probs(logits, [t for t, _, _ in params], [k for _, k, _ in params], [q for _, _, q in params])
    for r, (t, k, q) in enumerate(params):
        ref = reference_probs(logits[r].tolist(), t, k, q)
        assert torch.allclose(dist[r], torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12), r
    for u in (0.0, 0.013, 0.5, 0.77, 1 - 2 ** -53):
        got = sample(dist, [u] * 64).tolist()
        assert got == [reference_sample(dist[r].tolist(), u) for r in range(64)], u
    assert (dist[3, :6] > 0).all()  # the tie of row 3 kept whole


def test_top_p_past_the_most_likely_512_tokens():
    """A vocabulary past the 512 tokens top-p looks at first: a flat row (its nucleus is longer: the
    whole row sorted) beside peaked ones, against the loop reference."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1500, generator=g, dtype=torch.float64)
    logits[1:] *= 6  # peaked: the nucleus within the head
    dist = probs(logits, 1.0, [0, 0, 700, 0], [0.9, 0.9, 0.95, 1.0])
    for r, (k, q) in enumerate(zip([0, 0, 700, 0], [0.9, 0.9, 0.95, 1.0])):
        ref = torch.tensor(reference_probs(logits[r].tolist(), 1.0, k, q), dtype=torch.float64)
        assert torch.allclose(dist[r], ref, rtol=0, atol=1e-12), r
    kept = (dist > 0).sum(-1).tolist()
    assert kept[0] > 512 and kept[1] < 512 and kept[3] == 1500, kept


def test_draw_is_a_function_of_seed_and_index():
    a = [draw(s, i) for s in (0, 1, 2 ** 63) for i in range(50)]
    assert a == [draw(s, i) for s in (0, 1, 2 ** 63) for i in range(50)]
    assert len(set(a)) == len(a) and all(0 <= u < 1 for u in a)


# -- rejection sampling of greedy drafts ---------------------------------------------------------
P0 = reference_probs([1.0, 0.4, 0.0, -0.5, 0.9, -2.0], 1.0, 0, 1.0)
P1 = reference_probs([-1.0, 0.2, 1.3, 0.0, 0.3, 0.1], 1.0, 0, 1.0)


@pytest.mark.parametrize("draft", [0, 5], ids=["right", "wrong"])  # the target's argmax / its least likely
@pytest.mark.parametrize("rule", ["verify", "reference"])
def test_verified_drafts_keep_the_target_distribution(draft, rule):
    """Position 0 carries a greedy draft; whatever it is, the emitted first token is distributed as
    p0, the draft is accepted with probability p0(draft), and after an acceptance the bonus token is
    distributed as p1."""
    p = torch.tensor([P0, P1], dtype=torch.float64).expand(N, 2, -1)
    if rule == "verify":
        outs = verify(p, [[draft]] * N, [[draw(s, 0), draw(s, 1)] for s in range(N)])
    else:
        outs = [reference_verify([P0, P1], [draft], [draw(s, 10), draw(s, 11)], [draw(s, 0), draw(s, 1)])
                for s in range(N)]
    assert_distribution([o[0] for o in outs], P0, f"first token, draft {draft}")
    accepted = [o for o in outs if len(o) == 2]
    assert all(o[0] == draft for o in accepted) and all(o[0] != draft for o in outs if len(o) == 1)
    n_acc = len(accepted)
    assert abs(n_acc - N * P0[draft]) < Z * math.sqrt(N * P0[draft] * (1 - P0[draft])), (n_acc, N * P0[draft])
    assert_distribution([o[1] for o in accepted], P1, f"bonus token after accepting {draft}")


def test_verify_emits_what_plain_sampling_emits():
    """The one-uniform rule: drafts change only how many tokens a step emits, never which."""
    p = torch.tensor([P0, P1, P0], dtype=torch.float64)
    u = [[draw(s, i) for i in range(3)] for s in range(2000)]
    plain = sample(p.repeat(2000, 1), [w for row in u for w in row]).view(2000, 3).tolist()
    for drafts in ([0, 2], [4, 4], [1], []):
        q = len(drafts) + 1
        got = verify(p[:q].expand(2000, q, -1), [drafts] * 2000, [row[:q] for row in u])
        assert all(g == w[:len(g)] for g, w in zip(got, plain))
        assert {len(g) for g in got} == ({1} if not drafts else set(range(1, q + 1)))


# -- the engine --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def model(vocab: int | None = None):
    """The tiny float64 Qwen3 (6 heads: DCP 3 divides them); ``vocab`` for the distribution tests."""
    over = {"num_attention_heads": 6, **({} if vocab is None else {"vocab_size": vocab})}
    cfg = get_family("qwen3").config_class.tiny(**over)
    return cfg, get_family("qwen3").init_params(cfg, seed=1, dtype=torch.float64)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (9,), generator=g).tolist()
    return [base + torch.randint(0, vocab, (3,), generator=g).tolist(), torch.randint(0, vocab, (5,), generator=g)
            .tolist(), base[:8] + [7], torch.randint(0, vocab, (6,), generator=g).tolist()]


REQUESTS = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11),
            SamplingParams(max_tokens=5, temperature=1.3, top_k=8, seed=12),
            SamplingParams(max_tokens=6, temperature=0.7, seed=2 ** 40 + 13, logprobs=2),
            SamplingParams(max_tokens=5)]  # greedy beside them


def run(engine: LLMEngine, arrive=(0, 1, 2, 2), params=REQUESTS) -> list[tuple[int, ...]]:
    """Add request i at step arrive[i]; step until done; each request's tokens in request order."""
    ps = prompts(engine.runners[0].cfg.vocab_size)
    ids, step = {}, 0
    while len(ids) < len(params) or engine.has_unfinished():
        for i in sorted(range(len(params)), key=lambda i: arrive[i]):
            if i not in ids and arrive[i] <= step:
                ids[i] = engine.add_request(ps[i], params[i])
        engine.step()
        step += 1
    reqs = engine.scheduler.requests
    assert all(reqs[ids[i]].status == "finished" for i in ids) and engine.stats.blocks_used == 0
    return [tuple(reqs[ids[i]].output) for i in range(len(params))]


def engine(dcp=1, pcp=1, interleave=1, budget=10, num_blocks=48, block_size=4, **kw) -> LLMEngine:
    cfg, params = model()
    return LLMEngine("qwen3", params, cfg, dcp_size=dcp, pcp_size=pcp, interleave_size=interleave,
                     block_size=block_size, num_blocks=num_blocks, poison=True,
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4), **kw)


@functools.lru_cache(maxsize=None)
def baseline() -> list[tuple[int, ...]]:
    """One device, a large budget (no chunking), everything at once."""
    return run(engine(budget=256), arrive=(0, 0, 0, 0))


def test_baseline_is_sampled_and_keeps_greedy_exact(one_device):
    want = baseline()
    cfg, params = model()
    greedy = one_device.tokens("qwen3", params, cfg, prompts(cfg.vocab_size)[3], 5)
    assert list(want[3]) == greedy  # the greedy request beside the sampled ones: still one-device greedy
    assert len({t for out in want[:3] for t in out}) > 8  # sampled: not one repeated argmax


@pytest.mark.parametrize("kw", [
    dict(), dict(dcp=2, graph_mode="FULL_DECODE_ONLY", graph_backend="eager"), dict(dcp=3, interleave=2),
    dict(dcp=2, pcp=2)], ids=["one device, chunks", "DCP 2, captured decodes", "DCP 3, interleave 2", "PCP 2 + DCP 2"])
def test_seeded_tokens_do_not_depend_on_the_layout(kw):
    e = engine(**kw)
    assert run(e) == baseline()
    if "graph_mode" in kw:
        assert e.stats.replayed_steps > 0, e.stats  # captured steps sample like eager ones
    assert (e.stats.pcp_steps > 0) == ("pcp" in kw), e.stats


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(arrive=st.lists(st.integers(0, 4), min_size=4, max_size=4), budget=st.sampled_from([5, 7, 12, 33]))
def test_seeded_tokens_do_not_depend_on_arrivals_or_budget(arrive, budget):
    assert run(engine(budget=budget), arrive=tuple(arrive)) == baseline()


def test_seeded_tokens_survive_preemption():
    e = engine(block_size=2, num_blocks=12, budget=32)
    assert run(e, arrive=(0, 0, 0, 0)) == baseline()
    assert e.stats.preemptions > 0, e.stats


def test_unseeded_requests_draw_their_seed_from_the_engine():
    unseeded = [SamplingParams(max_tokens=4, temperature=1.0)] * 2
    a, b = (run(engine(seed=5), arrive=(0, 0), params=unseeded) for _ in range(2))
    assert a == b and a[0] != a[1]  # the same engine seed: the same tokens; each request its own seed
    assert run(engine(seed=6), arrive=(0, 0), params=unseeded) != a


def test_ngram_drafts_change_nothing_under_sampling():
    """Drafts verified by rejection sampling: with or without the n-gram drafter, the same tokens and
    logprobs (and some drafts accepted, some rejected)."""
    cool = [SamplingParams(max_tokens=12, temperature=0.05, seed=s, logprobs=1) for s in range(4)]
    plain = engine(budget=64)
    want = run(plain, arrive=(0, 0, 0, 0), params=cool)
    spec = engine(budget=64, drafter=NgramDrafter(), num_speculative_tokens=2)
    ids = [spec.add_request(p, c) for p, c in zip(prompts(model()[0].vocab_size), cool)]
    final = {}
    while spec.has_unfinished():
        final.update({o.request_id: o for o in spec.step() if o.finished})
    assert [final[i].token_ids for i in ids] == want
    s = spec.stats
    assert 0 < s.accepted_tokens < s.drafted_tokens, s
    plain_lp = plain.generate(prompts(model()[0].vocab_size), cool[0])[0].logprobs
    spec_lp = final[ids[0]].logprobs
    assert len(spec_lp) == 12 and [d.keys() for d in spec_lp] == [d.keys() for d in plain_lp]
    assert all(abs(spec_lp[j][t] - plain_lp[j][t]) < 1e-9 for j in range(12) for t in spec_lp[j])


def test_logprobs_are_the_raw_model_logprobs(one_device):
    e = engine(budget=8)
    ps = prompts(model()[0].vocab_size)
    outs = [e.generate([ps[0]], SamplingParams(max_tokens=5, temperature=1.5, top_k=3, seed=9, logprobs=3))[0],
            e.generate([ps[1]], SamplingParams(max_tokens=4, logprobs=0))[0]]
    cfg, params = model()
    for prompt, o, n in zip(ps, outs, (3, 0)):
        full = list(prompt) + list(o.token_ids)
        ref = one_device("qwen3", params, cfg, [full], 1).prompt_logits[len(prompt) - 1:-1]  # [n, V]: one prefill
        lp = torch.log_softmax(ref, -1)
        assert len(o.logprobs) == len(o.token_ids)
        for j, (t, d) in enumerate(zip(o.token_ids, o.logprobs)):
            assert set(d) == {t, *lp[j].topk(n).indices.tolist()}, (j, d)
            assert all(abs(v - float(lp[j, k])) < 1e-9 for k, v in d.items())  # raw: no temperature, no top-k
    assert e.generate([ps[2]], SamplingParams(max_tokens=2))[0].logprobs is None


@pytest.mark.slow
def test_the_first_token_follows_the_one_device_softmax(one_device):
    """End to end on a 16-token vocabulary, DCP 2: 1500 requests of one prompt, seeds 0..1499, against
    the softmax (T 0.8, top-k 12, top-p 0.95) of one-device float64 logits of that prompt."""
    cfg, params = model(16)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    p = reference_probs(one_device("qwen3", params, cfg, [prompt], 1).prompt_logits[-1].tolist(),
                        0.8, 12, 0.95)
    e = LLMEngine("qwen3", params, cfg, dcp_size=2, block_size=4, num_blocks=64,
                  scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=128, enable_prefix_caching=False))
    for s in range(1500):
        e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.8, top_k=12, top_p=0.95, seed=s))
    first = []
    while e.has_unfinished():
        first += [o.token_ids[0] for o in e.step() if o.finished]
    assert len(first) == 1500
    assert_distribution(first, p, "first tokens of the engine")


def test_logprobs_helper_orders_ties_by_id():
    d = token_logprobs(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), [3], 2)[0]
    assert list(d) == [3, 1, 2]


# -- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 2.0), ("seed", 1.5), ("seed", True), ("logprobs", -1), ("logprobs", 1.0),
    ("max_tokens", 0), ("stop_token_ids", (1, "2")),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: saw .*; expected [^\n]*$"):
        SamplingParams(**{field: value})


def test_defaults_stay_greedy_and_importable():
    p = SamplingParams()
    assert FromPackage is SamplingParams and p.greedy and (p.top_p, p.top_k, p.seed, p.logprobs) == (1.0, 0, None, None)
    with pytest.raises(ValueError, match="^params: saw dict; expected a cpattn.engine.SamplingParams$"):
        engine().add_request([1, 2], {"temperature": 1.0})
    with pytest.raises(ValueError, match="^seed: saw 'x'; expected an int or None$"):
        engine(seed="x")
