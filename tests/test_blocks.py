"""Block manager: DCP block counts, pool-compatible keys, all-or-nothing growth, refcounts, LRU leaves-first eviction.

Block counts are checked against a plain deal of tokens to ranks (a Python
loop), keys against :func:`cpattn.pool.keys.block_keys`, and the bookkeeping
against a recount of who holds which block after every operation.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn.engine.blocks import BlockManager, local_len
from cpattn.layout.dcp import dcp_local_lens
from cpattn.pool.keys import PoolIdentity, block_keys


def plain_local(seq_len, n, inter, r):
    return sum(1 for t in range(seq_len) if (t // inter) % n == r)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.sampled_from([1, 2, 4]), st.integers(0, 200), st.sampled_from([1, 2, 4]))
def test_local_len_and_blocks_for_follow_the_dcp_deal(n, inter, s, mult):
    block = inter * mult
    lens = dcp_local_lens(torch.tensor([s]), n, inter)[0].tolist()
    for r in range(n):
        assert local_len(s, n, r, inter) == plain_local(s, n, inter, r) == lens[r]
        bm = BlockManager(4, block, dcp_size=n, dcp_rank=r, interleave_size=inter)
        assert bm.blocks_for(s) == -(-plain_local(s, n, inter, r) // block)
    # rank 0's count, ceil(S / span), bounds every rank's: one shared table serves the group
    assert BlockManager(4, block, dcp_size=n, interleave_size=inter).blocks_for(s) == -(-s // (block * n))


@pytest.mark.parametrize("dcp", [1, 2, 3])
def test_span_keys_are_the_pool_keys(dcp):
    ident = PoolIdentity("m", torch.float32, num_layers=1, block_size=4, row_width=8)
    toks = [random.Random(dcp).randrange(1000) for _ in range(61)]
    bm = BlockManager(8, 4, dcp_size=dcp, identity=ident)
    keys = bm.extend_keys([], toks)
    assert keys == block_keys(toks, ident)[dcp - 1::dcp]
    assert len(keys) == 61 // (4 * dcp)
    again = bm.extend_keys(bm.extend_keys([], toks[:20]), toks)  # incremental == at once
    assert again == keys
    # another identity: other keys (the pool's namespace rule)
    assert BlockManager(8, 4, dcp_size=dcp).extend_keys([], toks) != keys


def test_allocate_is_all_or_nothing():
    bm = BlockManager(3, 2)
    assert bm.allocate("a", 4) and bm.block_table("a") == [0, 1]
    assert not bm.can_allocate("b", 3) and not bm.allocate("b", 3)
    assert bm.block_table("b") == [] and bm.num_free == 1 and bm.num_used == 2
    assert bm.allocate("a", 6) and bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("a", 5)  # already covered: no change
    bm.trim("a", 3)
    assert bm.block_table("a") == [0, 1] and bm.num_free == 1
    bm.free("a")
    assert bm.num_free == 3 and bm.stats.used == 0


def test_lookup_leaves_one_token_and_shares_by_refcount():
    bm = BlockManager(6, 2)
    toks = [1, 2, 3, 4]  # exactly 2 full blocks
    assert bm.allocate("a", 4)
    keys = bm.extend_keys([], toks)
    bm.cache_blocks("a", keys, num_computed=4)
    hit = bm.lookup(keys, len(toks))
    assert hit.block_ids == [0] and hit.num_tokens == 2  # the last block is recomputed
    assert bm.allocate("b", 4, prefix=hit) and bm.block_table("b") == [0, 2]
    assert bm.refcount(0) == 2 and bm.refcount(1) == 1 and bm.refcount(2) == 1
    assert bm.stats.hit_tokens == 2 and bm.stats.query_tokens == 4
    bm.free("a")
    assert bm.refcount(0) == 1 and bm.num_used == 2  # block 0 still held by b
    bm.free("b")
    assert bm.num_used == 0 and bm.stats.cached == 2  # freed blocks stay findable
    assert bm.lookup(keys, 10).block_ids == [0, 1]
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("c", 2)
        bm.allocate("c", 4, prefix=bm.lookup(keys, 4))


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(5, 2)
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    ka, kb = bm.extend_keys([], a), bm.extend_keys([], b)
    assert bm.allocate("a", 6) and bm.block_table("a") == [0, 1, 2]
    bm.cache_blocks("a", ka, 6)
    bm.free("a")                       # queue: 3 4 | 2 1 0  (a's tail first)
    assert bm.allocate("b", 4) and bm.block_table("b") == [3, 4]
    bm.cache_blocks("b", kb, 4)
    bm.free("b")                       # queue: 2 1 0 4 3
    assert bm.allocate("x", 2) and bm.block_table("x") == [2]  # a's leaf evicted first
    assert bm.lookup(ka, 99).num_tokens == 4 and bm.lookup(kb, 99).num_tokens == 4
    assert bm.allocate("y", 4) and bm.block_table("y") == [1, 0]  # then a's middle, then its root
    assert bm.lookup(ka, 99).num_tokens == 0 and bm.stats.evictions == 3
    # touching a cached free block takes it out of the queue: b's blocks are never handed out while held
    assert bm.allocate("z", 4, prefix=bm.lookup(kb, 3)) and bm.block_table("z") == [3, 4]
    assert bm.num_free == 0 and not bm.can_allocate("w", 1)


def test_caching_off_never_hits():
    bm = BlockManager(4, 2, enable_caching=False)
    assert bm.extend_keys([], [1, 2, 3]) == []
    assert bm.allocate("a", 2)
    bm.cache_blocks("a", [], 2)
    assert bm.lookup([], 5).num_tokens == 0 and bm.stats.cached == 0


@pytest.mark.parametrize("kw, msg", [
    (dict(num_blocks=0, block_size=2), "num_blocks must be a positive int; got 0"),
    (dict(num_blocks=4, block_size=6, interleave_size=4), "multiple of interleave_size"),
    (dict(num_blocks=4, block_size=2, dcp_size=2, dcp_rank=2), r"dcp_rank must be in \[0, 2\); got 2"),
])
def test_bad_arguments_name_themselves(kw, msg):
    with pytest.raises(ValueError, match=msg):
        BlockManager(**kw)


def check_books(bm, reqs):
    """Recount holders: refcount == holders; a block held twice is a cached prefix block; free + used == total."""
    holders = {}
    for r in reqs:
        for b in bm.block_table(r):
            holders[b] = holders.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.refcount(b) == holders.get(b, 0), (b, holders)
        if holders.get(b, 0) > 1:
            assert bm.key_of(b) is not None
    assert bm.num_used == len(holders) and bm.num_free + bm.num_used == bm.num_blocks


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 12), st.sampled_from([1, 2, 4]), st.integers(1, 2))
def test_random_operations_keep_the_books(seed, num_blocks, block_size, dcp):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, dcp_size=dcp)
    bases = [[rng.randrange(3) for _ in range(40)] for _ in range(2)]
    live, content = {}, {}  # req -> tokens; block -> tokens of the span it holds (a side table)
    for _ in range(60):
        op = rng.randrange(4)
        if op == 0 and len(live) < 4:  # admit a request, maybe over a cached prefix
            r = object()
            toks = rng.choice(bases)[:rng.randrange(1, 40)]
            keys = bm.extend_keys([], toks)
            hit = bm.lookup(keys, len(toks))
            for c, b in enumerate(hit.block_ids):  # a hit is a true prefix
                assert content[b] == toks[c * bm.span:(c + 1) * bm.span]
            n = hit.num_tokens + rng.randrange(1, len(toks) - hit.num_tokens + 1)
            if bm.allocate(r, n, prefix=hit):
                live[r] = (toks, keys, n)
        elif op == 1 and live:  # compute and cache what it holds
            r = rng.choice(list(live))
            toks, keys, n = live[r]
            bm.cache_blocks(r, keys, n)
            for c, b in enumerate(bm.block_table(r)[:n // bm.span]):
                if bm.key_of(b) == keys[c]:
                    content[b] = toks[c * bm.span:(c + 1) * bm.span]
        elif op == 2 and live:
            r = rng.choice(list(live))
            toks, keys, n = live[r]
            t = rng.randrange(n + 1) if rng.random() < 0.3 else 0
            bm.trim(r, t) if t else bm.free(r)
            if t:
                live[r] = (toks, keys, t)
            else:
                live.pop(r)
        elif op == 3 and live:  # grow
            r = rng.choice(list(live))
            toks, keys, n = live[r]
            m = min(len(toks), n + rng.randrange(1, 8))
            if bm.allocate(r, m):
                live[r] = (toks, keys, m)
        check_books(bm, live)
    for r in list(live):
        bm.free(r)
    check_books(bm, [])
    assert bm.num_used == 0


def test_cached_prefix_is_a_deprecated_alias_of_prefix_hit():
    import pytest

    from cpattn.engine import blocks

    with pytest.warns(DeprecationWarning, match="use cpattn.engine.blocks.PrefixHit"):
        assert blocks.CachedPrefix is blocks.PrefixHit
    assert isinstance(blocks.BlockManager(4, 2).lookup([], 0), blocks.PrefixHit)
