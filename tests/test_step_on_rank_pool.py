"""``driver.generate_on_rank`` colocated with a KV pool runs through the step loop
(:func:`cpattn.engine.step_on_rank.step_on_rank`: run_rank colocated, the pool its prefix cache's second tier).

On the simulated mesh, float64 tiny Qwen3 and DeepSeek-V3.2, at 1 rank, DCP 2 and PCP 2 + DCP 2: a cold run and
then a warm run through one pool (an in-process dict pool, and LMDB through a ``PoolSpec``). Every rank's
tokens are one-device greedy's (conftest.py's ``one_device``), the warm run finds the hand-counted whole shared
blocks, the pool holds the hand-counted blocks (the prompts' and those the decoded tokens fill, each once),
the prompt logits are the oracle's rows of the computed positions, and nothing stays open. The composition
(``driver.composed_on_rank``) is never called, except for PCP over more ranks than DCP (the engine takes no pool
on ranks that hold no KV). One gloo case (slow).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_pool import tiny  # the same tiny float64 Qwen3 and DeepSeek-V3.2

import cpattn
from cpattn.comm.launch import spawn
from cpattn.engine import driver, pooling
from cpattn.engine.kv_rows import row_width
from cpattn.engine.pd_engine import memory_pool
from cpattn.engine.pooling import PoolSpec

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
BLOCK = 4
NEW = 3  # 2 decoded tokens fed back: they fill a block where a prompt leaves 2 tokens of one
TOL = dict(rtol=1e-8, atol=1e-8)
S = list(range(3, 3 + 16))  # 4 whole blocks, shared
COLD = [S + [40, 41, 42, 43, 44, 45], S[:8] + [46]]  # 22 tokens: 5 blocks + 2; 9 tokens: 2 blocks (S's) + 1
WARM = [S + [50, 51, 52, 53, 54], S[:8] + [55, 56, 57]]  # 21 tokens: 4 shared blocks; 11: 2 shared blocks
# cold: A's 5 prompt blocks and its 6th (2 prompt + 2 decoded tokens: 24 computed); B's 2 are A's, its 11
# computed tokens fill no 3rd. Warm: A's new 5th (23 computed), B's new 3rd (8 prompt tokens after S's 8, and
# 2 decoded: 13 computed)
COLD_STORED, WARM_STORED = 6, 2
HITS = (4, 2)  # whole spans under DCP 1 and 2 alike (a span: BLOCK * N tokens), one prompt token left
LAYOUTS = [(1, 1), (1, 2), (2, 2), (2, 1)]  # (P, N); P > N: the ranks past N hold no blocks


def configs(fam, cfg, p, n):
    return driver.engine_configs(fam, cfg, pcp_size=p, dcp_size=n, block_size=BLOCK, interleave_size=BLOCK)


def run(fam, cfg, params, prompts, p, n, pool):
    pre, dec = configs(fam, cfg, p, n)
    return cpattn.simulate(max(p, n), driver.generate_on_rank, fam, params, cfg, prompts, NEW, prefill=pre,
                           decode=dec, pool=pool)


@pytest.fixture
def no_composition(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("generate_on_rank took the fixed-batch composition")

    monkeypatch.setattr(driver, "composed_on_rank", refuse)


def computed_rows(want, prompts, hits):
    """The oracle's prompt logits of the positions a run with ``hits`` pooled blocks per prompt computes."""
    rows = torch.split(want.prompt_logits, [len(q) for q in prompts])
    return torch.cat([r[h * BLOCK:] for r, h in zip(rows, hits)])


