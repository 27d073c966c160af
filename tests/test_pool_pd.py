"""A KV pool beside P/D.

``driver.generate_on_rank`` runs P/D through the step loop (:mod:`cpattn.engine.step_on_rank`, run_rank's
``kv_pool``): the producer ranks start from the pool's whole blocks, prefill the rest and store the new whole
blocks they own; the consumer ranks then load every block they can use from the pool, so no block crosses the
P/D link (a drafter's hidden rows still do). The fixed-batch composition (``driver.composed_on_rank``, what a
cached ``prefix`` runs): each decode rank loads its own cached blocks from the pool and receives only the
blocks after them, then stores the new whole blocks it owns (each block once).

Real LMDB stores in a temporary directory (the embedded default); float64 tiny Qwen3, so tokens must be
identical to conftest.py's ``one_device`` recompute (a fresh one-device full prefill per token, no engine code)
and to a P/D run without a pool.
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from spec_methods_cases import head, prompts, target

from cpattn.comm.launch import spawn
from cpattn.engine import driver
from cpattn.engine.drafters import speculative_fields
from cpattn.engine.pooling import PoolSpec
from cpattn.engine.prefill_steps import Prefix
from cpattn.models import qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
NEW = 4
SHARED = list(range(3, 3 + 18))  # 4 whole blocks and 2 tokens shared by both prompts
COLD = [SHARED + [40, 41], SHARED[:9]]  # 5 whole blocks; 2 whole blocks (prompt 0's first two) + 1 token
WARM = [SHARED + [50, 51, 52], SHARED[:9] + [60]]  # a shared prefix and a new suffix: block 4 of prompt 0 is new


def tiny():
    cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return qwen3.FAMILY, cfg, qwen3.FAMILY.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)


def configs(fam, cfg, p, n):
    return driver.engine_configs(fam, cfg, pcp_size=p, dcp_size=n, block_size=BLOCK, interleave_size=BLOCK, pd=True)


def run(fam, cfg, params, prompts, p, n, pool=None, prefix=None, fn=driver.generate_on_rank):
    """``fn`` on P + N simulated ranks: ``generate_on_rank`` (P/D with a pool: the step loop's run_rank,
    :mod:`cpattn.engine.step_on_rank`; with a prefix: the composition) or ``driver.composed_on_rank``."""
    pre, dec = configs(fam, cfg, p, n)
    return cpattn.simulate(p + n, fn, fam, params, cfg, prompts, NEW, prefill=pre, decode=dec, pool=pool,
                           prefix=prefix)


def composed(*args, **kwargs):
    """:func:`run` through the fixed-batch composition (``driver.composed_on_rank``: its hand-off, its pool)."""
    return run(*args, **kwargs, fn=driver.composed_on_rank)


@pytest.fixture
def prefilled(monkeypatch):
    """The number of prompt tokens each prefill rank computed, per run (prefill_fn is the driver's seam)."""
    seen = []
    real = driver.prefill_fn

    def counting(pg, family, params, cfg, p, *args):
        prefix = args[2]
        seen.append(sum(p.prompt_lens) - (sum(prefix.context_lens) if prefix is not None else 0))
        return real(pg, family, params, cfg, p, *args)

    monkeypatch.setattr(driver, "prefill_fn", counting)
    return seen


def pool_of(gens, p):
    return [g.facts.pool for g in gens[:p]], [g.facts.pool for g in gens[p:]]


def link_bytes(gens, p):
    """Bytes of KV blocks the decode ranks received over the P/D link (what the prefill ranks sent)."""
    got = sum(g.facts.handoff.bytes_received for g in gens[p:])
    assert got == sum(g.facts.handoff.bytes_sent for g in gens[:p])
    return got


@pytest.mark.parametrize("p,n", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=lambda v: str(v))
def test_a_warm_pd_run_starts_from_the_pool(one_device, tmp_path, prefilled, p, n):
    """The composition's pool beside its P/D hand-off (``composed_on_rank``; ``generate_on_rank`` runs P/D
    through the step loop, test_step_on_rank.py)."""
    fam, cfg, params = tiny()
    pool = PoolSpec(f"lmdb:{tmp_path}", model="qwen3-seed0")
    ref = one_device(fam, params, cfg, COLD, NEW).tokens
    plain = composed(fam, cfg, params, COLD, p, n)
    assert torch.equal(plain[0].tokens, ref)
    prefilled.clear()

    cold = composed(fam, cfg, params, COLD, p, n, pool)
    assert all(torch.equal(g.tokens, ref) for g in cold)
    pre, dec = pool_of(cold, p)
    assert all(f.hit_blocks == (0, 0) for f in pre + dec)
    assert sum(f.blocks_stored for f in dec) == 5 and all(f.blocks_stored == 0 for f in pre)  # each block once
    assert sum(f.bytes_stored for f in dec) == 5 * BLOCK * 64 * 8  # F = 2 layers * K, V * 2 heads * 8, float64
    assert prefilled == [sum(map(len, COLD))] * p
    assert link_bytes(cold, p) == link_bytes(plain, p)  # 8 blocks: nothing was cached
    prefilled.clear()

    again = composed(fam, cfg, params, COLD, p, n, pool)  # the same prompts
    assert all(torch.equal(g.tokens, ref) for g in again)
    pre, dec = pool_of(again, p)
    assert all(f.hit_blocks == (4, 2) for f in pre + dec)  # one token of each prompt left to compute
    assert all(f.blocks_loaded == 6 for f in pre)  # every prefill rank needs the whole prefix
    assert sum(f.blocks_loaded for f in dec) == 6  # each decode rank loads the cached blocks it owns
    assert sum(f.blocks_stored for f in pre + dec) == 0
    assert prefilled == [sum(map(len, COLD)) - 6 * BLOCK] * p
    assert link_bytes(again, p) == link_bytes(plain, p) * 2 // 8  # 2 of 8 blocks cross the link
    prefilled.clear()

    warm = composed(fam, cfg, params, WARM, p, n, pool)  # a shared prefix and a new suffix
    want = one_device(fam, params, cfg, WARM, NEW).tokens
    assert all(torch.equal(g.tokens, want) for g in warm)
    pre, dec = pool_of(warm, p)
    assert all(f.hit_blocks == (4, 2) for f in pre + dec)
    assert sum(f.blocks_stored for f in dec) == 1  # prompt 0's new 5th block, by its owner 4 % n
    assert dec[4 % n].blocks_stored == 1
    assert prefilled == [sum(map(len, WARM)) - 6 * BLOCK] * p


def test_an_explicit_prefix_across_pd(one_device, tmp_path):
    """A whole-block cached prefix on every rank: the decode ranks keep their rows of it, the prefill sends only
    the blocks after it; a prefix that is not whole blocks is refused."""
    fam, cfg, params = tiny()
    ref = one_device(fam, params, cfg, COLD, NEW).tokens
    spec = PoolSpec(f"lmdb:{tmp_path}", model="m")
    run(fam, cfg, params, COLD, 1, 1, spec)  # fill a pool, then read the prefix out of it
    pool = spec.open_for(fam, cfg, params, BLOCK)
    rows = [t.reshape(BLOCK, -1) for q, n in zip(COLD, (4, 2)) for t in pool.load(pool.keys(q)[:n])]
    from cpattn.engine.pooling import release

    release(pool)
    prefix = Prefix(torch.cat(rows), (16, 8))
    got = run(fam, cfg, params, COLD, 2, 2, prefix=prefix)
    assert all(torch.equal(g.tokens, ref) for g in got)
    assert sum(g.facts.handoff.blocks_received for g in got[2:]) == 2
    with pytest.raises(RuntimeError, match="whole blocks of block_size=4"):
        run(fam, cfg, params, COLD, 1, 1, prefix=Prefix(torch.cat(rows)[:23], (15, 8)))


def cold_then_warm(group, fam, params, cfg, p, n, spec):
    """On every gloo rank: a cold and a warm P/D run through one pool."""
    pre, dec = configs(fam, cfg, p, n)
    return [driver.generate_on_rank(group, fam, params, cfg, prompts, NEW, prefill=pre, decode=dec, pool=spec)
            for prompts in (COLD, WARM)]


@pytest.mark.slow
def test_gloo_pd_with_a_pool(one_device, tmp_path):
    fam, cfg, params = tiny()
    per_rank = spawn(3, cold_then_warm, "qwen3", params, cfg, 1, 2, PoolSpec(f"lmdb:{tmp_path}", model="m"))
    for prompts, run_ in ((COLD, 0), (WARM, 1)):
        want = one_device(fam, params, cfg, prompts, NEW).tokens
        gens = [r[run_] for r in per_rank]
        assert all(torch.equal(g.tokens, want) for g in gens)
        assert gens[0].facts.pool.hit_blocks == ((0, 0) if run_ == 0 else (4, 2))  # the producer's prefix
        assert all(g.facts.pool.hit_blocks == (4, 2) for g in gens[1:])  # every usable block, from the pool
        assert gens[0].facts.pool.blocks_stored == (5 if run_ == 0 else 1)  # the producer stores, each block once
        assert all(g.facts.pool.blocks_stored == 0 for g in gens[1:])
        assert sum(g.facts.handoff.blocks_received for g in gens[1:]) == 0  # the pool carried them all


def test_a_hidden_state_drafter_across_pd_with_a_pool(one_device, tmp_path):
    """EAGLE-3 reads the prefill's hidden states: the P/D connector sends them beside the pool's blocks; with a
    warm pool the producer computes (so sends) none of the cached prefix; tokens stay the one-device recompute's."""
    model, cfg, params = target("qwen3")
    d = head("eagle3")
    ps = prompts("qwen3")
    ps = [ps[0] + ps[1], ps[0][:9] + [5]]
    ref = one_device(model, params, cfg, ps, 8).tokens
    pool = PoolSpec(f"lmdb:{tmp_path}", model="e")
    pre, dec = driver.engine_configs(model, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, interleave_size=BLOCK,
                                     pd=True, num_speculative_tokens=2)
    dec = dec.replace(**speculative_fields(d))
    for hits in ((0, 0), (4, 2)):
        gens = cpattn.simulate(4, driver.generate_on_rank, model, params, cfg, ps, 8, prefill=pre, decode=dec,
                               drafter=d, pool=pool)
        assert all(torch.equal(g.tokens, ref) for g in gens)
        assert all(g.facts.pool.hit_blocks == hits for g in gens[:2])  # the producer's prefix
        assert all(g.facts.pool.hit_blocks == (4, 2) for g in gens[2:])  # the producer stored them first
        hidden = [g.facts.handoff for g in gens]
        assert sum(h.bytes_sent for h in hidden[:2]) == sum(h.bytes_received for h in hidden[2:])
        assert (sum(h.bytes_sent for h in hidden) > 0) == (hits == (0, 0))  # the rows of computed positions only
        assert sum(h.blocks_received for h in hidden) == 0  # the blocks came from the pool
        assert gens[2].stats.drafted > 0


def test_a_dsa_cp_prefill_from_the_pool_across_pd(one_device, tmp_path):
    """DeepSeek-V3.2 (DSA-CP prefill, its indexer keys among the block's columns): the warm P 2 / N 2 run
    starts from the pool, the producer stores only the new block, and the consumer loads its blocks from it."""
    from cpattn.models import deepseek_v32

    fam, cfg = deepseek_v32.FAMILY, deepseek_v32.DeepseekV32Config.tiny()
    params = fam.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    pool = PoolSpec(f"lmdb:{tmp_path}", model="dsa")
    cold = run(fam, cfg, params, COLD, 2, 2, pool)
    warm = run(fam, cfg, params, WARM, 2, 2, pool)
    for prompts, gens, hits, stored in ((COLD, cold, (0, 0), 5), (WARM, warm, (4, 2), 1)):
        want = one_device(fam, params, cfg, prompts, NEW).tokens
        assert all(torch.equal(g.tokens, want) for g in gens)
        assert all(g.facts.pool.hit_blocks == hits for g in gens[:2])
        assert all(g.facts.pool.hit_blocks == (4, 2) for g in gens[2:])  # spans of 2 blocks, one token left
        assert sum(g.facts.pool.blocks_stored for g in gens[:2]) == stored  # by the producer, each block once
        assert sum(g.facts.handoff.blocks_received for g in gens[2:]) == 0  # none over the link
