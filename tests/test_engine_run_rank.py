"""run_rank: one per-rank composition of the step loop, colocated or P/D, on the simulated mesh and on gloo ranks.

The oracle is one-device greedy generation of each request alone (tests/test_engine_loop.py's ``expected``); the
gloo runs must also give the simulated run's tokens, rank for rank.
"""

from __future__ import annotations

import pytest
import torch
from ref.greedy import ONE_DEVICE
from test_engine_loop import expected, model

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.connector import PoolConnector
from cpattn.engine.connector_pd import PDConnector
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import memory_pool
from cpattn.engine.pooling import PoolSpec
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.models.family import get_family

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
BLOCK = 4
SCHED = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=3)


def arrivals(vocab: int, seed: int = 5) -> list[Arrival]:
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = toks(10)
    return [Arrival(base + toks(7), SamplingParams(max_tokens=5)), Arrival(toks(2), SamplingParams(max_tokens=3)),
            Arrival(base + toks(1), SamplingParams(max_tokens=4), 2), Arrival(toks(5), SamplingParams(max_tokens=1), 3),
            Arrival(toks(19), SamplingParams(max_tokens=3), 6)]


def want(family, arr, heads=None) -> dict:
    return {i: expected(ONE_DEVICE, family, dict(prompt=a.prompt, max_tokens=a.params.max_tokens), heads)
            for i, a in enumerate(arr)}


def merged(per_rank: list[dict]) -> dict:
    """Every request's final tokens, from whichever role finished it (a RequestOutput or its token list, as a
    spawned rank returns it); roles' ranks must agree."""
    out = {}
    for finals in per_rank:
        for i, o in finals.items():
            toks = list(o.token_ids) if hasattr(o, "token_ids") else o
            assert out.setdefault(i, toks) == toks, f"ranks disagree on request {i}"
    return out


@pytest.mark.parametrize("world,pcp,dcp", [(1, 1, None), (2, 1, None), (2, 2, None), (3, 3, None), (2, 2, 1),
                                           (3, 3, 2)], ids=str)
def test_colocated_ranks_give_one_device_tokens(world, pcp, dcp):
    """DCP over the world, or (dcp < world = pcp) PCP over it and DCP over its first dcp ranks (runner_wide)."""
    heads = 6 if world == 3 else None
    cfg, params = model("qwen3", heads)
    arr = arrivals(cfg.vocab_size)
    per_rank = cpattn.simulate(world, run_rank, "qwen3", params, cfg, arr, pcp_size=pcp, dcp_size=dcp,
                               block_size=BLOCK, scheduler=SCHED, poison=True)
    assert all(set(f) == set(range(len(arr))) for f in per_rank)  # every rank of one engine finishes every request
    assert merged(per_rank) == want("qwen3", arr, heads)


