"""Gated DeltaNet ops (cpattn.ops.gated_delta) against the float64 sequential recurrence and transformers 5.24.

- chunked prefill (varlen, empty requests, value heads a multiple of key heads, cached initial states, several
  chunk sizes), the decode step, and the causal conv (with conv states) vs :mod:`cpattn.ops.gated_delta_ref`
  in float64 (to 1e-12);
- fp32 vs transformers' own torch paths (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
  ``causal_conv1d_fn`` / ``causal_conv1d_update``), the oracle of the model's numerics;
- gates near 0 and 1 (decay and write strength), and NaN in one token's q / k / v / g / beta reaching exactly
  the outputs the recurrence reaches (never an earlier token of its chunk);
- opcheck of the three ops; one-line errors.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.ops import gated_delta as gd
from cpattn.ops import gated_delta_ref as ref

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(lens, hk=2, hv=6, dk=8, dv=5, dtype=torch.float64, seed=0, g_scale=2.0, state=True):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = rnd(t, hk, dk), rnd(t, hk, dk), rnd(t, hv, dv)
    g = (-torch.rand(t, hv, generator=gen, dtype=torch.float64) * g_scale).to(dtype)
    beta = torch.rand(t, hv, generator=gen, dtype=torch.float64).to(dtype)
    s0 = rnd(b, hv, dk, dv) if state else torch.zeros(b, hv, dk, dv, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu, s0


def err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("lens,chunk", [([37], 64), ([5, 0, 25, 7], 8), ([1, 1, 1], 4), ([0], 64), ([64, 65], 16),
                                        ([9], 1)])
@pytest.mark.parametrize("l2", [True, False])
def test_chunk_matches_float64_recurrence(lens, chunk, l2):
    q, k, v, g, beta, cu, s0 = inputs(lens)
    if not l2:
        q, k = q / 3, k / 3  # keep the unnormalised keys' I - beta k k^T contractive
    o, s = gd.gated_delta_chunk(q, k, v, g, beta, cu, s0, scale=8**-0.5, use_qk_l2norm=l2, chunk_size=chunk)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=8**-0.5, use_qk_l2norm=l2)
    assert o.dtype == torch.float64 and s.shape == s0.shape
    assert err(o, ro) < 1e-12 and err(s, rs) < 1e-12


def test_step_matches_float64_recurrence_and_chains():
    q, k, v, g, beta, cu, s0 = inputs([6] * 3)
    # 6 decode steps of 3 requests == one prefill of each request's 6 tokens
    per = [x.view(3, 6, *x.shape[1:]) for x in (q, k, v, g, beta)]
    s, outs = s0, []
    for i in range(6):
        o, s = gd.gated_delta_step(*(x[:, i] for x in per), s, scale=0.3)
        outs.append(o)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=0.3)
    assert err(torch.stack(outs, 1).reshape(18, 6, 5), ro) < 1e-12 and err(s, rs) < 1e-12


@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_float64_reference(bias):
    gen = torch.Generator().manual_seed(1)
    lens = [5, 0, 1, 2, 9]
    x = torch.randn(sum(lens), 7, generator=gen, dtype=torch.float64)
    w, b = torch.randn(7, 4, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)
    cs = torch.randn(len(lens), 3, 7, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    for silu in (True, False):
        y, st = gd.causal_conv1d(x, w, b if bias else None, cu, cs, silu=silu)
        ry, rst = ref.causal_conv1d(x, w, b if bias else None, cu, cs, silu=silu)
        assert err(y, ry) < 1e-12 and torch.equal(st, rst)
    # decode: one token per request at a time, carrying the state, equals the prefill
    y1, st1 = gd.causal_conv1d(x[:3], w, b, torch.arange(4), cs[:3])
    ref1, _ = ref.causal_conv1d(x[:3], w, b, torch.arange(4), cs[:3])
    assert err(y1, ref1) < 1e-12 and torch.equal(st1[:, -1], x[:3])


@pytest.mark.parametrize("case", ["decay~1,write~0", "decay~0,write~1", "mixed"])
def test_gates_near_0_and_1(case):
    q, k, v, g, beta, cu, s0 = inputs([70, 3])
    if case == "decay~1,write~0":
        g, beta = g * 1e-9, beta * 1e-9
    elif case == "decay~0,write~1":
        g, beta = g * 0 - 60.0, 1 - beta * 1e-12
    else:  # alternate extreme tokens: gates exactly 0 / 1 and nearly so
        g = torch.where(torch.arange(73)[:, None] % 2 == 0, torch.zeros_like(g), -80.0 + g)
        beta = torch.where(torch.arange(73)[:, None] % 3 == 0, torch.ones_like(beta), beta * 1e-6)
    o, s = gd.gated_delta_chunk(q, k, v, g, beta, cu, s0, scale=0.35, chunk_size=16)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=0.35)
    assert torch.isfinite(o).all() and err(o, ro) < 1e-12 and err(s, rs) < 1e-12
    o32, s32 = gd.gated_delta_chunk(*(x.float() for x in (q, k, v, g, beta)), cu, s0.float(), scale=0.35)
    assert err(o32, ro) < 1e-4 * float(ro.abs().max())


@pytest.mark.parametrize("what", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("chunk", [8, 64])
def test_nan_reaches_what_the_recurrence_reaches(what, chunk):
    q, k, v, g, beta, cu, s0 = inputs([29, 12])
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    bad = args[what].clone()
    bad[13, 0 if what not in ("k", "q") else 1] = float("nan")  # token 13: mid-chunk for chunk 8, request 0
    if what == "v":
        bad[13, 0, 2] = float("nan")
    args[what] = bad
    o, s = gd.gated_delta_chunk(*args.values(), cu, s0, scale=0.35, chunk_size=chunk)
    ro, rs = ref.gated_delta(*args.values(), cu, s0, scale=0.35)
    assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.equal(torch.isnan(s), torch.isnan(rs))
    assert torch.isnan(ro).any() and not torch.isnan(ro[:13]).any() and not torch.isnan(ro[29:]).any()
    fin = torch.isfinite(ro)
    assert err(o[fin], ro[fin]) < 1e-12


def test_nan_in_conv_input_reaches_the_next_k_minus_1_tokens_only():
    x, w = torch.randn(12, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    x[4, 1] = float("nan")
    y, st = gd.causal_conv1d(x, w, None, torch.tensor([0, 6, 12]), torch.zeros(2, 3, 3, dtype=torch.float64))
    assert torch.isnan(y).nonzero().tolist() == [[4, 1], [5, 1]]  # request 0 ends at token 5
    assert torch.isnan(st).nonzero().tolist() == [[0, 1, 1]]


# ----------------------------------------------------------------------------- transformers' torch paths
def transformers_paths():
    """transformers' qwen3_next module, imported by the two tests that use it (it costs seconds at collection)."""
    return pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def test_chunk_and_step_match_transformers_torch_paths():
    hf = transformers_paths()
    q, k, v, g, beta, cu, s0 = inputs([50], dtype=torch.float32, state=False)
    s0 = torch.randn_like(s0) * 0.1
    o, s = gd.gated_delta_chunk(q, k, v, g, beta, cu, s0, scale=8**-0.5)
    ho, hs = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=s0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=8**-0.5)
    scale = float(ro.abs().max())
    assert err(o, ho[0]) < 1e-5 * scale and err(s, hs) < 1e-5 * float(rs.abs().max())
    assert err(o, ro) <= 2 * max(err(ho[0], ro), 1e-7 * scale)  # no worse than transformers vs float64
    # decode: transformers' recurrent path, one token on the prefill's state
    q1, k1, v1, g1, b1, _, _ = inputs([1], dtype=torch.float32, seed=3)
    o1, s1 = gd.gated_delta_step(q1, k1, v1, g1, b1, s, scale=8**-0.5)
    ho1, hs1 = hf.torch_recurrent_gated_delta_rule(q1[None], k1[None], v1[None], g1[None], b1[None], initial_state=hs,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert err(o1, ho1[0]) < 1e-5 and err(s1, hs1) < 1e-5


def test_conv_matches_transformers_conv_paths():
    hf = transformers_paths()
    x, w = torch.randn(11, 6), torch.randn(6, 4)
    y, st = gd.causal_conv1d(x, w, None, torch.tensor([0, 11]), torch.zeros(1, 3, 6))
    hy = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    assert err(y, hy) < 1e-6
    conv_state = torch.cat([torch.zeros(1, 6, 1), st.transpose(1, 2)], dim=-1)  # transformers keeps K columns
    x1 = torch.randn(1, 6)
    y1, st1 = gd.causal_conv1d(x1, w, None, torch.tensor([0, 1]), st)
    hy1 = hf.causal_conv1d_update(x1[:, :, None], conv_state, w, None, "silu")[:, :, 0]
    assert err(y1, hy1) < 1e-6 and err(st1.transpose(1, 2), conv_state[:, :, 1:]) == 0.0


# ----------------------------------------------------------------------------- registry and errors
@pytest.mark.slow
def test_opcheck():
    q, k, v, g, beta, cu, s0 = inputs([5, 3], dtype=torch.float32)
    torch.library.opcheck(torch.ops.cpattn.gated_delta_chunk, (q, k, v, g, beta, cu, s0, 0.3, True, 4))
    torch.library.opcheck(torch.ops.cpattn.gated_delta_step, (q[:2], k[:2], v[:2], g[:2], beta[:2], s0, 0.3, True))
    x, w = torch.randn(8, 6), torch.randn(6, 4)
    torch.library.opcheck(torch.ops.cpattn.causal_conv1d, (x, w, torch.randn(6), cu, torch.randn(2, 3, 6), True))


def test_errors_name_the_argument():
    q, k, v, g, beta, cu, s0 = inputs([5, 3])
    with pytest.raises(ValueError, match=r"initial_state must be \[B, Hv, Dk, Dv\] = \(2, 6, 8, 5\); got \(1, 6,"):
        gd.gated_delta_chunk(q, k, v, g, beta, cu, s0[:1], scale=1.0)
    with pytest.raises(ValueError, match=r"v must be \[T=8, Hv, Dv\] with Hv a multiple of Hk=2"):
        gd.gated_delta_chunk(q, k, v[:, :5], g, beta, cu, s0, scale=1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 7 but q has 8 tokens"):
        gd.gated_delta_chunk(q, k, v, g, beta, torch.tensor([0, 5, 7]), s0, scale=1.0)
    with pytest.raises(ValueError, match=r"conv_state must be \[B, K-1, C\] = \(2, 3, 6\)"):
        gd.causal_conv1d(torch.randn(8, 6), torch.randn(6, 4), None, cu, torch.zeros(2, 4, 6))


@pytest.mark.slow
def test_compile_fullgraph():
    """The decode ops trace (their plain-torch bodies are the CPU decompositions); the chunked op is one opaque
    call with its fake implementation. Same results as eager."""
    q, k, v, g, beta, cu, s0 = inputs([1, 1, 1], dtype=torch.float32)
    x, w, cs = torch.randn(3, 6), torch.randn(6, 4), torch.randn(3, 3, 6)

    def decode(q, k, v, g, beta, s, x, cs):
        y, cs = gd.causal_conv1d(x, w, None, torch.arange(4), cs)
        o, s = gd.gated_delta_step(q, k, v, g, beta, s, scale=0.3)
        return o, s, y, cs

    def prefill(q, k, v, g, beta, s):
        return gd.gated_delta_chunk(q, k, v, g, beta, cu, s, scale=0.3)

    for fn, args in ((decode, (q, k, v, g, beta, s0, x, cs)), (prefill, (q, k, v, g, beta, s0))):
        eager = fn(*args)
        traced = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        for a, b in zip(eager, traced):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
