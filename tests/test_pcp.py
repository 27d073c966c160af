"""pcp_prefill against the float64 oracle on the simulated mesh (1..8 ranks) and real gloo (2, 4)."""

import pytest
import torch

import cpattn
from cpattn import pcp_plan, pcp_prefill, pcp_shard, pcp_unshard
from cpattn.comm.launch import spawn
from cpattn.pcp import Context

from gloo_cases import pcp_cases
from ref import attention as oracle
from ref import plain_error, req_pos

LENS = {
    "single": [37],
    "uneven": [13, 1, 0, 29, 6],  # a zero-length request, lengths < 2P
    "tiny": [1, 2, 3],
}


def make(lens, hq=4, hkv=2, dqk=16, dv=16, dtype=torch.float32, ctx_lens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q = torch.randn(t, hq, dqk, generator=g).to(dtype)
    k = torch.randn(t, hkv, dqk, generator=g).to(dtype)
    v = torch.randn(t, hkv, dv, generator=g).to(dtype)
    ctx = None
    if ctx_lens is not None:
        tc = sum(ctx_lens)
        ctx = (torch.randn(tc, hkv, dqk, generator=g).to(dtype), torch.randn(tc, hkv, dv, generator=g).to(dtype),
               torch.tensor([0] + ctx_lens).cumsum(0).to(torch.int32))
    return q, k, v, cu, ctx


def reference(q, k, v, cu, ctx, ctx_lens):
    """Oracle over [context | new tokens] per request."""
    q_req, q_pos = req_pos(cu.tolist(), ctx_lens)
    if ctx is None:
        return oracle(q, k, v, q_req, q_req, q_pos, q_pos)
    c_req, c_pos = req_pos(ctx[2].tolist())
    kk, vv = torch.cat([ctx[0], k]), torch.cat([ctx[1], v])
    return oracle(q, kk, vv, q_req, torch.cat([c_req, q_req]), q_pos, torch.cat([c_pos, q_pos]))


def run_sim(p, q, k, v, cu, method, ctx=None, return_lse=False):
    plan = pcp_plan(cu, p, context_lens=None if ctx is None else ctx[2].diff().tolist())

    def rank_fn(g):
        s = lambda x: pcp_shard(x, plan, g.rank)  # noqa: E731
        return pcp_prefill(s(q), s(k), s(v), plan, group=g, method=method,
                           context=None if ctx is None else Context(*ctx), return_lse=return_lse)

    parts = cpattn.simulate(p, rank_fn)
    if return_lse:
        return pcp_unshard([o for o, _ in parts], plan), pcp_unshard([l for _, l in parts], plan)
    return pcp_unshard(parts, plan)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("lens", ["single", "uneven", "tiny"])
def test_simulated_matches_oracle(p, method, lens):
    q, k, v, cu, _ = make(LENS[lens])
    out, lse = run_sim(p, q, k, v, cu, method, return_lse=True)
    ref_out, ref_lse = reference(q, k, v, cu, None, None)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_with_cached_context(p, method):
    ctx_lens = [5, 0, 11]
    q, k, v, cu, ctx = make([9, 4, 0], ctx_lens=ctx_lens)
    out = run_sim(p, q, k, v, cu, method, ctx)
    ref_out, _ = reference(q, k, v, cu, ctx, ctx_lens)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_mla_dims_one_kv_head(method):
    q, k, v, cu, _ = make([19, 7], hq=8, hkv=1, dqk=72, dv=64)
    out = run_sim(4, q, k, v, cu, method, return_lse=False)
    ref_out, _ = reference(q, k, v, cu, None, None)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_float64_is_exact(method):
    q, k, v, cu, _ = make([23, 10], dtype=torch.float64)
    out = run_sim(3, q, k, v, cu, method)
    ref_out, _ = reference(q, k, v, cu, None, None)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_bf16_within_twice_plain_torch(method):
    q, k, v, cu, _ = make([64, 33], hq=8, hkv=2, dqk=64, dv=64, dtype=torch.bfloat16, seed=3)
    out = run_sim(4, q, k, v, cu, method)
    ref_out, _ = reference(q, k, v, cu, None, None)
    err = (out.double() - ref_out).abs().max().item()
    q_req, q_pos = req_pos(cu.tolist())
    base = plain_error(q, k, v, q_req, q_req, q_pos, q_pos, torch.bfloat16)
    assert err <= 2 * base, (err, base)


def test_ring_and_allgather_traffic_is_about_2T_Hkv_D_over_P():
    q, k, v, cu, _ = make([64, 64])
    plan = pcp_plan(cu, 4)

    def rank_fn(g, method):
        s = lambda x: pcp_shard(x, plan, g.rank)  # noqa: E731
        pcp_prefill(s(q), s(k), s(v), plan, group=g, method=method)
        return g.stats.total_sent()

    per_token = k[0].nbytes + v[0].nbytes
    sent = cpattn.simulate(4, rank_fn, "allgather")
    assert all(s == 32 * per_token * 3 for s in sent), sent  # T_r * (P-1) tokens
    # the ring forwards only kv_a of rank src once no rank it still visits needs kv_b (those after src)
    from cpattn.pcp import _needs_b

    sent = cpattn.simulate(4, rank_fn, "ring")
    for r in range(4):
        want = sum((32 if _needs_b((r - s) % 4, s, 4) else 16) * per_token for s in range(3))
        assert sent[r] == want <= 32 * per_token * 3, (r, sent)
    assert sum(sent) < 4 * 32 * per_token * 3


def test_wrong_shard_is_named():
    q, k, v, cu, _ = make([10])
    plan = pcp_plan(cu, 2)
    with pytest.raises(RuntimeError, match="pcp_shard"):
        cpattn.simulate(2, lambda g: pcp_prefill(q, k, v, plan, group=g))
    with pytest.raises(RuntimeError, match="method"):
        cpattn.simulate(2, lambda g: pcp_prefill(q[:5], k[:5], v[:5], plan, group=g, method="zigzag"))
    with pytest.raises(RuntimeError, match="rebuild the plan"):
        cpattn.simulate(3, lambda g: pcp_prefill(q, k, v, plan, group=g))


@pytest.mark.slow
@pytest.mark.parametrize("p", [2])  # 4 ranks: the simulated mesh (real 4-rank gloo runs: test_dcp_decode, test_comm)
def test_gloo_matches_oracle(p):
    cases, refs = [], []
    for lens, method, ctx_lens in [([40, 3, 0, 17], "ring", None), ([40, 3, 0, 17], "allgather", None),
                                   ([11, 6], "ring", [4, 9]), ([11, 6], "allgather", [4, 9])]:
        q, k, v, cu, ctx = make(lens, ctx_lens=ctx_lens)
        cases.append((q, k, v, cu, method, ctx))
        refs.append(reference(q, k, v, cu, ctx, ctx_lens)[0])
    per_rank = spawn(p, pcp_cases, cases)
    for i, ((q, k, v, cu, method, ctx), ref_out) in enumerate(zip(cases, refs)):
        plan = pcp_plan(cu, p, context_lens=None if ctx is None else ctx[2].diff().tolist())
        out = pcp_unshard([per_rank[r][i] for r in range(p)], plan)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
