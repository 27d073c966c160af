"""DeepSeek-V4 P/D in the step loop: a PCP prefill engine hands each request's whole V4 state (rings, compressed
entries, indexer keys) and first-token logits to a DCP decode engine through the P/D connector
(:mod:`cpattn.engine.connector_v4`), in memory (PDEngine) or rank to rank (run_rank, simulated mesh and gloo).

The oracle is tests/test_engine_loop_v4.py's: one-device greedy generation of each request alone (float64).
Fresh V4 slots are NaN-poisoned, so a row the consumer neither received nor computed shows in its tokens. The
consumer computes no prompt token (counted: its runners' prefill calls), except to recompute a request it preempts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lanes import examples
from ref.greedy import ONE_DEVICE
from test_engine_loop_v4 import expected, model, prompt
from test_engine_pd import params_of, serve
from test_engine_run_rank import gloo_sent, merged

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.connector import PoolConnector
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import PDEngine, memory_pool
from cpattn.engine.run_rank import Arrival, run_rank

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
BLOCK = 4
SIZES = [(1, 1), (2, 1), (1, 2), (2, 2)]


def sched(**over) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": 48, "max_num_seqs": 3, "enable_chunked_prefill": False,
                              "enable_prefix_caching": False, **over})


def schedule() -> list[dict]:
    """Five requests over six steps (lengths around the window 8 and the HCA ratio 16); request 2 stops at its
    third token, request 3 has max_tokens=1 (done on the producer, never handed off)."""
    reqs = [dict(prompt=prompt(n, 40 + i), max_tokens=m, arrive=a)
            for i, (n, m, a) in enumerate(((17, 6, 0), (1, 4, 0), (33, 6, 1), (9, 1, 3), (24, 5, 5)))]
    reqs[2]["stop"] = (expected(ONE_DEVICE, reqs[2])[2],)
    return reqs


def hand_count(length: int, consumers: int) -> int:
    """Bytes of one request's V4 state to ``consumers`` ranks, by hand (tests/../src/cpattn/v4/cache.py's table):
    per rank the rings' rows at positions [L - back, L) (window W - 1 rows of D; CSA compressor 2m - 1 rows of 4D
    and its indexer ring 2m - 1 rows of 4 D_I; HCA compressor m - 1 rows of 2D) and V first-token logits; the
    L // m entries (D, plus D_I for CSA's indexer keys) once, split over the ranks. float64."""
    cfg, _ = model()
    lay = cfg.layout(block_size=BLOCK)
    d, di, w = lay.head_dim, lay.index_head_dim, lay.window
    rings = entries = 0
    for kind in lay.kinds:
        rings += min(length, w - 1) * d
        if kind == "csa":
            m = lay.csa_ratio
            rings += min(length, 2 * m - 1) * (4 * d + 4 * di)
            entries += length // m * (d + di)
        elif kind == "hca":
            m = lay.hca_ratio
            rings += min(length, m - 1) * 2 * d
            entries += length // m * d
    return 8 * (consumers * (rings + cfg.vocab_size) + entries)


def want_bytes(reqs: list[dict], consumers: int) -> dict:
    return {i: hand_count(len(r["prompt"]), consumers) for i, r in enumerate(reqs) if r["max_tokens"] > 1}


