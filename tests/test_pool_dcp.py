"""A pool written under DCP = 2 serves DCP = 4 and one device (real LMDB stores, interleave = block size)."""

import pytest
import torch

from cpattn.pool import KVPool, PoolIdentity, rank_blocks
from cpattn.pool.lmdb_store import LMDBStore

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")

IDENT = PoolIdentity("tiny-dcp", torch.float32, num_layers=2, block_size=4, row_width=6)


def global_blocks(n):
    """Block j filled with j + 0.5 in every element, plus a per-position ramp (so misplacement shows)."""
    ramp = torch.arange(IDENT.num_layers * IDENT.block_size * IDENT.row_width, dtype=torch.float32)
    return [(ramp / 1000 + j + 0.5).view(IDENT.block_shape) for j in range(n)]


def write_as_dcp(path, tokens, n_ranks, upto):
    """Each rank stores its own blocks j < upto from its local cache (local block j // N)."""
    data = global_blocks(len(tokens) // IDENT.block_size)
    for rank in range(n_ranks):
        pool = KVPool(LMDBStore(path), IDENT)  # one pool per rank, as in separate processes
        keys = pool.keys(tokens)[:upto]
        local_cache = {j // n_ranks: data[j] for j in range(len(keys)) if j % n_ranks == rank}
        mine = rank_blocks(keys, rank, n_ranks)
        assert pool.store(list(mine.keys), [local_cache[i] for i in mine.local_ids]) == len(mine.keys)
        pool.close()


def read_as_dcp(path, tokens, n_ranks):
    """Every rank looks up the full key list and loads only its own blocks into local blocks."""
    caches, hits = [], set()
    for rank in range(n_ranks):
        pool = KVPool(LMDBStore(path), IDENT)
        keys = pool.keys(tokens)
        hit = pool.lookup(keys)
        hits.add(hit)
        mine = rank_blocks(keys[:hit], rank, n_ranks)
        got = pool.load(list(mine.keys))
        assert len(got) == len(mine.keys)
        caches.append(dict(zip(mine.local_ids, got)))
        pool.close()
    assert len(hits) == 1  # every rank sees the same cached prefix without a collective
    return hits.pop(), caches


@pytest.mark.parametrize("reader", [4, 1, 3, 2])
def test_written_by_dcp2_served_to_other_sizes(tmp_path, reader):
    tokens = list(range(100, 100 + 4 * 7 + 2))  # 7 whole blocks and a partial tail
    write_as_dcp(tmp_path, tokens, 2, upto=6)  # the first request cached 6 blocks
    hit, caches = read_as_dcp(tmp_path, tokens, reader)
    assert hit == 6
    data = global_blocks(7)
    for rank, cache in enumerate(caches):
        expect = {j // reader: data[j] for j in range(hit) if j % reader == rank}
        assert sorted(cache) == sorted(expect)
        assert all(torch.equal(cache[i], expect[i]) for i in expect)


def test_new_blocks_after_a_hit_are_stored_by_their_owners(tmp_path):
    tokens = list(range(4 * 9))
    write_as_dcp(tmp_path, tokens, 2, upto=3)
    pools = [KVPool(LMDBStore(tmp_path), IDENT) for _ in range(4)]
    keys = pools[0].keys(tokens)
    hit = pools[0].lookup(keys)
    assert hit == 3
    data = global_blocks(9)
    for rank, pool in enumerate(pools):  # DCP = 4 stores blocks 3..8 after its prefill
        new = rank_blocks(keys, rank, 4, start=hit)
        assert all(j >= hit and j % 4 == rank for j in new.global_ids)
        pool.store(list(new.keys), [data[j] for j in new.global_ids])
    one = pools[0]
    assert one.lookup(keys) == 9
    got = one.load(keys)
    assert all(torch.equal(a, b) for a, b in zip(got, data)) and len(got) == 9
    for p in pools:
        p.close()


def test_rank_blocks_partition_every_block_once():
    keys = [str(j) for j in range(23)]
    for n in (1, 2, 3, 4, 8):
        for start in (0, 1, 5, 23):
            seen = []
            for r in range(n):
                rb = rank_blocks(keys, r, n, start=start)
                assert all(j % n == r and loc == j // n for j, loc in zip(rb.global_ids, rb.local_ids))
                assert list(rb.keys) == [keys[j] for j in rb.global_ids]
                seen += rb.global_ids
            assert sorted(seen) == list(range(start, 23))
    with pytest.raises(ValueError, match="rank"):
        rank_blocks(keys, 2, 2)
