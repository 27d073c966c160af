"""DSA-CP and key-sharded (DCP) exact top-k against the HF-style float64 oracle (ref.dsa).

World sizes 1..8 on the simulated mesh, 2 and 4 on real gloo (one spawn each);
uneven lengths, zero-length requests, lengths below the world size, cached
context, decode; cache rows nobody selects (and cache gaps) hold NaN.
"""

import pytest
import torch

import cpattn
from cpattn import pcp_shard, pcp_unshard
from cpattn.comm.launch import spawn
from cpattn.dsa import (
    DSACache,
    dcp_shard_keys,
    dsa_attention,
    dsa_cp_attention,
    dsa_cp_plan,
    dsa_cp_work,
    dsa_dcp_attention,
    select_topk_candidates,
)
from cpattn.ops.dsa import causal_key_ranges, indexer_scores, mla_softmax_scale, topk_indices
from ref import dsa as hf_dsa
from test_dsa_ops import make_batch

SCALE = mla_softmax_scale(24)
DV = 32


# ----------------------------------------------------------------------------- cases
def case(lens, ctx=None, h=4, topk=4, seed=0, gap=2, random_indexer=False):
    """A batch, its oracle, and a replicated cache with the context in place (NaN elsewhere)."""
    ctx = ctx or [0] * len(lens)
    b = make_batch(lens, ctx, h=h, seed=seed)
    if random_indexer:
        g = torch.Generator().manual_seed(seed + 1)
        b["q_idx"], b["k_idx"] = torch.randn(b["q_idx"].shape, generator=g), torch.randn(b["k_idx"].shape, generator=g)
        b["w_idx"] = torch.randn(b["w_idx"].shape, generator=g)
    want, want_lse, want_idx = hf_dsa(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"],
                                      b["cu_q"], b["cu_k"], topk, SCALE, DV)
    cu_k = b["cu_k"].tolist()
    # poison latent rows no query selects (their indexer keys stay: every visible key is scored)
    qreq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    used = torch.zeros(cu_k[-1], dtype=torch.bool)
    sel = want_idx >= 0
    used[(torch.tensor(cu_k)[qreq][:, None] + want_idx)[sel]] = True
    latent = b["latent"].clone()
    latent[~used] = float("nan")
    # new-token rows of the packed key tensors, and the replicated cache layout with gaps
    new_rows = torch.cat([torch.arange(cu_k[i] + ctx[i], cu_k[i + 1]) for i in range(len(lens))])
    starts, at = [], 0
    for c, n in zip(ctx, lens):
        starts.append(at)
        at += c + n + gap
    cache_lat = torch.full((at + 3, latent.shape[1]), float("nan"))
    cache_k = torch.full((at + 3, b["k_idx"].shape[1]), float("nan"))
    for i, c in enumerate(ctx):
        cache_lat[starts[i] : starts[i] + c] = latent[cu_k[i] : cu_k[i] + c]
        cache_k[starts[i] : starts[i] + c] = b["k_idx"][cu_k[i] : cu_k[i] + c]
    return dict(
        lens=lens, ctx=ctx, topk=topk, starts=starts, cache=(cache_lat, cache_k),
        q=b["q"], q_idx=b["q_idx"], w_idx=b["w_idx"],
        new_latent=b["latent"][new_rows], new_k=b["k_idx"][new_rows],
        full_latent=latent, full_k=b["k_idx"], cu_q=b["cu_q"], cu_k=b["cu_k"],
        want=want, want_lse=want_lse, want_idx=want_idx,
    )


def cp_rank(group, cases, split, output):
    """DSA-CP for each case on this rank; returns (out, lse, cache) per case."""
    res = []
    for c in cases:
        plan = dsa_cp_plan(c["cu_q"], group.size, context_lens=c["ctx"], cache_starts=c["starts"], split=split)
        cache = DSACache(c["cache"][0].clone(), c["cache"][1].clone())
        mine = [pcp_shard(c[k], plan, group.rank) for k in ("q", "new_latent", "q_idx", "w_idx", "new_k")]
        out, lse = dsa_cp_attention(*mine, plan, group=group, topk=c["topk"], softmax_scale=SCALE, v_head_dim=DV,
                                    cache=cache, output=output, return_lse=True)
        res.append((out, lse, cache))
    return res


