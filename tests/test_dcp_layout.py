"""DCP layout: ownership, local indices, local lengths, slot mapping, block resharding.

Checked against a brute-force deal of tokens written plainly here (a Python
loop over tokens), never against the formulas under test.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanes import examples

from cpattn.layout.dcp import (
    dcp_local_index,
    dcp_local_lens,
    dcp_owner,
    dcp_slot_mapping,
    reshard_kv_blocks,
    unshard_kv_blocks,
)


def deal(seq_len, n, interleave_size):
    """Brute force: walk the tokens in runs of `interleave_size`, handing runs to ranks 0, 1, ..., n-1, 0, ..."""
    owner, local, count = [], [], [0] * n
    for t in range(seq_len):
        r = (t // interleave_size) % n
        owner.append(r)
        local.append(count[r])
        count[r] += 1
    return owner, local, count


sizes = st.tuples(st.integers(1, 8), st.sampled_from([1, 2, 4, 16]), st.integers(0, 300))


@settings(max_examples=examples(60), deadline=None)
@given(sizes)
def test_owner_local_index_and_lens_match_a_plain_deal(args):
    n, inter, s = args
    owner, local, count = deal(s, n, inter)
    t = torch.arange(s)
    assert dcp_owner(t, n, inter).tolist() == owner
    assert dcp_local_index(t, n, inter).tolist() == local
    lens = dcp_local_lens(torch.tensor([s]), n, inter)
    assert lens.tolist() == [count]
    assert int(lens.sum()) == s


@pytest.mark.slow
@settings(max_examples=examples(40), deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 8]), st.lists(st.integers(0, 200), min_size=1, max_size=5))
def test_local_lens_batched_and_prefix_visibility(n, inter, seq_lens):
    lens = dcp_local_lens(torch.tensor(seq_lens), n, inter)
    assert lens.shape == (len(seq_lens), n)
    assert lens.sum(1).tolist() == seq_lens
    for b, s in enumerate(seq_lens):
        owner, local, _ = deal(s, n, inter)
        # a query at position p sees, on rank r, exactly the rank-r tokens at positions <= p
        for p in range(s):
            vis = dcp_local_lens(torch.tensor([p + 1]), n, inter)[0]
            for r in range(n):
                assert int(vis[r]) == sum(1 for x in owner[: p + 1] if x == r)
        assert lens[b].tolist() == [owner.count(r) for r in range(n)]


@settings(max_examples=examples(40), deadline=None)
@given(
    st.integers(1, 8),
    st.sampled_from([(1, 4), (2, 4), (4, 4), (2, 16), (16, 16)]),
    st.lists(st.integers(0, 120), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
)
def test_slot_mapping_writes_every_token_exactly_once(n, ib, seq_lens, rnd):
    inter, bs = ib
    lens = dcp_local_lens(torch.tensor(seq_lens), n, inter)
    mb = max(1, -(-int(lens.max()) // bs)) + 1  # one spare column, filled with -1
    num_blocks = len(seq_lens) * mb + 3
    ids = list(range(num_blocks))
    rnd.shuffle(ids)
    table = torch.tensor(ids[: len(seq_lens) * mb]).view(len(seq_lens), mb)
    table[:, -1] = -1
    pos = torch.cat([torch.arange(s) for s in seq_lens] + [torch.tensor([-1, -1])])  # two padding rows
    req = torch.cat([torch.full((s,), b) for b, s in enumerate(seq_lens)] + [torch.tensor([-1, 0])])
    maps = [dcp_slot_mapping(pos, req, table, dcp_rank=r, dcp_size=n, interleave_size=inter, block_size=bs)
            for r in range(n)]
    written = torch.stack([m >= 0 for m in maps]).sum(0)
    assert written[:-2].eq(1).all() and written[-2:].eq(0).all()  # real tokens once, padding never
    for r, m in enumerate(maps):
        slots = m[m >= 0]
        assert slots.unique().numel() == slots.numel()  # no two tokens share a slot on one rank
        for i in torch.nonzero(m >= 0).flatten().tolist():
            b, p = int(req[i]), int(pos[i])
            owner, local, _ = deal(p + 1, n, inter)
            assert owner[p] == r
            li = local[p]
            assert int(m[i]) == int(table[b, li // bs]) * bs + li % bs
            assert li < int(lens[b, r])


def test_slot_mapping_missing_block_and_bad_args():
    table = torch.tensor([[4, -1]])
    pos, req = torch.arange(4), torch.zeros(4, dtype=torch.long)
    m = dcp_slot_mapping(pos, req, table, dcp_rank=0, dcp_size=1, interleave_size=1, block_size=2)
    assert m.tolist() == [8, 9, -1, -1]
    with pytest.raises(ValueError, match="multiple of interleave_size"):
        dcp_slot_mapping(pos, req, table, dcp_rank=0, dcp_size=2, interleave_size=3, block_size=4)
    with pytest.raises(ValueError, match="dcp_rank"):
        dcp_slot_mapping(pos, req, table, dcp_rank=2, dcp_size=2, interleave_size=1, block_size=4)
    with pytest.raises(ValueError, match="dcp_size"):
        dcp_local_lens(torch.tensor([3]), 0, 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("num_blocks", [0, 1, 5, 8])
def test_reshard_round_trip_and_matches_slot_mapping(n, num_blocks):
    bs = 4
    s = num_blocks * bs - (1 if num_blocks else 0)  # last block partly filled
    kv = torch.randn(max(s, 0), 2, 3)  # [S, Hkv, D]: the request's tokens in order
    blocks = torch.full((num_blocks, bs, 2, 3), float("nan"))
    blocks.view(-1, 2, 3)[:s] = kv  # the prefill engine's paged copy
    kw = dict(dcp_size=n, interleave_size=bs, block_size=bs)
    parts = reshard_kv_blocks(blocks, **kw)
    assert len(parts) == n
    back = unshard_kv_blocks(parts, **kw)
    assert torch.equal(back.nan_to_num(7.0), blocks.nan_to_num(7.0))
    # each rank's local blocks hold exactly the tokens the slot mapping sends to that rank
    local_lens = dcp_local_lens(torch.tensor([s]), n, bs)[0]
    mb = max(1, -(-num_blocks // n))
    table = torch.arange(mb)[None]
    for r in range(n):
        cache = torch.full((mb, bs, 2, 3), float("nan"))
        slots = dcp_slot_mapping(torch.arange(s), torch.zeros(s, dtype=torch.long), table,
                                 dcp_rank=r, dcp_size=n, interleave_size=bs, block_size=bs)
        keep = slots >= 0
        cache.view(-1, 2, 3)[slots[keep]] = kv[keep]
        want = cache.view(-1, 2, 3)[: int(local_lens[r])]
        got = parts[r].reshape(-1, 2, 3)[: int(local_lens[r])]
        assert torch.equal(got, want)


def test_reshard_needs_interleave_equal_block_size():
    with pytest.raises(ValueError, match="interleave_size == block_size"):
        reshard_kv_blocks(torch.zeros(4, 16, 1, 8), dcp_size=2, interleave_size=1, block_size=16)
    with pytest.raises(ValueError, match="block_size=16"):
        reshard_kv_blocks(torch.zeros(4, 8, 1, 8), dcp_size=2, interleave_size=16, block_size=16)
    with pytest.raises(ValueError, match="parts\\[0\\]"):
        unshard_kv_blocks([torch.zeros(2, 4), torch.zeros(0, 4)], dcp_size=2, interleave_size=4, block_size=4)


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_layout_compiles_fullgraph():
    def f(pos, req, table, seq):
        return (dcp_slot_mapping(pos, req, table, dcp_rank=1, dcp_size=4, interleave_size=2, block_size=8),
                dcp_local_lens(seq, 4, 2))

    pos, req = torch.arange(40), torch.zeros(40, dtype=torch.long)
    table, seq = torch.arange(3)[None], torch.tensor([40])
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(pos, req, table, seq)
    want = f(pos, req, table, seq)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
