"""The KV connector's parts in isolation: the whole-block point-to-point transport, the P/D connector's spans, the
composition's order and the pool connector's store rule. The engines' tokens are tested in tests/test_engine_pd.py
and tests/test_engine_run_rank.py."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.engine.connector import Handoff, KVConnector, MultiConnector, PoolConnector, Side, from_args
from cpattn.engine.connector_pd import MemoryLink, PDConnector, usable_blocks
from cpattn.engine.handoff import recv_block_pairs, send_block_pairs
from cpattn.models import qwen3

B, F = 4, 3


def payload(b: int, j: int) -> torch.Tensor:
    """A block whose every entry names its request and global block."""
    return torch.full((B, F), 100.0 * b + j)


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 3), (2, 3), (3, 2)])
def test_block_pairs_reach_rank_j_mod_d(p, d):
    """Block j of request b goes from producer rank j % P to consumer rank j % D, nothing else, each once."""
    nblocks, start = [5, 0, 7], [1, 0, 3]

    def rank(g):
        if g.rank < p:
            sent = send_block_pairs(g, payload, nblocks, prefill_rank=g.rank, pcp_size=p,
                                    decode_ranks=list(range(p, p + d)), start=start)
            return "sent", sent
        got = recv_block_pairs(g, nblocks, decode_rank=g.rank - p, dcp_size=d, prefill_ranks=list(range(p)),
                               block_size=B, width=F, dtype=torch.float32, start=start)
        return "got", {k: int(v[0, 0]) for k, v in got.items()} | {"same": all(bool((v == v[0, 0]).all())
                                                                              for v in got.values())}

    out = cpattn.simulate(p + d, rank)
    for c in range(d):
        kind, got = out[p + c]
        assert kind == "got" and got.pop("same")
        assert got == {(b, j): 100 * b + j for b in range(3) for j in range(start[b], nblocks[b]) if j % d == c}
    sent = [sum(out[r][1][b] for r in range(p)) for b in range(3)]
    assert sent == [(n - s) * B * F * 4 for n, s in zip(nblocks, start)]


def test_usable_blocks_are_whole_spans_leaving_a_token():
    for n in range(1, 60):
        for d in (1, 2, 3):
            spans = max(k for k in range(n + 1) if k * B * d <= n - 1)  # the longest prefix of whole spans
            assert usable_blocks(n, B, d) == spans * d, (n, d)


def side(role: str, dcp: int = 1, rank=None, read=None) -> Side:
    cfg = qwen3.Qwen3Config.tiny()
    return Side(qwen3.FAMILY, cfg, qwen3.init_params(cfg), B, B, dcp, rank, role, True,
                read=read or (lambda r, bid: payload(r, bid)))


class Spans(KVConnector):
    """A fake member providing spans [lo, hi), each span c one payload per rank (value c)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def fetch(self, tokens, start, stop):
        if start < self.lo:
            return []
        return [(torch.full((B, F), float(c)),) for c in range(start, min(stop, self.hi))]


def test_a_composition_goes_on_where_the_member_before_stopped():
    both = MultiConnector(Spans(0, 2), Spans(2, 5)).bind(side("kv_both"))
    assert [int(s[0][0, 0]) for s in both.fetch([1] * 40, 0, 9)] == [0, 1, 2, 3, 4]
    assert [int(s[0][0, 0]) for s in both.fetch([1] * 40, 1, 4)] == [1, 2, 3]
    gap = MultiConnector(Spans(0, 1), Spans(2, 5)).bind(side("kv_both"))  # span 1 is nowhere: stop there
    assert [int(s[0][0, 0]) for s in gap.fetch([1] * 40, 0, 9)] == [0]
    assert isinstance(Spans(0, 1) + Spans(1, 2) + Spans(2, 3), MultiConnector)
    assert len((Spans(0, 1) + Spans(1, 2) + Spans(2, 3)).connectors) == 3