def dcp_rank(group, cases, interleave_size, output):
    """Key-sharded DSA for each case; returns (out, lse, global ids) per case."""
    res = []
    for c in cases:
        keys = dcp_shard_keys(c["full_latent"], c["full_k"], c["cu_k"], group.rank, group.size, interleave_size)
        positions = torch.cat([torch.arange(cx, cx + n) for cx, n in zip(c["ctx"], c["lens"])])
        res.append(dsa_dcp_attention(c["q"], c["q_idx"], c["w_idx"], positions, c["cu_q"], keys, group=group,
                                     topk=c["topk"], softmax_scale=SCALE, v_head_dim=DV, output=output,
                                     return_lse=True, return_indices=True))
    return res


def gloo_rank(group, cases):
    """Everything a gloo world checks, in one spawn."""
    return {
        "cp_contig_token": cp_rank(group, cases, "contiguous", "token"),
        "cp_bal_head": cp_rank(group, cases, "balanced", "head"),
        "dcp_repl": dcp_rank(group, cases, 2, "replicated"),
        "dcp_head": dcp_rank(group, cases, 1, "head"),
    }


def check_cp(c, results, n, split, output):
    plan = dsa_cp_plan(c["cu_q"], n, context_lens=c["ctx"], cache_starts=c["starts"], split=split)
    if output == "token":
        out = pcp_unshard([r[0] for r in results], plan)
        lse = pcp_unshard([r[1] for r in results], plan)
    else:
        out = torch.cat([r[0] for r in results], dim=1)
        lse = torch.cat([r[1] for r in results], dim=1)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), c["want"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), c["want_lse"], rtol=1e-5, atol=1e-6)
    for r in results:  # every rank's replicated cache got every new token
        torch.testing.assert_close(r[2].latent[plan.cache_rows], c["new_latent"])
        assert torch.equal(r[2].k_index[plan.cache_rows], c["new_k"])


def check_dcp(c, results, output):
    for r in results:
        assert torch.equal(r[2], c["want_idx"])  # the exact single-device selection on every rank
    out = results[0][0] if output == "replicated" else torch.cat([r[0] for r in results], dim=1)
    lse = results[0][1] if output == "replicated" else torch.cat([r[1] for r in results], dim=1)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), c["want"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), c["want_lse"], rtol=1e-5, atol=1e-6)


PREFILL = [([13, 0, 7, 2], None), ([9, 4], [6, 11]), ([3], [0])]


# ----------------------------------------------------------------------------- simulated mesh
@pytest.mark.parametrize("n", [1, 2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8))])
def test_dsa_cp_matches_oracle(n):  # fast lane 1-4: one rank, even, uneven, ranks > a prompt's tokens; 5-8 slow
    h = 2 * n  # head-sharded output needs H % N == 0
    cases = [case(lens, ctx, h=h, seed=s) for s, (lens, ctx) in enumerate(PREFILL)]
    for split, output in (("contiguous", "token"), ("balanced", "token"), ("contiguous", "head"),
                          ("balanced", "head")):
        per_rank = cpattn.simulate(n, cp_rank, cases, split, output)
        for i, c in enumerate(cases):
            check_cp(c, [per_rank[r][i] for r in range(n)], n, split, output)


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_dsa_cp_decode_with_cached_context(n):
    """Decode: one new token per request after a long context; fewer requests than ranks too."""
    cases = [case([1, 1, 1], [30, 5, 17], h=8, topk=6, seed=11), case([1], [40], h=8, topk=6, seed=12)]
    per_rank = cpattn.simulate(n, cp_rank, cases, "contiguous", "head" if 8 % n == 0 else "token")
    for i, c in enumerate(cases):
        check_cp(c, [per_rank[r][i] for r in range(n)], n, "contiguous", "head" if 8 % n == 0 else "token")


@pytest.mark.slow
@pytest.mark.parametrize("n", range(1, 9))
def test_dcp_sharded_topk_is_exact(n):
    cases = [case(lens, ctx, h=2 * n, seed=20 + s) for s, (lens, ctx) in enumerate(PREFILL)]
    cases.append(case([1, 1], [25, 9], h=2 * n, topk=5, seed=30))  # decode
    for interleave_size in (1, 2, 4):
        per_rank = cpattn.simulate(n, dcp_rank, cases, interleave_size, "replicated")
        for i, c in enumerate(cases):
            check_dcp(c, [per_rank[r][i] for r in range(n)], "replicated")
    per_rank = cpattn.simulate(n, dcp_rank, cases, 2, "head")
    for i, c in enumerate(cases):
        check_dcp(c, [per_rank[r][i] for r in range(n)], "head")


