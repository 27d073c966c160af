"""P/D in the step loop (PDEngine: a PCP prefill engine, a DCP decode engine, the KV pool between them).

The oracle is that of tests/test_engine_loop.py: one-device greedy generation of each request alone. Fresh blocks
are NaN-poisoned on both roles, so a block the consumer neither fetched nor computed shows in its tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_loop import expected, model

from cpattn.config import SchedulerConfig
from cpattn.engine.llm import SamplingParams
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


def serve(pd: PDEngine, reqs: list[dict]) -> dict:
    """Feed the arrivals, step until drained; {index: final RequestOutput}."""
    ids, final, step = {}, {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    while pending or pd.has_unfinished():
        while pending and reqs[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            ids[pd.add_request(reqs[i]["prompt"], SamplingParams(max_tokens=reqs[i]["max_tokens"],
                                                                 stop_token_ids=tuple(reqs[i].get("stop", ()))))] = i
        final.update({ids[o.request_id]: o for o in pd.step() if o.finished})
        step += 1
        assert step < 1000
    return final


@pytest.mark.parametrize("family,p,d,heads", [("qwen3", 1, 1, None), ("qwen3", 2, 1, None), ("qwen3", 1, 2, None),
                                              ("qwen3", 2, 2, None), ("qwen3", 3, 2, 6),
                                              ("deepseek_v32", 2, 2, None)], ids=str)
def test_pd_roles_give_one_device_greedy_tokens(family, p, d, heads):
    """P and D of different sizes share the pool's blocks (keyed per block, not per rank); a DSA model's
    prefill runs DSA-CP; arrivals, a stop token and a max_tokens=1 request (never handed off)."""
    cfg, params = model(family, heads)
    reqs = schedule(cfg.vocab_size)
    reqs[2]["stop"] = (expected(family, reqs[2], heads)[2],)  # stops at its third token
    pd = PDEngine(family, params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=40, poison=True,
                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert list(final[i].token_ids) == expected(family, r, heads), f"request {i}"
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
    pd.close()


def test_the_decode_role_replays_captured_steps():
    cfg, params = model("qwen3")
    reqs = schedule(cfg.vocab_size, seed=4)
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=40,
                  graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    final = serve(pd, reqs)
    assert [list(final[i].token_ids) for i in range(len(reqs))] == [expected("qwen3", r) for r in reqs]
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


def test_an_abort_in_either_role_frees_its_blocks():
    cfg, params = model("qwen3")
    pd = PDEngine("qwen3", params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=24,
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


def test_bad_setups_are_refused():
    cfg, params = model("qwen3")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PDEngine("qwen3", params, cfg, scheduler=SchedulerConfig(enable_prefix_caching=False))
    pd = PDEngine("qwen3", params, cfg, block_size=BLOCK, num_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        pd.add_request(list(range(20)), SamplingParams(max_tokens=4))
