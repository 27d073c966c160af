"""A KV pool around the engine: a warm run finds the blocks a cold run stored, under any layout, and gives the
cold run's tokens; lost or damaged entries are misses, never wrong KV.

Real LMDB stores in a temporary directory (the embedded default); float64 tiny models, so tokens must be
identical to conftest.py's ``one_device`` (:mod:`ref.greedy`: a fresh one-device full prefill per token, no
engine code).
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.engine import driver
from cpattn.engine.pooling import PoolSpec, release
from cpattn.models import deepseek_v32, qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
NEW = 4


def tiny(name):
    if name == "qwen3":
        cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        fam = qwen3.FAMILY
    else:
        fam, cfg = deepseek_v32.FAMILY, deepseek_v32.DeepseekV32Config.tiny()
    return fam, cfg, fam.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)


def run(fam, cfg, params, prompts, pcp, dcp, pool):
    pre, dec = driver.engine_configs(fam, cfg, pcp_size=pcp, dcp_size=dcp, block_size=BLOCK, interleave_size=BLOCK)
    return cpattn.simulate(max(pcp, dcp), driver.generate_on_rank, fam, params, cfg, prompts, NEW, prefill=pre,
                           decode=dec, pool=pool)


SHARED = list(range(3, 3 + 18))  # 4 whole blocks and 2 tokens shared by both prompts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "dsa"])
@pytest.mark.parametrize("writer,reader", [((1, 1), (2, 2)), ((1, 2), (1, 4)), ((2, 2), (1, 1)), ((2, 1), (1, 2))])
def test_warm_run_finds_what_a_cold_run_stored(one_device, tmp_path, name, writer, reader):
    fam, cfg, params = tiny(name)
    pool = PoolSpec(f"lmdb:{tmp_path}", model=f"{name}-seed0")
    cold_prompts = [SHARED + [40, 41], SHARED[:9]]
    warm_prompts = [SHARED + [50, 51, 52], SHARED[:9] + [60]]  # each shares whole blocks with a cold prompt
    cold = run(fam, cfg, params, cold_prompts, *writer, pool)
    assert torch.equal(cold[0].tokens, one_device(fam, params, cfg, cold_prompts, NEW).tokens)
    assert all(g.facts.pool.hit_blocks == (0, 0) for g in cold)
    # prompt 1's first two blocks are prompt 0's first two. The step loop also stores the whole blocks the
    # decoded tokens fill: prompt 1's 3rd (its last prompt token and 3 decoded ones)
    assert sum(g.facts.pool.blocks_stored for g in cold) == 6
    warm = run(fam, cfg, params, warm_prompts, *reader, pool)
    want = one_device(fam, params, cfg, warm_prompts, NEW)
    # the 5th block of prompt 0 differs; prompt 1: 2 of 2 blocks -- loaded as whole spans of BLOCK * N tokens,
    # so under DCP 4 (a 16-token span) prompt 1's 10 tokens hold none
    hits = (4, 0) if reader == (1, 4) else (4, 2)
    for g in warm:
        assert torch.equal(g.tokens, want.tokens)
        assert g.facts.pool.hit_blocks == hits
    # prompt 0's new 5th block, and the blocks the decoded tokens fill: prompt 0's 6th, prompt 1's 3rd
    assert sum(g.facts.pool.blocks_stored for g in warm) == 3


def test_a_damaged_entry_is_recomputed(one_device, tmp_path):
    """Garbage written over the third stored block: the warm run loads the two before it, recomputes the rest,
    gives the right tokens, and writes the damaged block again."""
    from cpattn.pool.lmdb_store import LMDBStore

    fam, cfg, params = tiny("qwen3")
    spec = PoolSpec(f"lmdb:{tmp_path}", model="qwen3-seed0")
    prompts = [SHARED + [7]]
    run(fam, cfg, params, prompts, 1, 1, spec)
    pool = spec.open_for(fam, cfg, params, BLOCK)
    third = pool.keys(prompts[0])[2].encode()
    release(pool)
    store = LMDBStore(tmp_path)
    with store.env.begin(write=True) as txn:
        txn.put(third, b"\x5a" * len(txn.get(third, db=store.blocks_db)), db=store.blocks_db)
    store.close()
    warm = run(fam, cfg, params, prompts, 2, 2, spec)
    assert torch.equal(warm[0].tokens, one_device(fam, params, cfg, prompts, NEW).tokens)
    assert all(g.facts.pool.hit_blocks == (2,) for g in warm)
    assert sum(g.facts.pool.blocks_stored for g in warm) == 1  # the damaged block, dropped and written again


def test_pool_needs_whole_blocks_per_rank(tmp_path):
    fam, cfg, params = tiny("qwen3")
    pre, dec = driver.engine_configs(fam, cfg, dcp_size=2, block_size=4, interleave_size=2)
    with pytest.raises(RuntimeError, match="stores and loads whole blocks"):  # raised on every rank, before any work
        cpattn.simulate(2, driver.generate_on_rank, fam, params, cfg, [SHARED], 2, prefill=pre, decode=dec,
                        pool=PoolSpec(f"lmdb:{tmp_path}", model="m"))


def save_tiny_qwen3(directory, seed):
    """A tiny float64 Qwen3 checkpoint (config.json + model.safetensors) in ``directory``."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    fam, cfg, _ = tiny("qwen3")
    params = fam.init_params(cfg, seed=seed, std=0.3, dtype=torch.float64)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), "model_type": "qwen3"}))
    save_file({k: v.contiguous() for k, v in params.items()}, str(directory / "model.safetensors"))


def load_tiny_qwen3(directory):
    from cpattn.models import load_checkpoint

    config, params = load_checkpoint(directory)
    return qwen3.FAMILY, qwen3.Qwen3Config.from_hf(config), params


def test_the_pool_names_a_model_by_its_weights_not_its_name(one_device, tmp_path, monkeypatch):
    """Two checkpoints in directories both called ``model`` (opened as "model" from each parent), then new
    weights saved over the first: each run through one pool under the same label gives its own no-pool tokens
    (a cold pool for new weights), and the same weights again find their blocks."""
    pool = PoolSpec(f"lmdb:{tmp_path / 'pool'}", model="model")
    prompts = [SHARED + [40, 41]]
    runs = []
    for parent, seed in (("a", 0), ("b", 1), ("a", 2)):  # the last one saves new weights over a/model
        save_tiny_qwen3(tmp_path / parent / "model", seed)
        monkeypatch.chdir(tmp_path / parent)
        fam, cfg, params = load_tiny_qwen3("model")
        got = run(fam, cfg, params, prompts, 1, 1, pool)[0]
        want = one_device(fam, params, cfg, prompts, NEW).tokens
        assert torch.equal(got.tokens, want), f"{parent}/model seed {seed}: the pool served another model's KV"
        runs.append(got.facts.pool.hit_blocks)
    assert runs == [(0,), (0,), (0,)]
    again = run(fam, cfg, params, prompts, 1, 1, pool)[0]  # the same weights again: warm
    assert again.facts.pool.hit_blocks == (4,)
