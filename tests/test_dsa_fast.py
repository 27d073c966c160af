"""The tiled DSA CPU kernels: bf16 / fp16 / FP8 indexer keys upcast tile by tile, the one-exp sparse MLA.

Every case is checked against the float64 reference of the same values
(:mod:`cpattn.ops.dsa_ref`): low-precision inputs must score exactly as fp32
scoring of their values does (to fp32 rounding), across tile boundaries,
decode rows (one query: key-major tiles) and prefill rows (query-major).
"""

import pytest
import torch

from cpattn.ops import dsa_ref, indexer
from cpattn.ops.dsa import (
    causal_key_ranges,
    fp8_index_cache,
    indexer_scores,
    selection_mismatch,
    sparse_mla_attention_with_lse,
    topk_indices,
)


@pytest.fixture
def small_tile(monkeypatch):
    """Tiles of 7 keys, so every case crosses several tile boundaries."""
    monkeypatch.setattr(indexer, "_KEY_TILE", 7)


def _case(tq, tk, h=4, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, h, d, generator=g).to(dtype)
    w = torch.rand(tq, h, generator=g).to(dtype)
    k = torch.randn(tk, d, generator=g).to(dtype)
    start, vis = causal_key_ranges([0, tq], [0, tk])
    return q, w, k, start, vis


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tq,tk", [(1, 40), (3, 40), (25, 25)])
def test_indexer_low_precision_equals_fp32_scoring(small_tile, dtype, tq, tk):
    q, w, k, start, vis = _case(tq, tk, dtype=dtype)
    got = indexer_scores(q, w, k, start, vis, tk)
    want = dsa_ref.indexer_scores(q.double(), w.double(), k.double(), start, vis, tk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tq,tk", [(1, 40), (9, 30)])
def test_fp8_key_cache_equals_its_dequantized_values(small_tile, tq, tk):
    q, w, k, start, vis = _case(tq, tk, seed=3)
    k8, scale = fp8_index_cache(k)
    assert k8.dtype == torch.float8_e4m3fn and scale.shape == (tk,) and bool((scale > 0).all())
    got = indexer_scores(q, w, k8, start, vis, tk, k_scale=scale)
    want = dsa_ref.indexer_scores(q.double(), w.double(), k8.double() * scale.double()[:, None], start, vis, tk)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the selection moves only at near-ties: most of fp32's top-k survives
    exact = topk_indices(indexer_scores(q, w, k, start, vis, tk), 8)
    assert selection_mismatch(topk_indices(got, 8), exact)["recall"] > 0.75


def test_fp8_cache_needs_both_halves():
    q, w, k, start, vis = _case(1, 10)
    k8, scale = fp8_index_cache(k)
    with pytest.raises(ValueError, match="fp8_index_cache"):
        indexer_scores(q, w, k8, start, vis, 10)
    with pytest.raises(ValueError, match="fp8_index_cache"):
        indexer_scores(q, w, k, start, vis, 10, k_scale=scale)


def test_indexer_nan_key_reaches_only_the_queries_that_see_it(small_tile):
    q, w, k, start, vis = _case(6, 6, dtype=torch.bfloat16)
    k[4] = float("nan")
    got = indexer_scores(q, w, k, start, vis, 6)
    want = dsa_ref.indexer_scores(q.double(), w.double(), k.double(), start, vis, 6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got[:4].isfinite().logical_or(got[:4] == float("-inf")).all()  # rows 0..3 never see key 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_one_exp_pass_matches_reference(dtype):
    g = torch.Generator().manual_seed(5)
    q, cache = torch.randn(3, 4, 48, generator=g).to(dtype), torch.randn(30, 48, generator=g).to(dtype)
    idx = torch.tensor([[0, 5, 7, -1], [1, 2, 3, 29], [-1, -1, -1, -1]])
    cache[10] = float("nan")  # never selected: must not reach any output
    out, lse = sparse_mla_attention_with_lse(q, cache, idx, softmax_scale=0.3, v_head_dim=32)
    want, want_lse = dsa_ref.sparse_mla_attention_with_lse(q.double(), cache.double(), idx, 0.3, 32)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert out[2].eq(0).all() and lse[2].eq(float("-inf")).all()
    nan_idx = torch.tensor([[10, 1, -1, -1]])  # a selected NaN row makes that query NaN, as the dense oracle
    o2, l2 = sparse_mla_attention_with_lse(q[:1], cache, nan_idx, softmax_scale=0.3, v_head_dim=32)
    assert o2.isnan().all() and l2.isnan().all()
