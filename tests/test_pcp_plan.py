"""Property tests of the PCP head-tail plan (hypothesis)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanes import examples

from cpattn import pcp_plan, pcp_shard, pcp_unshard
from cpattn.layout.pcp import causal_pairs, contiguous_causal_pairs

lens_st = st.lists(st.integers(0, 70), min_size=1, max_size=5)


@settings(max_examples=examples(60), deadline=None)
@given(lens=lens_st, p=st.integers(1, 8), ctx=st.integers(0, 9))
def test_every_token_owned_once_and_unshard_inverts_shard(lens, p, ctx):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    plan = pcp_plan(cu, p, context_lens=[ctx] * len(lens))
    owned = torch.cat(plan.token_index)
    assert torch.equal(owned.sort().values, torch.arange(cu[-1]))
    x = torch.randn(cu[-1], 3)
    assert torch.equal(pcp_unshard([pcp_shard(x, plan, r) for r in range(p)], plan), x)
    # positions are context + offset inside the request
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    offset = torch.arange(cu[-1]) - torch.tensor(cu[:-1])[req]
    for r in range(p):
        assert torch.equal(plan.positions[r], (offset + ctx)[plan.token_index[r]])


@settings(max_examples=examples(60), deadline=None)
@given(lens=lens_st, p=st.integers(1, 8))
def test_causal_work_is_balanced_within_one_chunk(lens, p):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    plan = pcp_plan(cu, p)
    work = [causal_pairs(plan, r) for r in range(p)]
    assert sum(work) == sum(n * (n + 1) // 2 for n in lens)
    # uneven lengths: ranks differ by at most one chunk's worth of pairs per request
    slack = sum((n // (2 * p) + 1) * (n + 1) for n in lens)
    assert max(work) - min(work) <= slack
    if all(n % (2 * p) == 0 for n in lens):  # even chunks: pairs are exactly equal
        assert max(work) == min(work)


def test_contiguous_split_is_unbalanced():
    n, p = 4096, 4
    plan = pcp_plan([0, n], p)
    zig = [causal_pairs(plan, r) for r in range(p)]
    cont = [contiguous_causal_pairs([n], p, r) for r in range(p)]
    assert max(zig) / (sum(zig) / p) < 1.001
    assert max(cont) / (sum(cont) / p) > 1.7  # ~ (2P-1)/P