class CountingBackend:
    """Wraps a runner's backend and counts its prefill calls (the consumer should make none)."""

    def __init__(self, inner):
        self.inner, self.prefills = inner, 0

    def prefill(self, *args, **kwargs):
        self.prefills += 1
        return self.inner.prefill(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def counted(engine: LLMEngine) -> list[CountingBackend]:
    for r in engine.runners:
        r.backend = CountingBackend(r.backend)
    return [r.backend for r in engine.runners]


def drained(engine: LLMEngine) -> None:
    """No block, request or V4 slot left (the scheduler reports the last finishes with its next step)."""
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    engine.step()
    assert [r.live for r in engine.runners] == [0] * len(engine.runners)


@pytest.mark.parametrize("p,d", SIZES, ids=str)
def test_pd_engine_hands_v4_state_over(p, d):
    cfg, params = model()
    reqs = schedule()
    pd = PDEngine("deepseek_v4", params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=40, poison=True,
                  scheduler=sched(), **({"graph_mode": "FULL_DECODE_ONLY", "graph_backend": "eager"} if d == 2 else {}))
    computed = counted(pd.decode)
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert list(final[i].token_ids) == expected(ONE_DEVICE, r), f"request {i}"
    assert final[2].finish_reason == "stop" and pd.stats.handed_off == 4
    assert [c.prefills for c in computed] == [0] * d  # the consumer computed no prompt token
    assert pd.prefill.connector.stats.bytes_by_request == want_bytes(reqs, d)
    assert pd.decode.connector.stats.bytes_received == sum(want_bytes(reqs, d).values())
    assert pd.decode.connector._inbox == {}  # dropped once each request ran
    if d == 2:
        assert pd.stats.decode.replayed_steps > 0 and pd.stats.prefill.replayed_steps == 0
    assert pd.stats.prefill.pcp_steps == (0 if p == 1 else pd.stats.prefill.eager_steps)
    drained(pd.prefill), drained(pd.decode)
    pd.close()


def test_a_request_the_consumer_preempts_is_recomputed_there():
    """A consumer pool of 4 blocks x 4 tokens per rank (DCP 2: 32 tokens) cannot hold the three requests' growth:
    it preempts, and the readmission recomputes prompt + outputs on the consumer (the handed state was used once)."""
    cfg, params = model()
    reqs = [dict(prompt=prompt(n, 70 + n), max_tokens=6, arrive=a) for n, a in ((13, 0), (9, 0), (10, 1))]
    pd = PDEngine("deepseek_v4", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=4, poison=True,
                  scheduler=sched())
    computed = counted(pd.decode)
    final = serve(pd, reqs)
    assert [list(final[i].token_ids) for i in range(3)] == [expected(ONE_DEVICE, r) for r in reqs]
    assert pd.stats.decode.preemptions > 0
    assert computed[0].prefills > 0 and computed[0].prefills == computed[1].prefills
    drained(pd.decode)
    pd.close()


def test_seeded_sampling_gives_the_one_engine_tokens():
    """temperature > 0: the consumer samples the first token from the handed logits with the request's seed, the
    producer's first token checked against it, then decodes: one V4 engine on one device gives the same tokens."""
    cfg, params = model()
    prompts = [prompt(n, 90 + n) for n in (7, 21, 30)]
    sp = [SamplingParams(max_tokens=5, temperature=1.3, top_k=30, seed=7 + i) for i in range(3)]
    one = LLMEngine("deepseek_v4", params, cfg, block_size=BLOCK, num_blocks=64, scheduler=sched())
    want = [list(one.generate([q], s)[0].token_ids) for q, s in zip(prompts, sp)]
    assert want != [expected(ONE_DEVICE, dict(prompt=q, max_tokens=5)) for q in prompts]  # not greedy
    pd = PDEngine("deepseek_v4", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=40, scheduler=sched())
    ids = [pd.add_request(q, s) for q, s in zip(prompts, sp)]
    final = {}
    while pd.has_unfinished():
        final.update({o.request_id: list(o.token_ids) for o in pd.step() if o.finished})
    assert [final[i] for i in ids] == want
    pd.close()


def test_abort_while_waiting_on_the_consumer_leaves_nothing():
    """The consumer runs one request at a time: b's state is received while a decodes; b is aborted before it
    is admitted, and its share leaves the inbox at once."""
    cfg, params = model()
    reqs = [dict(prompt=prompt(12, 1), max_tokens=5, arrive=0), dict(prompt=prompt(19, 2), max_tokens=5, arrive=0)]
    pd = PDEngine("deepseek_v4", params, cfg, pcp_size=1, dcp_size=2, block_size=BLOCK, num_blocks=40,
                  scheduler=sched(max_num_seqs=1))
    a, b = (pd.add_request(r["prompt"], params_of(r)) for r in reqs)
    pd.step(), pd.step()
    assert b in pd.decode.connector._inbox and b in pd.decode.scheduler.requests
    assert pd.abort_request(b)
    assert pd.decode.connector._inbox == {}
    final = {}
    while pd.has_unfinished():
        final.update({o.request_id: o for o in pd.step() if o.finished})
    assert list(final[a].token_ids) == expected(ONE_DEVICE, reqs[0])
    drained(pd.decode)
    pd.close()


def test_what_v4_pd_cannot_take_is_refused():
    cfg, params = model()
    pool = memory_pool("deepseek_v4", cfg, params, BLOCK)
    with pytest.raises(ValueError, match="kv_connector=PoolConnector") as e:
        PDEngine("deepseek_v4", params, cfg, block_size=BLOCK, scheduler=sched(), kv_connector=PoolConnector(pool))
    assert "\n" not in str(e.value) and "PDConnector()" in str(e.value)
    with pytest.raises(ValueError, match="^kv_pool: .*pass kv_pool=None"):
        PDEngine("deepseek_v4", params, cfg, block_size=BLOCK, scheduler=sched(), kv_pool=pool)
    with pytest.raises(ValueError, match="^kv_pool: .*kv_connector=PDConnector"):  # one engine, a pool asked for
        LLMEngine("deepseek_v4", params, cfg, block_size=BLOCK, scheduler=sched(), kv_pool=pool)


# lengths from 1: a lone 1-token prompt under PCP 2 leaves rank 1 no token (V4's blocks take t = 0 rows)
requests = st.lists(st.fixed_dictionaries({
    "len": st.integers(1, 40), "max_tokens": st.integers(1, 6), "arrive": st.integers(0, 5),
    "abort": st.one_of(st.none(), st.integers(0, 8))}), min_size=1, max_size=4)


def check_property(p: int, d: int, reqs: list[dict], num_blocks: int, seed: int) -> None:
    """Drawn arrivals, lengths, aborts and a block pool that may preempt on either role: every request that was
    not aborted gets one device's tokens, an aborted one a prefix of them; nothing is left on either role."""
    cfg, params = model()
    sched_reqs = [dict(prompt=prompt(r["len"], 1000 * seed + i), max_tokens=r["max_tokens"], arrive=r["arrive"],
                       **({} if r["abort"] is None else {"abort": r["abort"]})) for i, r in enumerate(reqs)]
    pd = PDEngine("deepseek_v4", params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=num_blocks,
                  poison=True, scheduler=sched())
    final = serve(pd, sched_reqs)
    for i, r in enumerate(sched_reqs):
        got = final.get(i)
        if got is None or got.finish_reason == "abort":
            want = expected(ONE_DEVICE, r)
            assert "abort" in r and (got is None or want[:len(got.token_ids)] == list(got.token_ids)), i
        else:
            assert list(got.token_ids) == expected(ONE_DEVICE, r), f"request {i}"
    drained(pd.prefill), drained(pd.decode)
    assert pd.decode.connector._inbox == {} and pd.prefill.connector._outbox == {}
    pd.close()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(6, 12), seed=st.integers(0, 3))
