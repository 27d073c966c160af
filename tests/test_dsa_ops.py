"""DSA ops (indexer_scores, topk_indices, sparse_mla_attention_with_lse) against a float64 oracle.

The oracle ``ref.dsa`` (tests/ref/sparse.py) is written plainly, the way Hugging Face transformers'
DeepSeek-V3.2 attention does it: indexer scores over every key, additive
causal -inf mask, top-k of min(index_topk, keys) columns, an additive -inf
mask scattered from the top-k, dense softmax over all keys. One deliberate
difference: torch.topk leaves the order of tied scores unspecified, so the
oracle takes the first k of a *stable* descending sort (score desc, index
asc), the order the library promises.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanes import examples

from cpattn.ops import dsa_ref
from cpattn.ops.dsa import (
    causal_key_ranges,
    indexer_scores,
    mla_softmax_scale,
    selection_mismatch,
    sparse_mla_attention_with_lse,
    topk_indices,
)
from cpattn.dsa import dsa_attention
import ref
from ref import attention as dense_oracle
from ref import req_pos
from ref import topk_rows as plain_topk  # Python sort by (score desc, column asc); -inf/NaN dropped; -1 pads

NEG = float("-inf")


# ----------------------------------------------------------------------------- oracle
def grid(shape, step, lo=-1.0, hi=1.0, gen=None):
    """Random multiples of ``step`` in [lo, hi]: sums of few products stay exact in fp32."""
    n = int(round((hi - lo) / step))
    return torch.randint(0, n + 1, shape, generator=gen).double() * step + lo


def make_batch(lens, ctx=None, h=4, dl=32, dr=16, hi=4, di=16, seed=0, dtype=torch.float32):
    """A packed DSA batch: new tokens ``lens`` after ``ctx`` cached tokens per request.

    Returns a dict with q [T, H, dl+dr], latent [Tk, dl+dr], q_idx [T, hi, di], w_idx [T, hi],
    k_idx [Tk, di], cu_q, cu_k (keys = context + new tokens of each request).
    Indexer inputs are on a coarse grid so fp32 and fp64 scores agree exactly (and tie often).
    """
    g = torch.Generator().manual_seed(seed)
    ctx = ctx or [0] * len(lens)
    cu_q = torch.tensor([0] + lens).cumsum(0)
    cu_k = torch.tensor([0] + [c + n for c, n in zip(ctx, lens)]).cumsum(0)
    t, tk = int(cu_q[-1]), int(cu_k[-1])
    return dict(
        q=torch.randn(t, h, dl + dr, generator=g, dtype=torch.float64).to(dtype),
        latent=torch.randn(tk, dl + dr, generator=g, dtype=torch.float64).to(dtype),
        q_idx=grid((t, hi, di), 0.25, gen=g).to(dtype),
        w_idx=grid((t, hi), 0.125, gen=g).to(dtype),
        k_idx=grid((tk, di), 0.25, gen=g).to(dtype),
        cu_q=cu_q, cu_k=cu_k,
    )


# ----------------------------------------------------------------------------- indexer_scores
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_indexer_scores_match_oracle(dtype):
    b = make_batch([5, 0, 9, 1], ctx=[0, 3, 4, 12], dtype=dtype)
    start, vis = causal_key_ranges(b["cu_q"], b["cu_k"])
    got = indexer_scores(b["q_idx"], b["w_idx"], b["k_idx"], start, vis)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (15, 13)
    for t in range(got.shape[0]):
        keys = b["k_idx"][start[t] : start[t] + vis[t]].double()
        want = (torch.relu(b["q_idx"][t].double() @ keys.T) * b["w_idx"][t].double()[:, None]).sum(0)
        assert torch.equal(got[t, : vis[t]].double(), want)  # exact: grid inputs
        assert torch.isinf(got[t, vis[t] :]).all() and (got[t, vis[t] :] < 0).all()
    ref = dsa_ref.indexer_scores(b["q_idx"], b["w_idx"], b["k_idx"], start, vis, 13)
    assert torch.equal(ref, got)


def test_indexer_random_floats_and_poison():
    g = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(6, 3, 8, generator=g), torch.randn(6, 3, generator=g), torch.randn(20, 8, generator=g)
    k[10:] = float("nan")  # rows no query may read
    start, vis = torch.tensor([0, 0, 4, 4, 4, 9]), torch.tensor([1, 4, 2, 5, 6, 1])
    got = indexer_scores(q, w, k, start, vis, 7)
    for t in range(6):
        want = torch.einsum("hd,sd->hs", q[t].double(), k[start[t] : start[t] + vis[t]].double()).relu()
        want = (want * w[t].double()[:, None]).sum(0)
        torch.testing.assert_close(got[t, : vis[t]].double(), want, rtol=1e-5, atol=1e-5)
    assert not got.isnan().any()


def test_indexer_long_causal_prefill_chunks():
    """More queries than one kernel chunk (128 rows): every chunk scores up to its own last key."""
    g = torch.Generator().manual_seed(2)
    cu_q, cu_k = [0, 300, 301], [0, 310, 311]
    q, w = grid((301, 2, 8), 0.25, gen=g).float(), grid((301, 2), 0.125, gen=g).float()
    k = grid((311, 8), 0.25, gen=g).float()
    start, vis = causal_key_ranges(cu_q, cu_k)
    got = indexer_scores(q, w, k, start, vis)
    assert torch.equal(got, dsa_ref.indexer_scores(q, w, k, start, vis, 310))


def test_indexer_bad_arguments_are_named():
    q, w, k = torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(5, 8)
    with pytest.raises(ValueError, match="w must be"):
        indexer_scores(q, w[:, :2], k, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="k must be"):
        indexer_scores(q, w, k[:, :4], torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="key_start"):
        indexer_scores(q, w, k, torch.zeros(2), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="key_start \\+ visible"):
        indexer_scores(q, w, k, torch.tensor([4, 0]), torch.tensor([3, 1]))


# ----------------------------------------------------------------------------- topk_indices
@settings(max_examples=examples(30), deadline=None)
@given(t=st.integers(0, 6), s=st.integers(0, 12), k=st.integers(1, 15), seed=st.integers(0, 10**6))
def test_topk_ties_total_order(t, s, k, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 3, (t, s), generator=g).float()  # many ties
    scores[scores == -3] = NEG  # invisible keys
    scores[scores == 2] = float("nan")  # NaN counts as -inf
    want = plain_topk(scores, k)
    assert torch.equal(topk_indices(scores, k), want)
    assert torch.equal(dsa_ref.topk_indices(scores, k), want)


def test_topk_random_and_float64():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(9, 300, generator=g, dtype=torch.float64)
    scores[:, 250:] = NEG
    for k in (1, 7, 64, 250, 260, 400):
        assert torch.equal(topk_indices(scores, k), plain_topk(scores, k))
        assert torch.equal(topk_indices(scores.float(), k), plain_topk(scores.float(), k))


# ----------------------------------------------------------------------------- sparse attention
def plain_sparse(q, latent, idx, scale, dv, dtype):
    """Gather + dense softmax in ``dtype`` (the plain torch baseline for the bf16 rule)."""
    q, latent = q.to(dtype), latent.to(dtype)
    kv = latent[idx.clamp(min=0).long()]  # [T, K, D]
    valid = idx >= 0
    kv = torch.where(valid[..., None], kv, torch.zeros((), dtype=dtype))
    s = torch.einsum("thd,tkd->thk", q, kv) * scale
    s = s.masked_fill(~valid[:, None, :], NEG)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("thk,tkd->thd", p, kv[..., :dv])


def sparse_oracle(q, latent, idx, scale, dv):
    """float64: additive -inf mask over every cache row, dense softmax."""
    mask = torch.full((q.shape[0], latent.shape[0] + 1), NEG, dtype=torch.float64)
    mask.scatter_(1, torch.where(idx >= 0, idx.long(), latent.shape[0]), 0.0)
    mask = mask[:, :-1]
    lat = torch.nan_to_num(latent.double(), nan=0.0)  # poisoned rows are masked anyway
    logits = torch.einsum("thd,sd->ths", q.double(), lat) * scale + mask[:, None, :]
    lse = torch.logsumexp(logits, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.softmax(logits, -1), 0.0).nan_to_num(0.0)
    return torch.einsum("ths,sd->thd", p, lat[:, :dv]), lse


def sparse_case(t=7, h=4, s=40, d=48, dv=32, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    latent = torch.randn(s, d, generator=g)
    idx = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]).int()
    idx[1, 2:] = -1
    idx[3] = -1  # a query with nothing selected
    idx[4, ::2] = -1
    unused = torch.ones(s, dtype=torch.bool)
    unused[idx[idx >= 0].long()] = False
    latent[unused] = float("nan")  # poison rows nobody selected
    return q, latent, idx, 0.3, dv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_attention_matches_oracle_with_poison(dtype):
    q, latent, idx, scale, dv = sparse_case()
    out, lse = sparse_mla_attention_with_lse(q.to(dtype), latent.to(dtype), idx, softmax_scale=scale, v_head_dim=dv)
    want, want_lse = sparse_oracle(q, latent, idx, scale, dv)
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    assert (out[3] == 0).all() and (lse[3] == NEG).all()
    ref_out, ref_lse = dsa_ref.sparse_mla_attention_with_lse(q.to(dtype), latent.to(dtype), idx, scale, dv)
    torch.testing.assert_close(ref_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref_lse, lse, rtol=1e-5, atol=1e-6)


def test_sparse_attention_bf16_within_twice_plain():
    q, latent, idx, scale, dv = sparse_case(seed=5)
    want, _ = sparse_oracle(q, latent, idx, scale, dv)
    live = (idx >= 0).any(-1)
    out, _ = sparse_mla_attention_with_lse(q.bfloat16(), latent.bfloat16(), idx, softmax_scale=scale, v_head_dim=dv)
    ours = (out.double() - want)[live].abs().max().item()
    plain = (plain_sparse(q, latent, idx, scale, dv, torch.bfloat16).double() - want)[live].abs().max().item()
    assert out.dtype == torch.bfloat16
    assert ours <= 2 * plain + 1e-6, (ours, plain)


def test_sparse_attention_paged_cache_and_errors():
    q, latent, idx, scale, dv = sparse_case()
    paged = latent.view(10, 4, 1, 48)  # [num_blocks, block_size, 1, Dqk]: slots index rows
    a = sparse_mla_attention_with_lse(q, paged, idx, softmax_scale=scale, v_head_dim=dv)
    b = sparse_mla_attention_with_lse(q, latent, idx, softmax_scale=scale, v_head_dim=dv)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="latent_cache rows have"):
        sparse_mla_attention_with_lse(q, latent[:, :40], idx, softmax_scale=scale, v_head_dim=dv)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_attention_with_lse(q, latent, idx.float(), softmax_scale=scale, v_head_dim=dv)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_mla_attention_with_lse(q, latent, idx, softmax_scale=0.0, v_head_dim=dv)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dsa_matches_hf_oracle(dtype):
    lens, ctx, topk = [9, 0, 14, 1, 3], [0, 5, 6, 20, 2], 5
    b = make_batch(lens, ctx, dtype=dtype, seed=2)
    scale = mla_softmax_scale(24)
    out, lse, idx = dsa_attention(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"], b["cu_q"], b["cu_k"],
                                  topk=topk, softmax_scale=scale, v_head_dim=32, return_lse=True, return_indices=True)
    want, want_lse, want_idx = ref.dsa(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"],
                                      b["cu_q"], b["cu_k"], topk, scale, 32)
    assert torch.equal(idx.long(), want_idx)  # exact selection, ties included
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)


def test_dsa_equals_dense_mla_when_all_keys_fit():
    """Visible length <= topk: DSA is dense absorbed MLA (tests/ref/dense.py attention, one KV head)."""
    lens, ctx = [6, 11, 1], [4, 0, 7]
    b = make_batch(lens, ctx, seed=4)
    scale = mla_softmax_scale(24, 40, 1.0)
    out = dsa_attention(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"], b["cu_q"], b["cu_k"],
                        topk=16, softmax_scale=scale, v_head_dim=32)
    q_req, q_pos = req_pos(b["cu_q"], ctx)
    k_req, k_pos = req_pos(b["cu_k"])
    kv = b["latent"][:, None, :]
    want, _ = dense_oracle(b["q"], kv, kv[..., :32], q_req, k_req, q_pos, k_pos, scale=scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_dsa_real_mla_dims():
    """The real split: Dqk = 576 (512 latent + 64 rope), values 512."""
    b = make_batch([10], ctx=[30], h=2, dl=512, dr=64, hi=4, di=16, seed=6)
    scale = mla_softmax_scale(192, 40, 1.0)
    out = dsa_attention(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"], b["cu_q"], b["cu_k"],
                        topk=8, softmax_scale=scale)
    want, _, _ = ref.dsa(b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"], b["cu_q"], b["cu_k"], 8, scale, 512)
    assert out.shape == (10, 2, 512)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_softmax_scale_is_the_models():
    assert mla_softmax_scale(192) == 192**-0.5
    m = 0.1 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1
    assert abs(mla_softmax_scale(192, 40, 1.0) - 192**-0.5 * m * m) < 1e-15
    assert mla_softmax_scale(192, 40, 1.0) != 576**-0.5


def test_fp8_indexer_reports_selection_change():
    g = torch.Generator().manual_seed(7)
    q, w, k = torch.randn(64, 8, 32, generator=g), torch.randn(64, 8, generator=g), torch.randn(256, 32, generator=g)
    start, vis = causal_key_ranges([0, 64], [0, 256])
    exact = topk_indices(indexer_scores(q, w, k, start, vis), 32)
    fp8 = topk_indices(indexer_scores(q, w, k, start, vis, fp8=True), 32)
    rep = selection_mismatch(fp8, exact)
    assert 0.0 <= rep["rows_differ"] <= 1.0 and rep["recall"] > 0.8
    assert selection_mismatch(exact, exact) == {"rows_differ": 0.0, "recall": 1.0}


# ----------------------------------------------------------------------------- registry checks
def op_samples():
    b = make_batch([5, 3], ctx=[2, 4])
    start, vis = causal_key_ranges(b["cu_q"], b["cu_k"])
    q, latent, idx, scale, dv = sparse_case()
    latent = torch.nan_to_num(latent)
    return [
        (torch.ops.cpattn.indexer_scores, (b["q_idx"], b["w_idx"], b["k_idx"], start, vis, 7)),
        (torch.ops.cpattn.indexer_scores, (b["q_idx"].double(), b["w_idx"].double(), b["k_idx"].double(), start, vis, 9)),
        (torch.ops.cpattn.topk_indices, (torch.randn(4, 10), 3)),
        (torch.ops.cpattn.topk_indices, (torch.randn(4, 3).double(), 5)),
        (torch.ops.cpattn.sparse_mla_attention_with_lse, (q, latent, idx, scale, dv)),
        (torch.ops.cpattn.sparse_mla_attention_with_lse, (q.double(), latent.double(), idx.long(), scale, dv)),
    ]


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("i", range(6))
def test_opcheck(i):
    op, args = op_samples()[i]
    torch.library.opcheck(op, args)


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_compile_fullgraph_aot_eager():
    b = make_batch([6, 4], ctx=[3, 0])
    start, vis = causal_key_ranges(b["cu_q"], b["cu_k"])
    q, latent, idx, scale, dv = sparse_case()

    def step(qi, wi, ki, start, vis, q, latent):
        scores = indexer_scores(qi, wi, ki, start, vis, 9)
        top = topk_indices(scores, 4)
        return top, sparse_mla_attention_with_lse(q, latent, idx, softmax_scale=scale, v_head_dim=dv)

    args = (b["q_idx"], b["w_idx"], b["k_idx"], start, vis, q, latent)
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    want = step(*args)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], equal_nan=True)


@pytest.mark.slow
def test_compile_fullgraph_inductor_decode_step():
    """A decode step (indexer -> top-k -> sparse MLA) through inductor, as a captured graph runs it."""
    b = make_batch([1, 1], ctx=[12, 20], seed=9)
    start, vis = causal_key_ranges(b["cu_q"], b["cu_k"])

    def step(q, latent, qi, wi, ki, start, vis):
        top = topk_indices(indexer_scores(qi, wi, ki, start, vis, 21), 6)
        rows = torch.where(top >= 0, start[:, None] + top, -1)
        return sparse_mla_attention_with_lse(q, latent, rows, softmax_scale=0.2, v_head_dim=32)

    args = (b["q"], b["latent"], b["q_idx"], b["w_idx"], b["k_idx"], start, vis)
    torch._dynamo.reset()
    got = torch.compile(step, backend="inductor", fullgraph=True)(*args)
    want = step(*args)
    torch.testing.assert_close(got, want)