def test_the_pd_connector_serves_received_spans_from_the_first_sent():
    """A producer of 1 rank, a consumer of 2 (in memory): a 21-token prompt has 2 whole spans of 8 tokens; with 2
    blocks found elsewhere (span 0), only blocks 2 and 3 move, and the consumer serves span 1 only."""
    link = MemoryLink(consumer_size=2)
    pd = PDConnector().linked(link)
    tokens = tuple(range(21))
    prod = pd.bind(side("kv_producer", read=lambda r, bid: payload(0, bid)))
    cons = pd.bind(side("kv_consumer", dcp=2))

    class Out:  # one finished request whose blocks 0..4 sit in device blocks 10..14
        req_ids, block_tables = ("a",), ((10, 11, 12, 13, 14),)

    class Req:
        status, finish_reason, num_prompt = "finished", "length", len(tokens)

    prod.save(Out, {"a": Req})
    assert sorted(prod._outbox["a"]) == [0, 1, 2, 3]
    h = [Handoff("a", tokens, 7, found=3)]  # 3 found: rounded down to the whole span 0
    prod.send(h)
    cons.recv(h)
    assert prod.stats.bytes_by_request == {"a": 2 * B * F * 4} and cons.stats.blocks_received == 2
    assert cons.fetch(tokens, 0, 2) == []  # span 0 was not sent: it must come from elsewhere
    spans = cons.fetch(tokens, 1, 2)
    assert [[int(x[0, 0]) for x in s] for s in spans] == [[12, 13]]  # blocks 2, 3 = device blocks 12, 13
    assert cons.fetch(tokens[:-1], 1, 2) == []  # another prompt

    class Ran:
        req_ids = ("a",)

    cons.save(Ran, {"a": Req})
    assert cons._inbox == {}
    with pytest.raises(ValueError, match="the consumer receives"):
        prod.recv(h)


def test_the_pool_connector_stores_unless_told_or_a_consumer():
    from cpattn.engine.pd_engine import memory_pool

    cfg = qwen3.Qwen3Config.tiny()
    pool = memory_pool("qwen3", cfg, qwen3.init_params(cfg), B)
    assert PoolConnector(pool).bind(side("kv_both"))._stores
    assert not PoolConnector(pool).bind(side("kv_consumer"))._stores
    assert not PoolConnector(pool, store=False).bind(side("kv_producer"))._stores
    with pytest.raises(ValueError, match="not both"):
        from_args(pool, PDConnector())
    with pytest.raises(ValueError, match="pass a cpattn.engine.connector.KVConnector"):
        from_args(None, "pd")
    assert isinstance(from_args(pool), PoolConnector) and from_args() is None


@pytest.mark.parametrize("dcp", [1, 2])
def test_the_pool_connector_counts_what_each_bound_engine_loaded(dcp):
    """A first engine stores a prompt's blocks, a second one (fresh, same pool) fetches them at admission: each
    bound copy counts its own loads, whole spans leaving one token to compute, N blocks per span, and their bytes
    are the pool's block shape in float32."""
    from math import prod

    from cpattn.engine.llm import LLMEngine, SamplingParams
    from cpattn.engine.pd_engine import memory_pool

    cfg = qwen3.Qwen3Config.tiny()
    params = qwen3.init_params(cfg)
    pool = memory_pool("qwen3", cfg, params, B)
    spec = PoolConnector(pool)
    prompt = list(range(1, 24))  # 23 tokens: 5 whole blocks of 4; spans of 4 * dcp tokens, the last token left
    engines = [LLMEngine("qwen3", params, cfg, block_size=B, interleave_size=B, dcp_size=dcp, kv_connector=spec)
               for _ in range(2)]
    outs = [e.generate([prompt], SamplingParams(max_tokens=2))[0].token_ids for e in engines]
    first, second = (e.connector for e in engines)
    spans = (len(prompt) - 1) // (B * dcp)
    assert outs[0] == outs[1] and spec.loaded_blocks == spec.loaded_bytes == 0  # the spec is never bound
    assert first.loaded_blocks == first.loaded_bytes == 0 and first.stored_blocks == 6  # 23 + 1 computed tokens
    assert second.loaded_blocks == spans * dcp == engines[1].stats.pool_hit_tokens // B
    assert second.loaded_bytes == spans * dcp * prod(pool.identity.block_shape) * 4
    for e in engines:
        e.close()