def test_dcp_exact_with_random_float_scores():
    """Random (not grid) indexer inputs: the sharded selection equals the single-device op's, bit for bit."""
    c = case([40], [60], seed=3, topk=16, random_indexer=True)
    _, single = dsa_attention(c["q"], torch.nan_to_num(c["full_latent"]), c["q_idx"], c["w_idx"], c["full_k"],
                              c["cu_q"], c["cu_k"], topk=16, softmax_scale=SCALE, v_head_dim=DV, return_indices=True)
    for n, interleave_size in ((2, 1), (3, 4), (5, 2)):
        for r in cpattn.simulate(n, dcp_rank, [c], interleave_size, "replicated"):
            assert torch.equal(r[0][2], single.long())


def test_union_of_local_topk_is_not_exact():
    """Why candidates are re-selected: the union of per-shard top-k sets is larger than the top-k."""
    c = case([1], [31], seed=5, topk=4, random_indexer=True)
    start, vis = causal_key_ranges(c["cu_q"], c["cu_k"])
    scores = indexer_scores(c["q_idx"], c["w_idx"], c["full_k"], start, vis)  # [1, 32]
    exact = set(topk_indices(scores, 4)[0].tolist())
    union = set()
    for r in range(2):
        cols = torch.arange(32)[(torch.arange(32) % 2) == r]
        local = topk_indices(scores[:, cols], 4)[0]
        union |= set(cols[local.long()].tolist())
    assert exact < union and len(union) == 8
    ids = torch.arange(32)[None]
    assert set(select_topk_candidates(scores, ids, 4)[0][0].tolist()) == exact


def test_work_report_balanced_beats_contiguous():
    plan_c = dsa_cp_plan([0, 4096], 4, split="contiguous")
    plan_b = dsa_cp_plan([0, 4096], 4, split="balanced")
    imbalance = {}
    for key in ("indexer_keys", "attended_keys"):
        wc = [w[key] for w in dsa_cp_work(plan_c, 512)]
        wb = [w[key] for w in dsa_cp_work(plan_b, 512)]
        assert sum(wc) == sum(wb)
        imbalance[key] = (max(wc) / (sum(wc) / 4), max(wb) / (sum(wb) / 4))
    # the O(p) indexer is where contiguous splitting hurts (1.75x here); head-tail evens it out
    assert imbalance["indexer_keys"][0] > 1.7 and imbalance["indexer_keys"][1] < 1.001
    # min(p + 1, k) saturates once p >= k: only the first k tokens are cheap, in both splits
    assert imbalance["attended_keys"][1] <= imbalance["attended_keys"][0] < 1.1
    assert sum(w["indexer_keys"] for w in dsa_cp_work(plan_c, 512)) == 4096 * 4097 // 2


def test_errors_are_named():
    c = case([6], seed=1)
    plan = dsa_cp_plan(c["cu_q"], 2)
    args = [c[k] for k in ("q", "new_latent", "q_idx", "w_idx", "new_k")]
    with pytest.raises(RuntimeError, match="pcp_shard"):
        cpattn.simulate(2, lambda g: dsa_cp_attention(*args, plan, group=g, topk=4, softmax_scale=SCALE, v_head_dim=DV))
    with pytest.raises(RuntimeError, match="rebuild the plan"):
        cpattn.simulate(3, lambda g: dsa_cp_attention(*args, plan, group=g, topk=4, softmax_scale=SCALE, v_head_dim=DV))
    with pytest.raises(ValueError, match="split"):
        dsa_cp_plan([0, 4], 2, split="zigzag")
    ctx_plan = dsa_cp_plan(c["cu_q"], 1, context_lens=[3])
    with pytest.raises(RuntimeError, match="DSACache"):
        cpattn.simulate(1, lambda g: dsa_cp_attention(*args, ctx_plan, group=g, topk=4, softmax_scale=SCALE,
                                                      v_head_dim=DV))


# ----------------------------------------------------------------------------- real gloo processes
@pytest.mark.slow
@pytest.mark.parametrize("n", [2])  # 4 ranks: the simulated mesh (suite time)
def test_gloo_matches_oracle(n):
    cases = [case(lens, ctx, h=4, seed=40 + s) for s, (lens, ctx) in enumerate(PREFILL)]
    cases.append(case([1, 1, 1], [20, 3, 9], h=4, topk=5, seed=50))  # decode, fewer requests than ranks
    per_rank = spawn(n, gloo_rank, cases)
    for i, c in enumerate(cases):
        check_cp(c, [per_rank[r]["cp_contig_token"][i] for r in range(n)], n, "contiguous", "token")
        check_cp(c, [per_rank[r]["cp_bal_head"][i] for r in range(n)], n, "balanced", "head")
        check_dcp(c, [per_rank[r]["dcp_repl"][i] for r in range(n)], "replicated")
        check_dcp(c, [per_rank[r]["dcp_head"][i] for r in range(n)], "head")
