"""attention_with_lse against the float64 oracle: varlen, GQA, MLA dims, bottom-right causal."""

import pytest
import torch

from cpattn.ops import attention_with_lse, registry
from devices import needs_cuda
from ref import AttnCase, plain_error
from ref import attention as oracle

CASES = [
    AttnCase((5,), (5,), 4, 4, 16, 16, note="square causal"),
    AttnCase((3, 0, 7), (3, 0, 7), 8, 2, 32, 32, note="GQA, an empty request"),
    AttnCase((2, 4), (9, 4), 4, 1, 16, 16, note="new tokens after cached context (bottom-right)"),
    AttnCase((6, 1), (3, 1), 4, 2, 16, 16, note="more queries than keys: first rows see nothing"),
    AttnCase((4, 5), (6, 2), 4, 2, 16, 8, causal=False, note="non-causal, Dv < Dqk"),
    AttnCase((3, 5), (7, 5), 8, 1, 72, 64, note="MLA-like: one KV head, Dqk > Dv"),
    AttnCase((3,), (4,), 2, 2, 8, 12, note="Dv > Dqk"),
    AttnCase((1, 1, 1), (40, 1, 0), 8, 2, 16, 16, note="decode rows, GQA folded"),
    AttnCase((1, 2), (33, 20), 16, 1, 72, 64, causal=False, note="MLA-like decode, heads folded into rows"),
]


def _cu(lens):
    return AttnCase(tuple(lens), tuple(lens), 1, 1, 1, 1).cu()[0]


def _inputs(lq, lk, hq, hkv, dqk, dv, dtype=torch.float32, seed=0):
    return AttnCase(tuple(lq), tuple(lk), hq, hkv, dqk, dv).inputs(dtype, seed)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_oracle(case: AttnCase, dtype):
    lq, hq, dv, causal = case.q_lens, case.hq, case.dv, case.causal
    q, k, v, q_req, k_req, q_pos, k_pos = case.inputs(dtype)
    out, lse = attention_with_lse(q, k, v, *case.cu(), causal=causal)
    ref_out, ref_lse = oracle(q, k, v, q_req, k_req, q_pos, k_pos, causal=causal)
    assert out.dtype == dtype and out.shape == (sum(lq), hq, dv)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol * 10)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows with no visible key must have lse -inf"
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=tol * 10, rtol=tol * 10)
    assert not torch.isnan(out).any() and (out[~seen] == 0).all()


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cuda_kernel_matches_oracle(case: AttnCase):
    lq, hq, dv, causal = case.q_lens, case.hq, case.dv, case.causal
    q, k, v, q_req, k_req, q_pos, k_pos = case.inputs()
    cu_q, cu_k = case.cu()
    out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), causal=causal)
    ref_out, ref_lse = oracle(q, k, v, q_req, k_req, q_pos, k_pos, causal=causal)
    assert out.device.type == "cuda" and out.shape == (sum(lq), hq, dv)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-5, rtol=2e-4)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen)
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse[seen], atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_plain_torch(dtype):
    lq, lk = [40, 17], [60, 17]
    q, k, v, q_req, k_req, q_pos, k_pos = _inputs(lq, lk, 8, 2, 64, 64, torch.float32, seed=1)
    out, _ = attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), _cu(lq), _cu(lk))
    ref_out, _ = oracle(q.to(dtype), k.to(dtype), v.to(dtype), q_req, k_req, q_pos, k_pos)
    err = (out.double() - ref_out).abs().max().item()
    base = plain_error(q.to(dtype), k.to(dtype), v.to(dtype), q_req, k_req, q_pos, k_pos, dtype)
    assert err <= 2 * base, (err, base)


def test_custom_scale_and_default_scale():
    q, k, v, q_req, k_req, q_pos, k_pos = _inputs([4], [6], 2, 2, 16, 16)
    out, lse = attention_with_lse(q, k, v, _cu([4]), _cu([6]), softmax_scale=0.3)
    ref_out, ref_lse = oracle(q, k, v, q_req, k_req, q_pos, k_pos, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


def test_nan_outside_the_requests_is_never_read():
    """Tokens past cu_seqlens[-1] (padding) hold NaN; results stay exact."""
    lq, lk = [3, 4], [5, 4]
    q, k, v, q_req, k_req, q_pos, k_pos = _inputs(lq, lk, 4, 2, 16, 16)
    pad = lambda x: torch.cat([x, torch.full((3, *x.shape[1:]), float("nan"))])  # noqa: E731
    out, lse = attention_with_lse(pad(q), pad(k), pad(v), _cu(lq), _cu(lk))
    ref_out, _ = oracle(q, k, v, q_req, k_req, q_pos, k_pos)
    torch.testing.assert_close(out[:7].double(), ref_out, atol=2e-6, rtol=1e-5)
    assert (lse[7:] == float("-inf")).all() and (out[7:] == 0).all()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=torch.randn(4, 3, 8)), "multiple of kv heads"),
        (dict(k=torch.randn(4, 2, 4)), "head_dim"),
        (dict(v=torch.randn(3, 2, 8)), "must agree"),
        (dict(q=torch.randn(4, 8)), "packed"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 4.0])), "int32 or int64"),
        (dict(cu_seqlens_k=torch.tensor([0, 2, 4])), "same B"),
    ],
)
def test_bad_input_is_named(bad, match):
    args = dict(q=torch.randn(4, 4, 8), k=torch.randn(4, 2, 8), v=torch.randn(4, 2, 8),
                cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4]))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        attention_with_lse(**args)


def test_no_kernel_error_lists_devices():
    op = torch.ops.cpattn.attention_with_lse
    x = torch.randn(2, 2, 4, device="meta")
    cu = torch.tensor([0, 2], device="meta")
    err = registry.no_kernel("attention_with_lse", x)
    assert "cpu" in str(err) and "meta" in str(err)
    assert "cpu" in registry.kernels("attention_with_lse")
    # meta tensors go through the fake impl, not an error
    out, lse = op(x, x, x, cu, cu, True, 0.5)
    assert out.shape == (2, 2, 4) and lse.dtype == torch.float32


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_opcheck():
    q, k, v, *_ = _inputs([3, 4], [5, 4], 4, 2, 16, 8)
    torch.library.opcheck(torch.ops.cpattn.attention_with_lse, (q, k, v, _cu([3, 4]), _cu([5, 4]), True, 0.25))


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiles_fullgraph(backend):
    q, k, v, *_ = _inputs([3, 4], [5, 4], 4, 2, 16, 16)
    cq, ck = _cu([3, 4]), _cu([5, 4])

    def f(q, k, v):
        out, lse = attention_with_lse(q, k, v, cq, ck, causal=True)
        return out * 2, lse

    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want)