def check(gens, want, prompts, hits, stored, block_bytes):
    n = sum(g.facts.kv_bytes > 0 for g in gens)  # the DCP ranks (PCP wider than DCP: the first N of them)
    assert all(g.facts.kv_bytes > 0 for g in gens[:n]) and all(g.facts.pool.blocks_stored == 0 for g in gens[n:])
    for g in gens:
        assert torch.equal(g.tokens, want.tokens)
        assert torch.allclose(g.logits, want.logits, **TOL)
        assert torch.allclose(g.prompt_logits, computed_rows(want, prompts, hits), **TOL)
        f = g.facts
        assert f.role == "both" and f.ttft_s > 0 and len(f.step_s) == NEW - 1
        assert f.pool.hit_blocks == hits
        assert f.pool.blocks_loaded == sum(hits) and f.pool.bytes_loaded == sum(hits) * block_bytes  # every rank
        assert f.pool.bytes_stored == f.pool.blocks_stored * block_bytes
        assert (f.pool.load_s > 0) and (f.pool.store_s > 0 or f.pool.blocks_stored == 0)
    assert sum(g.facts.pool.blocks_stored for g in gens) == stored  # each block by the DCP rank holding it


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v32"])
@pytest.mark.parametrize("p,n", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_cold_then_warm_through_one_pool(one_device, no_composition, tmp_path, name, p, n, kind):
    fam, cfg, params = tiny(name)
    pool = memory_pool(fam, cfg, params, BLOCK) if kind == "memory" else PoolSpec(f"lmdb:{tmp_path}", model=name)
    block_bytes = BLOCK * row_width(tuple(fam.kv_layouts(cfg))) * 8  # float64
    computed = []  # each prompt with the decoded tokens fed back: the tokens whose whole blocks are stored
    for prompts, hits, stored in ((COLD, (0, 0), COLD_STORED), (WARM, HITS, WARM_STORED)):
        gens = run(fam, cfg, params, prompts, p, n, pool)
        check(gens, one_device(fam, params, cfg, prompts, NEW), prompts, hits, stored, block_bytes)
        computed += [q + gens[0].tokens[b, :NEW - 1].tolist() for b, q in enumerate(prompts)]
    assert not pooling._OPEN  # every rank released what it opened (a PoolSpec's LMDB environment)
    opened = pool.open_for(fam, cfg, params, BLOCK) if kind == "lmdb" else pool
    try:
        assert [opened.lookup(opened.keys(q)) for q in computed] == [6, 2, 5, 3]  # every whole block, found
        if kind == "memory":  # each stored block once, nothing else
            assert len(pool.backend.entries) == COLD_STORED + WARM_STORED
    finally:
        if kind == "lmdb":
            pooling.release(opened)
    assert not pooling._OPEN


def test_a_pd_connector_with_pcp_wider_than_dcp_is_refused():
    """PCP 2 / DCP 1 takes a pool (above) but not a P/D connector: it hands a producer rank's blocks to a
    consumer rank, and rank 1 holds none. One line, before any step."""
    from cpattn.engine.connector_pd import PDConnector
    from cpattn.engine.llm import LLMEngine

    fam, cfg, params = tiny("qwen3")
    with pytest.raises(RuntimeError, match="a P/D connector hands a producer rank's blocks to a consumer rank"):
        cpattn.simulate(2, lambda g: LLMEngine(fam, params, cfg, world=g, pcp_size=2, dcp_size=1, block_size=BLOCK,
                                               kv_connector=PDConnector()))


def cold_then_warm(group, fam, params, cfg, spec):
    """On every gloo rank: a cold and a warm colocated DCP 2 run through one pool."""
    pre, dec = configs(fam, cfg, 1, 2)
    return [driver.generate_on_rank(group, fam, params, cfg, prompts, NEW, prefill=pre, decode=dec, pool=spec)
            for prompts in (COLD, WARM)]


@pytest.mark.slow
def test_gloo_colocated_dcp_with_a_pool(one_device, tmp_path):
    fam, cfg, params = tiny("qwen3")
    per_rank = spawn(2, cold_then_warm, "qwen3", params, cfg, PoolSpec(f"lmdb:{tmp_path}", model="m"))
    for i, (prompts, hits, stored) in enumerate(((COLD, (0, 0), COLD_STORED), (WARM, HITS, WARM_STORED))):
        gens = [r[i] for r in per_rank]
        assert all(torch.equal(g.tokens, one_device(fam, params, cfg, prompts, NEW).tokens) for g in gens)
        assert all(g.facts.pool.hit_blocks == hits for g in gens)
        assert sum(g.facts.pool.blocks_stored for g in gens) == stored
