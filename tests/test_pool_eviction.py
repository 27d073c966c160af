"""Eviction keeps prefix chains usable: under pressure a chain loses its tail first (leaves before roots), so the
pool serves the longest prefix it can hold -- in the LMDB store, the dict store and around the engine (DCP ranks
storing disjoint blocks of one chain)."""

import pytest
import torch
from pool_blocks import random_blocks, same_blocks

import cpattn
from cpattn.engine import driver
from cpattn.models import qwen3
from cpattn.pool import DictStore, KVPool, PoolIdentity, codec

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")

from cpattn.pool.lmdb_store import LMDBStore  # noqa: E402

IDENT = PoolIdentity("tiny-evict", torch.bfloat16, num_layers=2, block_size=4, row_width=8)
BLOB = codec.encoded_size(IDENT.dtype, IDENT.block_shape)


def blocks(n, seed=0):
    return random_blocks(IDENT, n, seed)


same = same_blocks


def store_of(kind, tmp_path, capacity_blocks):
    if kind == "lmdb":
        return LMDBStore(tmp_path, capacity_bytes=capacity_blocks * BLOB)
    return DictStore(capacity_entries=capacity_blocks)


@pytest.mark.parametrize("kind", ["lmdb", "dict"])
@pytest.mark.parametrize("capacity,length", [(6, 8), (10, 40)])
def test_a_chain_larger_than_the_pool_keeps_its_longest_prefix(tmp_path, kind, capacity, length):
    """8 blocks into room for 6 (and 40 into room for 10): the next request finds the first 6 (10), intact."""
    with KVPool(store_of(kind, tmp_path, capacity), IDENT) as pool:
        keys = pool.keys(list(range(length * 4 + 1)))
        data = blocks(length)
        pool.store(keys, data)
        assert sum(pool.backend.exists(keys)) == capacity  # the pool is full ...
        assert pool.lookup(keys) == capacity  # ... of a usable prefix
        assert same(pool.load(keys), data[:capacity])


@pytest.mark.parametrize("kind", ["lmdb", "dict"])
def test_a_request_sharing_a_prefix_renews_its_whole_chain(tmp_path, kind):
    """A stores 8 blocks; B shares A's first 4, loads them and stores its own 4 more; with room for 6, A's tail
    goes first, then B's: B still finds 6 blocks."""
    with KVPool(store_of(kind, tmp_path, 6), IDENT) as pool:
        a = list(range(8 * 4))
        b = a[:16] + [100 + t for t in range(16)]
        ka, kb = pool.keys(a), pool.keys(b)
        pool.store(ka, blocks(8))
        hit = pool.lookup(kb)
        got = pool.load(kb[:hit])
        assert len(got) == 4
        data = got + blocks(4, seed=1)
        pool.store(kb[4:], data[4:], chain=kb)  # as the engine stores (pooling.store_blocks)
        assert pool.lookup(kb) == 6 and same(pool.load(kb), data[:6])
        assert pool.lookup(ka) == 4  # A's own tail went first


def test_a_chain_stored_by_two_ranks_keeps_its_prefix(tmp_path):
    """Each of two ranks stores every other block (DCP: block j on rank j % 2) in its own call: after both renew
    the whole chain with its own blocks, eviction still takes the tail first."""
    with KVPool(LMDBStore(tmp_path, capacity_bytes=5 * BLOB), IDENT) as pool:
        keys, data = pool.keys(list(range(8 * 4))), blocks(8)
        for rank in (1, 0):
            pool.store(keys[rank::2], data[rank::2], chain=keys)
        assert pool.lookup(keys) == 5 and same(pool.load(keys), data[:5])


def test_engine_under_dcp_keeps_a_usable_prefix_in_a_small_pool(one_device, tmp_path):
    """A DCP = 2 run stores an 8-block prompt into an LMDB pool with room for 6 blocks; a one-device run of the
    same prompt finds 6 blocks and gives the one-device recompute's tokens (conftest.py's ``one_device``)."""
    cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    params = qwen3.FAMILY.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    prompts = [list(range(3, 3 + 8 * 4 + 1))]
    row = sum(lay.row_width for lay in qwen3.FAMILY.kv_layouts(cfg))
    blob = codec.encoded_size(torch.float64, (1, 4, row))
    ident = PoolIdentity("qwen3-seed0", torch.float64, num_layers=1, block_size=4, row_width=row)
    pool = KVPool(LMDBStore(tmp_path, capacity_bytes=6 * blob), ident)

    def run(dcp):
        pre, dec = driver.engine_configs(qwen3.FAMILY, cfg, dcp_size=dcp, block_size=4, interleave_size=4)
        return cpattn.simulate(dcp, driver.generate_on_rank, qwen3.FAMILY, params, cfg, prompts, 3, prefill=pre,
                               decode=dec, pool=pool)

    cold = run(2)
    assert all(g.facts.pool.hit_blocks == (0,) for g in cold)
    assert sum(g.facts.pool.blocks_stored for g in cold) >= 6  # a block evicted as soon as written is not kept
    warm = run(1)[0]
    assert warm.facts.pool.hit_blocks == (6,)
    assert torch.equal(warm.tokens, one_device(qwen3.FAMILY, params, cfg, prompts, 3).tokens)
    pool.close()