def sent_by_hand(arr, d: int, row_bytes: int, found=None) -> dict:
    """Bytes the P/D connector must move per handed-off request, counted by hand: the prompt's whole spans of
    BLOCK * d tokens (at least one token left for the consumer), less the leading ``found[i]`` blocks a pool
    holds (rounded down to whole spans)."""
    out = {}
    for i, a in enumerate(arr):
        if a.params.max_tokens > 1:
            usable = (len(a.prompt) - 1) // (BLOCK * d) * d
            skip = min((found or {}).get(i, 0) // d * d, usable)
            out[i] = (usable - skip) * BLOCK * row_bytes
    return out


def connectors_of(per_rank_engines: dict, role: str) -> list:
    return [e.connector for (r, _), e in sorted(per_rank_engines.items()) if r == role]


@pytest.mark.parametrize("connector", ["pool", "direct"])
@pytest.mark.parametrize("family,p,d", [("qwen3", 1, 1), ("qwen3", 2, 1), ("qwen3", 1, 2), ("qwen3", 2, 2),
                                        ("deepseek_v32", 2, 2)], ids=str)
def test_pd_roles_give_one_device_tokens(family, p, d, connector):
    """Through the pool, or (no kv_pool) the P/D connector: each producer rank sends its whole blocks to their
    consumer ranks over the world's send / recv; the bytes per request are the hand count of the blocks moved."""
    cfg, params = model(family)
    arr = arrivals(cfg.vocab_size)
    steps, engines = {"prefill": 0, "decode": 0}, {}

    def count(role, engine, outs):
        steps[role] += bool(outs)
        engines[(role, id(engine))] = engine

    pool = {"kv_pool": memory_pool(family, cfg, params, BLOCK)} if connector == "pool" else {}
    per_rank = cpattn.simulate(p + d, run_rank, family, params, cfg, arr, pd=True, pcp_size=p, dcp_size=d,
                               block_size=BLOCK, scheduler=SCHED, poison=True, on_step=count, **pool)
    assert merged(per_rank) == want(family, arr)
    assert set(per_rank[0]) == {3}  # only the max_tokens=1 request ends on the producer
    assert set(per_rank[p]) == {0, 1, 2, 4}
    assert steps["prefill"] > 0 and steps["decode"] > 0
    if connector == "direct":
        row = sum(lay.row_width for lay in get_family(family).kv_layouts(cfg)) * 8  # float64 bytes per token
        producers, consumers = connectors_of(engines, "prefill"), connectors_of(engines, "decode")
        assert len(producers) == p and len(consumers) == d
        total = {}
        for c in producers:  # each producer rank counts the blocks it held; together, the hand count
            for i, n in c.stats.bytes_by_request.items():
                total[i] = total.get(i, 0) + n
        assert total == sent_by_hand(arr, d, row)
        assert sum(c.stats.bytes_received for c in consumers) == sum(total.values())
        assert all(c._inbox == {} and c._outbox == {} for c in producers + consumers)


def test_pool_plus_pd_sends_only_what_the_pool_lacks():
    """A pool holding the shared 10-token prefix (stored by an earlier one-device run) composed with the P/D
    connector: the consumer fetches those spans from the pool, the producer sends only the blocks after them."""
    cfg, params = model("qwen3")
    arr = arrivals(cfg.vocab_size)
    pool = memory_pool("qwen3", cfg, params, BLOCK)
    warm = LLMEngine("qwen3", params, cfg, block_size=BLOCK, kv_pool=pool)
    warm.generate([arr[0].prompt[:10]], SamplingParams(max_tokens=1))  # its first 2 whole blocks into the pool
    assert warm.stats.pool_blocks_stored == 2
    engines = {}
    per_rank = cpattn.simulate(4, run_rank, "qwen3", params, cfg, arr, pd=True, pcp_size=2, dcp_size=2,
                               block_size=BLOCK, scheduler=SCHED, poison=True,
                               kv_connector=PoolConnector(pool, store=False) + PDConnector(),
                               on_step=lambda role, e, outs: engines.setdefault((role, id(e)), e))
    assert merged(per_rank) == want("qwen3", arr)
    row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 8
    total = {}
    for c in connectors_of(engines, "prefill"):
        for i, n in c.member(PDConnector).stats.bytes_by_request.items():
            total[i] = total.get(i, 0) + n
    assert total == sent_by_hand(arr, 2, row, found={0: 2, 2: 2})  # requests 0 and 2 share the stored prefix
    assert total[0] < sent_by_hand(arr, 2, row)[0]
    decode = connectors_of(engines, "decode")
    assert all(e.stats.pool_hit_tokens >= 8 for (r, _), e in engines.items() if r == "decode")
    assert all(c.stored_blocks == 0 for c in decode)  # store=False: the pool is read only here


def test_bad_layouts_are_refused():
    cfg, params = model("qwen3")
    arr = arrivals(cfg.vocab_size)
    with pytest.raises(RuntimeError, match="ValueError: pd=True: pcp_size=1 \\+ dcp_size=1"):
        cpattn.simulate(3, run_rank, "qwen3", params, cfg, arr, pd=True)
    with pytest.raises(RuntimeError, match="ValueError: pass kv_pool= or kv_connector=, not both"):
        cpattn.simulate(2, run_rank, "qwen3", params, cfg, arr, pd=True, kv_pool=memory_pool("qwen3", cfg, params, 4),
                        kv_connector=PDConnector())
    with pytest.raises(RuntimeError, match="ValueError: PDConnector on an engine of kv_role='kv_both'"):
        cpattn.simulate(2, run_rank, "qwen3", params, cfg, arr, kv_connector=PDConnector())
    with pytest.raises(RuntimeError, match="ValueError: dcp_size=1 on a world of 2 ranks: colocated"):
        cpattn.simulate(2, run_rank, "qwen3", params, cfg, arr, dcp_size=1)  # pcp_size 1: rank 1 would have no role


def gloo_rank(group, cfg, arr, kwargs):
    """A spawned rank: the float64 test model rebuilt here (seed 1, as ``model``), then run_rank; returns its
    final tokens and the prompt tokens its engine fetched from the pool."""
    from cpattn.models.family import get_family

    params = get_family("qwen3").init_params(cfg, seed=1, dtype=torch.float64)
    hits = []
    finals = run_rank(group, "qwen3", params, cfg, arr, **kwargs,
                      on_step=lambda role, engine, outs: hits.append(engine.stats.pool_hit_tokens))
    return {i: list(o.token_ids) for i, o in finals.items()}, hits[-1]


@pytest.mark.slow
def test_gloo_ranks_give_the_simulated_tokens(tmp_path):
    """P/D 2 -> 1 through an LMDB pool in spawned processes: the producer's two ranks each store their own blocks,
    then meet at a barrier (the pool under torchrun); the consumer fetches the prompts' whole blocks. The tokens
    equal the simulated mesh's, which equal one device's."""
    from cpattn.comm.launch import spawn

    cfg, params = model("qwen3")
    arr = arrivals(cfg.vocab_size)
    pd = dict(pd=True, pcp_size=2, dcp_size=1, block_size=BLOCK, scheduler=SCHED)
    sim = merged(cpattn.simulate(3, run_rank, "qwen3", params, cfg, arr, **pd,
                                 kv_pool=PoolSpec(f"lmdb:{tmp_path / 'sim'}")))
    assert sim == want("qwen3", arr)
    (t0, _), (t1, _), (t2, hits) = spawn(3, gloo_rank, cfg, arr, {**pd, "kv_pool": PoolSpec(f"lmdb:{tmp_path / 'pd'}")})
    assert t0 == t1 and {**t0, **t2} == sim
    whole = sum((len(a.prompt) - 1) // BLOCK * BLOCK for a in arr if a.params.max_tokens > 1)
    assert hits >= whole - 10  # each handed-off prompt's whole blocks (request 2's first 10 tokens may be on device)


def gloo_sent(group, cfg, arr, kwargs, family="qwen3"):
    """A spawned rank of a P/D run with the P/D connector (test_engine_pd_v4: the V4 connector): the float64
    test model rebuilt (seed 1, as ``model``); its final tokens and the bytes its connector sent (producer)
    or received (consumer) per request."""
    from cpattn.models.family import get_family

    params = get_family(family).init_params(cfg, seed=1, dtype=torch.float64)
    seen = []
    finals = run_rank(group, family, params, cfg, arr, **kwargs, on_step=lambda role, e, outs: seen.append(e))
    st = seen[-1].connector.stats
    return {i: list(o.token_ids) for i, o in finals.items()}, dict(st.bytes_by_request), st.bytes_received


@pytest.mark.slow
def test_gloo_ranks_send_blocks_rank_to_rank():
    """P/D 2 -> 1 with no pool in spawned processes: the producer's ranks send their whole blocks to the consumer
    over gloo send / recv. The tokens equal the simulated run's and one device's; the bytes are the hand count."""
    from cpattn.comm.launch import spawn

    cfg, params = model("qwen3")
    arr = arrivals(cfg.vocab_size)
    pd = dict(pd=True, pcp_size=2, dcp_size=1, block_size=BLOCK, scheduler=SCHED, poison=True)
    sim = merged(cpattn.simulate(3, run_rank, "qwen3", params, cfg, arr, **pd))
    assert sim == want("qwen3", arr)
    (t0, s0, _), (t1, s1, _), (t2, _, received) = spawn(3, gloo_sent, cfg, arr, pd)
    assert t0 == t1 and {**t0, **t2} == sim
    row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 8
    hand = sent_by_hand(arr, 1, row)
    assert {i: s0.get(i, 0) + s1.get(i, 0) for i in hand} == hand and received == sum(hand.values())
