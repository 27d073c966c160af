"""P/D in the step loop (PDEngine: a PCP prefill engine, a DCP decode engine, a KV connector between them: the
KV pool, or the P/D connector handing whole blocks over directly).

The oracle is that of tests/test_engine_loop.py: one-device greedy generation of each request alone. Fresh blocks
are NaN-poisoned on both roles, so a block the consumer neither fetched nor computed shows in its tokens.
"""

from __future__ import annotations

import pytest
import torch
from ref.greedy import ONE_DEVICE
from test_engine_loop import expected, model

from cpattn.config import SchedulerConfig
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.connector_pd import MemoryLink, PDConnector
from cpattn.engine.pd_engine import PDEngine

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


def schedule(vocab: int, seed: int = 3) -> list[dict]:
    """Requests arriving over steps: two share a 13-token prefix, one is a single token, one stops early."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = toks(13)
    return [dict(prompt=base + toks(6), max_tokens=5, arrive=0), dict(prompt=toks(1), max_tokens=4, arrive=0),
            dict(prompt=base + toks(2), max_tokens=6, arrive=2), dict(prompt=toks(9), max_tokens=1, arrive=3),
            dict(prompt=toks(25), max_tokens=4, arrive=5)]


def params_of(r: dict) -> SamplingParams:
    return SamplingParams(max_tokens=r["max_tokens"], stop_token_ids=tuple(r.get("stop", ())))


def serve(pd: PDEngine, reqs: list[dict]) -> dict:
    """Feed the arrivals (``arrive``: the step; ``abort``: the step to abort it at, optional), step until
    drained; {index: final RequestOutput}. test_engine_pd_v4 serves its V4 arrivals through it too."""
    ids, final, step = {}, {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    while pending or pd.has_unfinished():
        while pending and reqs[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            ids[pd.add_request(reqs[i]["prompt"], params_of(reqs[i]))] = i
        for rid, i in list(ids.items()):
            if reqs[i].get("abort") == step:
                pd.abort_request(rid)
        final.update({ids[o.request_id]: o for o in pd.step() if o.finished})
        step += 1
        assert step < 1000
    return final


LAYOUTS = [("qwen3", 1, 1, None), ("qwen3", 2, 1, None), ("qwen3", 1, 2, None), ("qwen3", 2, 2, None),
           ("qwen3", 3, 2, 6), ("deepseek_v32", 2, 2, None)]


@pytest.mark.parametrize("connector", ["pool", "direct"])
@pytest.mark.parametrize("family,p,d,heads", LAYOUTS, ids=str)
def test_pd_roles_give_one_device_greedy_tokens(family, p, d, heads, connector):
    """P and D of different sizes share the pool's blocks (keyed per block, not per rank), or get them from the
    P/D connector (block j from producer rank j % P to consumer rank j % D); a DSA model's prefill runs DSA-CP;
    arrivals, a stop token and a max_tokens=1 request (never handed off)."""
    cfg, params = model(family, heads)
    reqs = schedule(cfg.vocab_size)
    reqs[2]["stop"] = (expected(ONE_DEVICE, family, reqs[2], heads)[2],)  # stops at its third token
    direct = {"kv_connector": PDConnector()} if connector == "direct" else {}
    pd = PDEngine(family, params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=40, poison=True,
                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3), **direct)
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert list(final[i].token_ids) == expected(ONE_DEVICE, family, r, heads), f"request {i}"
    s = pd.stats
    assert final[2].finish_reason == "stop" and final[0].finish_reason == "length"
    assert s.handed_off == 4  # every request but the max_tokens=1 one went on to the decode role
    # the consumer fetched each handed-off prompt's whole blocks, leaving at least one token to compute
    span = BLOCK * d
    whole = sum((len(r["prompt"]) - 1) // span * span for r in reqs if r["max_tokens"] > 1)
    assert s.decode.pool_hit_tokens + s.decode.prefix_hit_tokens >= whole, s.decode
    assert s.decode.pool_hit_tokens > 0
    for role in (s.prefill, s.decode):
        assert (role.blocks_used, role.running, role.waiting) == (0, 0, 0), role
    if connector == "direct":  # every handed-off prompt's whole spans, counted by hand, went over; nothing else
        row = sum(lay.row_width for lay in pd.prefill.family.kv_layouts(cfg)) * 8  # float64 bytes per token
        sent = pd.prefill.connector.stats.bytes_by_request
        assert sent == {i: (len(r["prompt"]) - 1) // span * d * BLOCK * row for i, r in enumerate(reqs)
                        if r["max_tokens"] > 1}, sent
        assert s.decode.pool_blocks_stored == 0 and pd.pool is None
    pd.close()


def test_the_direct_connector_moves_kv_rows_of_the_hand_count():
    """Qwen3's row is layers x (K and V) x KV heads x head dim: a 19-token prompt to a 2-rank consumer moves
    spans 0 and 1 (16 tokens, 4 blocks), 4 * block_size rows; the consumer computes tokens 16..18 itself."""
    cfg, params = model("qwen3")
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=24, poison=True,
                  kv_connector=PDConnector())
    prompt = list(range(1, 20))
    out = pd.generate([prompt], SamplingParams(max_tokens=3))
    assert list(out[0].token_ids) == expected(ONE_DEVICE, "qwen3", dict(prompt=prompt, max_tokens=3))
    row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 8
    st = pd.prefill.connector.stats
    assert st.bytes_by_request == {0: 4 * BLOCK * row} and st.blocks_sent == 4
    assert pd.decode.connector.stats.blocks_received == 4 and pd.stats.decode.pool_hit_tokens == 16
    assert pd.decode.connector._inbox == {}  # dropped once the request ran
    pd.close()


@pytest.mark.parametrize("connector", ["pool", "direct"])
def test_the_decode_role_replays_captured_steps(connector):
    cfg, params = model("qwen3")
    reqs = schedule(cfg.vocab_size, seed=4)
    direct = {"kv_connector": PDConnector()} if connector == "direct" else {}
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=40, **direct,
                  graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    final = serve(pd, reqs)
    assert [list(final[i].token_ids) for i in range(len(reqs))] == [expected(ONE_DEVICE, "qwen3", r) for r in reqs]
    assert pd.stats.decode.replayed_steps > 0 and pd.stats.prefill.replayed_steps == 0
    pd.close()


def test_a_first_token_the_roles_disagree_on_is_an_error(monkeypatch):
    cfg, params = model("qwen3")
    pd = PDEngine("qwen3", params, cfg, block_size=BLOCK, num_blocks=16)
    real = pd.decode.step

    def wrong():
        return [o.__class__(o.request_id, o.prompt_token_ids, tuple(t + 1 for t in o.token_ids), o.finished,
                            o.finish_reason) for o in real()]

    monkeypatch.setattr(pd.decode, "step", wrong)
    with pytest.raises(RuntimeError, match="the roles diverged"):
        pd.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=3))


@pytest.mark.parametrize("connector", ["pool", "direct"])
def test_an_abort_in_either_role_frees_its_blocks(connector):
    cfg, params = model("qwen3")
    direct = {"kv_connector": PDConnector()} if connector == "direct" else {}
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=24, **direct,
                  scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2))
    a = pd.add_request(list(range(1, 30)), SamplingParams(max_tokens=5))  # 29 tokens: four prefill steps
    b = pd.add_request([3, 4, 5], SamplingParams(max_tokens=8))
    while pd.stats.handed_off == 0:
        pd.step()
    assert pd.abort_request(a)  # still prefilling
    pd.step()
    assert pd.abort_request(b)  # decoding
    while pd.has_unfinished():
        pd.step()
    s = pd.stats
    assert (s.prefill.blocks_used, s.decode.blocks_used, s.prefill.running, s.decode.running) == (0, 0, 0, 0)
    assert not pd.abort_request(b)
    c = pd.add_request([7, 8], SamplingParams(max_tokens=1))  # finishes on the producer: never handed off
    while pd.has_unfinished():
        pd.step()
    assert not pd.abort_request(c)  # finished there: False, as for any finished request
    if connector == "direct":  # nothing staged or waiting is left behind
        assert pd.prefill.connector._outbox == {} and pd.decode.connector._inbox == {}


def test_bad_setups_are_refused():
    cfg, params = model("qwen3")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PDEngine("qwen3", params, cfg, scheduler=SchedulerConfig(enable_prefix_caching=False))
    pd = PDEngine("qwen3", params, cfg, block_size=BLOCK, num_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        pd.add_request(list(range(20)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="not both"):
        PDEngine("qwen3", params, cfg, kv_pool=pd.pool, kv_connector=PDConnector())
    with pytest.raises(ValueError, match="PDConnector has no link"):
        LLMEngine("qwen3", params, cfg, kv_role="kv_producer", kv_connector=PDConnector())
    with pytest.raises(ValueError, match="kv_role='kv_both'"):
        LLMEngine("qwen3", params, cfg, kv_connector=PDConnector().linked(MemoryLink(1)))


def test_an_abort_while_waiting_on_the_consumer_drops_its_received_blocks():
    """One sequence at a time: b is handed over while a decodes, waits on the consumer with its blocks received,
    and is aborted there; nothing stays staged or received, and a's tokens are one device's."""
    cfg, params = model("qwen3")
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=1, block_size=BLOCK, num_blocks=24, poison=True,
                  kv_connector=PDConnector(), scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=1))
    pa, pb = list(range(1, 10)), list(range(20, 31))
    a = pd.add_request(pa, SamplingParams(max_tokens=6))
    b = pd.add_request(pb, SamplingParams(max_tokens=4))
    while pd.stats.handed_off < 2:
        pd.step()
    assert pd.decode.scheduler.requests[b].status == "waiting" and tuple(pb) in pd.decode.connector._inbox
    assert pd.abort_request(b)
    assert pd.decode.connector._inbox == {}
    final = {}
    while pd.has_unfinished():
        final.update({o.request_id: o for o in pd.step() if o.finished})
    assert list(final[a].token_ids) == expected(ONE_DEVICE, "qwen3", dict(prompt=pa, max_tokens=6))
    assert pd.decode.connector._inbox == {} and pd.prefill.connector._outbox == {}
    assert pd.stats.decode.blocks_used == 0


@pytest.mark.parametrize("p,d,graph", [(2, 2, True), (1, 2, False)])
def test_the_consumer_verifies_token_drafts_losslessly(p, d, graph):
    """Speculative decoding on the consumer (an n-gram drafter, k = 3; captured verify steps at P2/D2): tokens stay
    one-device greedy, drafts get accepted and rejected, the producer drafts nothing; a drafter that reads hidden
    states is refused in one line."""
    from cpattn.drafters.ngram import NgramDrafter

    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(11)
    unit = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
    reqs = [dict(prompt=unit * 4, max_tokens=6, arrive=0), dict(prompt=unit[:3] * 3, max_tokens=6, arrive=1),
            dict(prompt=torch.randint(0, cfg.vocab_size, (17,), generator=g).tolist(), max_tokens=6, arrive=2)]
    pd = PDEngine("qwen3", params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=40, poison=True,
                  graph_mode="FULL_DECODE_ONLY" if graph else "NONE", graph_backend="eager",
                  drafter=NgramDrafter(), num_speculative_tokens=3,
                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert list(final[i].token_ids) == expected(ONE_DEVICE, "qwen3", r), f"request {i}"
    s = pd.stats
    assert 0 < s.decode.accepted_tokens < s.decode.drafted_tokens, s.decode
    assert s.prefill.drafted_tokens == 0 and s.handed_off == 3
    assert s.decode.blocks_used == 0 and s.prefill.blocks_used == 0
    if graph:
        assert s.decode.replayed_steps > 0, s.decode
    pd.close()  # drafters reading hidden states (MTP, Eagle3, DSpark): tests/test_engine_loop_pd_drafters.py