def test_property_pd_2_2(reqs, num_blocks, seed):
    check_property(2, 2, reqs, num_blocks, seed)


@pytest.mark.slow
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, num_blocks=st.integers(12, 24), seed=st.integers(0, 50), sizes=st.sampled_from(SIZES))
def test_property_pd_all_sizes(reqs, num_blocks, seed, sizes):
    p, d = sizes
    check_property(p, d, reqs, max(num_blocks // d, -(-46 // (BLOCK * min(p, d)))), seed)  # both roles hold 40 + 6


# -- run_rank: the producer's ranks send rank to rank over the world -------------------------------------------------
def arrivals(reqs: list[dict]) -> list[Arrival]:
    return [Arrival(r["prompt"], params_of(r), r["arrive"]) for r in reqs]


def pd_rank(world, cfg, params, arr, kwargs, seen=None):
    """run_rank, remembering each producer engine's connector (its bytes per request)."""
    def hook(role, engine, outs):
        if role == "prefill" and seen is not None:
            seen[id(engine)] = engine.connector
    return run_rank(world, "deepseek_v4", params, cfg, arr, **kwargs, on_step=hook)


@pytest.mark.parametrize("p,d", SIZES, ids=str)
def test_run_rank_pd_on_the_simulated_mesh(p, d):
    cfg, params = model()
    reqs = schedule()
    seen = {}
    kw = dict(pd=True, pcp_size=p, dcp_size=d, block_size=BLOCK, scheduler=sched(), poison=True)
    out = cpattn.simulate(p + d, pd_rank, cfg, params, arrivals(reqs), kw, seen)
    assert merged(out) == {i: expected(ONE_DEVICE, r) for i, r in enumerate(reqs)}
    assert set(out[p]) == {0, 1, 2, 4} and set(out[0]) == {3}  # the max_tokens=1 request ends on the producer
    sent = {}
    for conn in seen.values():
        for i, n in conn.stats.bytes_by_request.items():
            sent[i] = sent.get(i, 0) + n
    assert len(seen) == p and sent == want_bytes(reqs, d)


@pytest.mark.slow
def test_gloo_ranks_hand_v4_state_rank_to_rank():
    """P/D 2 -> 2 in spawned processes: producer rank d % 2 sends consumer rank d its share over gloo send / recv.
    The tokens equal one device's; the bytes sent and received are the hand count."""
    from cpattn.comm.launch import spawn

    cfg, _ = model()
    reqs = schedule()
    kw = dict(pd=True, pcp_size=2, dcp_size=2, block_size=BLOCK, scheduler=sched(), poison=True)
    res = spawn(4, gloo_sent, cfg, arrivals(reqs), kw, "deepseek_v4")
    assert merged([t for t, _, _ in res]) == {i: expected(ONE_DEVICE, r) for i, r in enumerate(reqs)}
    want = want_bytes(reqs, 2)
    sent = {i: res[0][1].get(i, 0) + res[1][1].get(i, 0) for i in want}
    assert sent == want and res[2][2] + res[3][2] == sum(want.values())
