"""NPU support without an NPU: torch_npu stays lazy, errors are clear, the plumbing matches the docs.

torch_npu is never installed here. ``fake_fia`` below is a plain-torch
stand-in for ``torch_npu.npu_fused_infer_attention_score`` written from its
documentation (BNSD layout, GQA by ``num_key_value_heads``, sparse_mode 0 =
no mask, 3 = rightDownCausal with a 2048x2048 mask where True is masked, LSE
``(B, N, Q_S, 1)`` float32). It checks our calls against our reading of the
docs, not against the real kernel.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch

from cpattn.ops import attention, npu, registry
from ref import attention as oracle
from ref import plain_error


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def fake_fia(query, key, value, *, atten_mask=None, num_heads=1, scale=1.0, input_layout="BSH",
             num_key_value_heads=0, sparse_mode=0, softmax_lse_flag=False, calls=None):
    """Documented semantics of npu_fused_infer_attention_score, BNSD only, in fp32."""
    assert input_layout == "BNSD" and query.dtype in (torch.float16, torch.bfloat16)
    b, n, sq, d = query.shape
    nkv = num_key_value_heads or n
    assert n == num_heads and key.shape[1] == nkv and n % nkv == 0 and n // nkv <= 64
    k = key.float().repeat_interleave(n // nkv, dim=1)  # [B, N, Skv, D]
    v = value.float().repeat_interleave(n // nkv, dim=1)
    s = torch.einsum("bnqd,bnkd->bnqk", query.float(), k) * scale  # [B, N, Sq, Skv]
    skv = s.shape[-1]
    if sparse_mode == 0:
        assert atten_mask is None
    elif sparse_mode == 3:  # right-down causal: query i sees keys j <= i + skv - sq
        assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
        assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
        s = s.masked_fill(j > i + skv - sq, float("-inf"))
    else:
        raise AssertionError(f"unexpected sparse_mode {sparse_mode}")
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [B, N, Sq, 1]
    out = torch.einsum("bnqk,bnkd->bnqd", torch.softmax(s, -1), v).to(query.dtype)
    if calls is not None:
        calls.append(sparse_mode)
    return out, (lse if softmax_lse_flag else torch.zeros(1))


@pytest.fixture
def stub(monkeypatch):
    """A fake torch_npu module in sys.modules; returns the list of recorded calls."""
    calls: list[int] = []
    mod = types.ModuleType("torch_npu")
    mod.npu_fused_infer_attention_score = lambda *a, **kw: fake_fia(*a, **kw, calls=calls)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return calls


@pytest.mark.slow
def test_import_never_imports_torch_npu():
    res = _run("""
        import sys
        import cpattn, cpattn.ops, cpattn.ops.npu, cpattn.config
        assert "torch_npu" not in sys.modules, "importing cpattn imported torch_npu"
        assert "npu" not in cpattn.ops.registry.kernels("attention_with_lse")
    """)
    assert res.returncode == 0, res.stderr


def test_enable_npu_without_torch_npu(monkeypatch):
    import cpattn.ops

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(ImportError, match=r"pip install cpattn\[npu\] on a machine with Ascend CANN"):
        cpattn.ops.enable_npu()
    assert "npu" not in registry.kernels("attention_with_lse")


def test_register_refuses_unnamed_privateuse1(stub):
    # here nothing renamed PrivateUse1 to "npu" (real torch_npu does on import)
    with pytest.raises(RuntimeError, match="PrivateUse1 backend is named"):
        npu.register()


@pytest.mark.slow
def test_register_with_renamed_privateuse1():
    """In a fresh process: PrivateUse1 renamed as torch_npu does, a stub module, then enable_npu()."""
    res = _run("""
        import sys, types, torch
        torch.utils.rename_privateuse1_backend("npu")
        sys.modules["torch_npu"] = types.ModuleType("torch_npu")
        import cpattn.ops
        cpattn.ops.enable_npu()
        cpattn.ops.enable_npu()  # idempotent
        assert "npu" in cpattn.ops.registry.kernels("attention_with_lse"), cpattn.ops.registry.kernels("attention_with_lse")
        assert torch._C._dispatch_has_kernel_for_dispatch_key("cpattn::attention_with_lse", "PrivateUse1")
    """)
    assert res.returncode == 0, res.stderr


def test_no_kernel_error_lists_available_kernels():
    err = registry.no_kernel("attention_with_lse", torch.empty(1, device="meta"))
    assert isinstance(err, NotImplementedError)
    msg = str(err)
    assert "['meta']" in msg and "'cpu'" in msg and "registry.kernel" in msg


def test_call_without_kernel_dispatches_to_the_error():
    op = registry._OPS["attention_with_lse"]
    q = torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with op.set_kernel_enabled("cpu", enabled=False):
        with pytest.raises(registry.NoKernelError, match=r"kernels are registered for \['cpu'"):
            attention.attention_with_lse(q, q, q, cu, cu)


# (q lens, k lens, Hq, Hkv, D): uneven, zero-length, cached context, more queries than keys, decode
CASES = [
    ([5, 0, 9], [5, 0, 9], 8, 2, 32),
    ([3, 4], [11, 4], 4, 1, 16),
    ([6, 1], [3, 1], 4, 4, 16),
    ([1, 1, 1], [7, 1, 20], 8, 2, 64),
]


@pytest.mark.parametrize("lq, lk, hq, hkv, d", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_plumbing_matches_oracle(stub, lq, lk, hq, hkv, d, causal):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(sum(lq) + hq)
    q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + lq).cumsum(0)
    cu_k = torch.tensor([0] + lk).cumsum(0)
    q_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lq)])
    k_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lk)])
    q_pos = torch.cat([torch.arange(n) + lk[i] - n for i, n in enumerate(lq)])
    k_pos = torch.cat([torch.arange(n) for n in lk])
    scale = 0.7 * d**-0.5
    out, lse = attention.varlen(q, k, v, cu_q, cu_k, causal, scale, npu.fused_block)
    assert stub, "the fused kernel was never called"
    if causal and max(min(a, b) for a, b in zip(lq, lk)) > 1:
        assert 3 in stub  # the diagonal block went through rightDownCausal (single-row blocks need no mask)
    ref_out, ref_lse = oracle(q, k, v, q_req, k_req, q_pos, k_pos, scale=scale, causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (out[~seen] == 0).all()
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=1e-4, rtol=1e-4)
    err = (out.double() - ref_out).abs().max().item()
    base = plain_error(q, k, v, q_req, k_req, q_pos, k_pos, dtype, scale=scale, causal=causal)
    assert err <= 2 * base, (err, base)


@pytest.mark.parametrize("dtype, dqk, dv, hq, hkv", [
    (torch.float32, 32, 32, 4, 2),  # fused kernel takes fp16/bf16 only
    (torch.bfloat16, 72, 64, 8, 1),  # MLA-like Dqk != Dv
    (torch.bfloat16, 40, 40, 4, 2),  # head dim not 16-aligned
    (torch.bfloat16, 16, 16, 130, 2),  # GQA ratio above 64
])
def test_unsupported_blocks_fall_back_to_reference(stub, dtype, dqk, dv, hq, hkv):
    q, k, v = torch.randn(hq, 5, dqk).to(dtype), torch.randn(hkv, 5, dqk).to(dtype), torch.randn(hkv, 5, dv).to(dtype)
    out, lse = npu.fused_block(q, k, v, True, dqk**-0.5)
    assert not stub, "fused kernel called outside its documented limits"
    ref_out, ref_lse = npu.ref.dense_block(q, k, v, True, dqk**-0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_old_scale_value_keyword(monkeypatch):
    """Older torch_npu releases name the scale ``scale_value``; both spellings work."""
    calls: list[int] = []

    def old_fia(*args, scale_value=1.0, **kwargs):
        if "scale" in kwargs:
            raise TypeError("npu_fused_infer_attention_score() got an unexpected keyword argument 'scale'")
        return fake_fia(*args, scale=scale_value, calls=calls, **kwargs)

    mod = types.ModuleType("torch_npu")
    mod.npu_fused_infer_attention_score = old_fia
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    q = torch.randn(4, 6, 16).bfloat16()
    out, lse = npu.fused_block(q, q[:2], q[:2], False, 0.25)
    ref_out, ref_lse = npu.ref.dense_block(q, q[:2], q[:2], False, 0.25)
    assert calls == [0]
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
