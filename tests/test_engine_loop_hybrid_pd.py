"""P/D of a hybrid model (Qwen3-Next) in the step loop: a producer of P ranks prefills, a consumer of D ranks decodes.

The producer hands each request's prompt KV blocks (every one, the last partial), its linear layers' states
after the whole prompt and its first-token logits to the consumer through ``PDConnector()``
(:mod:`cpattn.engine.connector_hybrid`): in memory (PDEngine) or rank to rank (run_rank on the simulated mesh,
gloo). The consumer computes no prompt token (counted: the prefill rows its runners compute).

The oracle: one-device greedy recompute, written here plainly -- each next token is the argmax of the last row
of a full one-device prefill (a dense KV cache and zero linear states) of the prompt and the tokens so far.
Float64 tiny weights (std 0.2, so the states move the logits). Fresh blocks are NaN-poisoned, and so is every
free state slot, so a KV row or a state the consumer neither received nor computed shows in its tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch
from ref.greedy import ONE_DEVICE

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.dense_cache import DenseKVCache
from cpattn.engine.driver import engine_configs, generate, step_loop_runs
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import PDEngine
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.models import qwen3_next as qn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
BLOCK = 4
SIZES = [(1, 1), (2, 1), (1, 2), (2, 2)]
TOL = dict(rtol=1e-9, atol=1e-9)


@functools.lru_cache(maxsize=None)
def model():
    cfg = qn.Qwen3NextConfig.tiny()
    return cfg, qn.init_params(cfg, seed=1, std=0.2, dtype=torch.float64)


def one_device(tokens: list[int]):
    """A full one-device prefill of ``tokens``: (logits [L, V], the linear layers' states after it)."""
    cfg, params = model()
    n = len(tokens)
    cache = DenseKVCache.empty(qn.FAMILY.kv_layouts(cfg), batch=1, max_len=n, dtype=torch.float64)
    lin = qn.recurrent_cache(cfg, batch=1, dtype=torch.float64).step([n])
    logits = qn.forward(params, cfg, torch.tensor(tokens), cache.step([n]), lin)
    return logits, lin.finish()


def greedy(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The one-device greedy recompute of tests/ref/greedy.py (conftest's ``one_device``): n tokens."""
    cfg, params = model()
    return tuple(ONE_DEVICE.tokens(qn.FAMILY, params, cfg, list(prompt), n))


def expected(r: dict) -> list[int]:
    ref = list(greedy(tuple(r["prompt"]), r["max_tokens"]))
    for j, t in enumerate(ref):
        if t in r.get("stop", ()):
            return ref[:j + 1]
    return ref


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sched(**over) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 4, "enable_prefix_caching": False,
                              **over})


def schedule() -> list[dict]:
    """Seven requests over six steps, prompts of 1 .. 40 tokens (block multiples 4, 8, 16 and not); a budget of
    16 cuts the 40- and 27-token prompts into chunks on both roles. Request 4 has max_tokens=1 (done on the
    producer, never handed off); request 5 stops at its third token."""
    reqs = [dict(prompt=prompt(n, 50 + i), max_tokens=m, arrive=a)
            for i, (n, m, a) in enumerate(((13, 6, 0), (1, 4, 0), (40, 6, 1), (8, 5, 1), (16, 1, 2), (27, 6, 3),
                                           (4, 3, 5)))]
    reqs[5]["stop"] = (expected(reqs[5])[2],)
    return reqs


def params_of(r: dict) -> SamplingParams:
    return SamplingParams(max_tokens=r["max_tokens"], stop_token_ids=tuple(r.get("stop", ())))


def serve(pd: PDEngine, reqs: list[dict]) -> dict:
    """Feed the arrivals (``arrive``: the step), step until drained: {index: final RequestOutput}."""
    ids, final, step = {}, {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    while pending or pd.has_unfinished():
        while pending and reqs[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            ids[pd.add_request(reqs[i]["prompt"], params_of(reqs[i]))] = i
        final.update({ids[o.request_id]: o for o in pd.step() if o.finished})
        step += 1
        assert step < 500
    return final


def hand_count(length: int, consumers: int) -> int:
    """Bytes of one request's hand-off, by hand: ceil(L / 4) blocks of 4 rows, each row K and V of every
    full-attention layer; then, per consumer rank, every linear layer's conv state (K - 1) x C and recurrent
    state Hv x Dk x Dv, and V logits. float64."""
    cfg, _ = model()
    full = cfg.layer_types.count("full_attention")
    linear = cfg.layer_types.count("linear_attention")
    row = full * 2 * cfg.num_key_value_heads * cfg.head_dim
    c = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    states = linear * ((cfg.linear_conv_kernel_dim - 1) * c
                       + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
    return 8 * (-(-length // BLOCK) * BLOCK * row + consumers * (states + cfg.vocab_size))


def want_bytes(reqs: list[dict], consumers: int) -> dict:
    return {i: hand_count(len(r["prompt"]), consumers) for i, r in enumerate(reqs) if r["max_tokens"] > 1}


def counted(engine: LLMEngine) -> list[list[int]]:
    """Wrap each runner's model step: the prefill tokens it computed land in the returned lists."""
    seen = []
    for r in engine.runners:
        tokens = []

        def run(out, inner=r._run, tokens=tokens):
            tokens.extend(q for q, p in zip(out.query_lens, out.is_prefill) if p)
            return inner(out)
        r._run = run
        seen.append(tokens)
    return seen


def drained(engine: LLMEngine) -> None:
    """No block, request or state slot left, every free slot NaN (the last finishes reach the runner next step)."""
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    engine.step()
    for r in engine.runners:
        assert r.live == 0 and sorted(r._free) == list(range(engine.scheduler_config.max_num_seqs))
        assert all(bool(t.isnan().all()) for t in (*r.states.conv, *r.states.state)), "a slot left unpoisoned"


def pd_engine(p: int, d: int, **kw) -> PDEngine:
    cfg, params = model()
    return PDEngine("qwen3_next", params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK,
                    num_blocks=kw.pop("num_blocks", 40), poison=True, scheduler=kw.pop("scheduler", sched()), **kw)


@pytest.mark.parametrize("p,d", SIZES, ids=str)
def test_pd_engine_hands_blocks_and_states_over(p, d):
    reqs = schedule()
    pd = pd_engine(p, d, **({"graph_mode": "FULL_DECODE_ONLY", "graph_backend": "eager"} if d == 2 else {}))
    computed = counted(pd.decode)
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert list(final[i].token_ids) == expected(r), f"request {i}"
    assert final[5].finish_reason == "stop" and pd.stats.handed_off == 6
    assert computed == [[]] * d  # the consumer computed no prompt token
    assert pd.prefill.connector.stats.bytes_by_request == want_bytes(reqs, d)
    assert pd.decode.connector.stats.bytes_received == sum(want_bytes(reqs, d).values())
    assert pd.decode.connector._inbox == {} and pd.prefill.connector._outbox == {}
    if d == 2:
        assert pd.stats.decode.replayed_steps > 0
    assert pd.stats.prefill.pcp_steps == (0 if p == 1 else pd.stats.prefill.eager_steps)
    drained(pd.prefill), drained(pd.decode)
    pd.close()


def test_the_consumer_continues_from_the_producers_exact_state():
    """The states the consumer installs are the producer's bits (PCP 2 -> DCP 2), within 1e-12 of one device's
    after the prompt; the first-token logits too."""
    reqs = [dict(prompt=prompt(n, 90 + n), max_tokens=3, arrive=0) for n in (7, 21)]
    pd = pd_engine(2, 2)
    staged, placed = {}, {}
    stage = pd.prefill.connector.stage

    def keep(rid, conv, state, logits, n, rank):
        if rank == 0:
            staged[rid] = ([t.clone() for t in conv], [t.clone() for t in state], logits.clone())
        return stage(rid, conv, state, logits, n, rank)
    pd.prefill.connector.stage = keep
    for r in pd.decode.runners:
        def handed(out, got, inner=r._handed, r=r):
            res = inner(out, got)
            for b in got:
                if out.samples[b]:
                    slot = r.slots[out.req_ids[b]]
                    placed.setdefault(r.group.rank, {})[out.req_ids[b]] = (
                        [t[slot].clone() for t in r.states.conv], [t[slot].clone() for t in r.states.state])
            return res
        r._handed = handed
    final = serve(pd, reqs)
    assert [list(final[i].token_ids) for i in range(2)] == [expected(r) for r in reqs]
    worst = 0.0
    for i, r in enumerate(reqs):
        conv, state, logits = staged[i]
        for rank in (0, 1):
            got_conv, got_state = placed[rank][i]
            assert all(torch.equal(a, b) for a, b in zip(got_conv + got_state, conv + state))
        ref_logits, ref = one_device(r["prompt"])
        for a, b in zip(conv + state + [logits], [t[0] for t in (*ref.conv, *ref.state)] + [ref_logits[-1]]):
            worst = max(worst, float((a - b).abs().max()))
    assert worst < 1e-12, worst
    pd.close()


def test_a_request_the_consumer_preempts_is_recomputed_there():
    """The consumer's 6 blocks x 4 tokens per rank (DCP 2) cannot hold the three requests' growth: it preempts,
    and a readmission after the prompt recomputes prompt + outputs there."""
    reqs = [dict(prompt=prompt(n, 70 + n), max_tokens=8, arrive=a) for n, a in ((13, 0), (9, 0), (14, 1))]
    pd = pd_engine(2, 2, num_blocks=6)
    computed = counted(pd.decode)
    final = serve(pd, reqs)
    assert [list(final[i].token_ids) for i in range(3)] == [expected(r) for r in reqs]
    assert pd.stats.decode.preemptions > 0
    assert computed[0] and computed[0] == computed[1]  # recomputes, on both DCP ranks
    drained(pd.decode)
    pd.close()


def test_seeded_sampling_gives_the_one_engine_tokens():
    cfg, params = model()
    prompts = [prompt(11, 3), prompt(5, 4)]
    sp = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.95, seed=7)
    one = LLMEngine("qwen3_next", params, cfg, block_size=BLOCK, num_blocks=40, scheduler=sched())
    want = [o.token_ids for o in one.generate(prompts, sp)]
    pd = pd_engine(2, 2)
    assert [o.token_ids for o in pd.generate(prompts, sp)] == want
    pd.close()


def test_what_hybrid_pd_cannot_do_is_refused():
    from cpattn.engine.pd_engine import memory_pool

    cfg, params = model()
    with pytest.raises(ValueError, match="kv_pool: qwen3_next is a hybrid model"):
        PDEngine("qwen3_next", params, cfg, block_size=BLOCK, kv_pool=memory_pool("qwen3", *qwen3_tiny(), BLOCK))
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        PDEngine("qwen3_next", params, cfg, block_size=BLOCK, scheduler=SchedulerConfig())
    # (a drafter reading hidden states is served: tests/test_engine_loop_pd_hidden_v4_hybrid.py)


def qwen3_tiny():
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny()
    return cfg, qwen3.init_params(cfg)


# -- cpattn.engine.generate: a hybrid P/D layout through the step loop, against the composition ---------------------
@pytest.mark.parametrize("p,d", [(2, 2), (1, 2), (2, 1)], ids=str)
def test_generate_pd_is_the_compositions_generation(p, d):
    cfg, params = model()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 4, 9)]
    pre, dec = engine_configs("qwen3_next", cfg, pcp_size=p, dcp_size=d, pd=True, block_size=BLOCK,
                              interleave_size=BLOCK)
    assert step_loop_runs(get_family("qwen3_next"), cfg, pre, dec, None)  # generate takes the step loop
    want = composed(get_family("qwen3_next"), params, cfg, Prompts.of(prompts), 5, prefill=pre, decode=dec)
    got = generate("qwen3_next", params, cfg, prompts, 5, prefill=pre, decode=dec)
    assert torch.equal(got.tokens, want.tokens)
    assert got.tokens.tolist() == [list(greedy(tuple(q), 5)) for q in prompts]
    assert got.logits.shape == want.logits.shape and torch.allclose(got.logits, want.logits, **TOL)
    assert torch.allclose(got.prompt_logits, want.prompt_logits, **TOL)
    assert got.stats.steps == want.stats.steps == 4


# -- run_rank: the producer's ranks send rank to rank over the world -------------------------------------------------
def arrivals(reqs: list[dict]) -> list[Arrival]:
    return [Arrival(r["prompt"], params_of(r), r["arrive"]) for r in reqs]


def pd_rank(world, arr, kwargs):
    """run_rank with the float64 test model (rebuilt, so a spawned rank has it too): the final tokens and the
    bytes this rank's connector sent (producer) or received (consumer) per request."""
    cfg, params = model()
    seen = []
    finals = run_rank(world, "qwen3_next", params, cfg, arr, **kwargs, on_step=lambda role, e, outs: seen.append(e))
    st = seen[-1].connector.stats
    return {i: list(o.token_ids) for i, o in finals.items()}, dict(st.bytes_by_request), st.bytes_received


def check_ranks(res, reqs, p, d) -> None:
    tokens = {}
    for finals, _, _ in res:
        for i, t in finals.items():
            assert tokens.setdefault(i, t) == t, f"ranks disagree on request {i}"
    assert tokens == {i: expected(r) for i, r in enumerate(reqs)}
    assert set(res[0][0]) == {4} and set(res[p][0]) == set(range(len(reqs))) - {4}  # max_tokens=1: the producer's
    want = want_bytes(reqs, d)
    assert {i: sum(res[r][1].get(i, 0) for r in range(p)) for i in want} == want
    assert sum(res[p + r][2] for r in range(d)) == sum(want.values())


@pytest.mark.parametrize("p,d", [(2, 2), (1, 2), (2, 1)], ids=str)
def test_run_rank_pd_on_the_simulated_mesh(p, d):
    reqs = schedule()
    kw = dict(pd=True, pcp_size=p, dcp_size=d, block_size=BLOCK, scheduler=sched(), poison=True, num_blocks=40)
    check_ranks(cpattn.simulate(p + d, pd_rank, arrivals(reqs), kw), reqs, p, d)


@pytest.mark.slow
def test_gloo_ranks_hand_blocks_and_states_rank_to_rank():
    """P/D 2 -> 2 in spawned processes: blocks j % 2 -> j % 2, the states from producer rank d % 2 to consumer
    rank d over gloo send / recv; the tokens are one device's and the bytes the hand count."""
    from cpattn.comm.launch import spawn

    reqs = schedule()
    kw = dict(pd=True, pcp_size=2, dcp_size=2, block_size=BLOCK, scheduler=sched(), poison=True, num_blocks=40)
    check_ranks(spawn(4, pd_rank, arrivals(reqs), kw), reqs, 2, 2)
