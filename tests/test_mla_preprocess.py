"""mla_preprocess (MLAPO) against the float64 unfused chain, the models' own path, opcheck and torch.compile."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cpattn.ops import mla_preprocess_npu, registry
from cpattn.ops.mla_preprocess import mla_preprocess, mla_weights
from ref.mlapo import mla_preprocess_ref

T, H, HQ, NOPE, ROPE, R, RQ, NB, BS = 6, 32, 4, 16, 8, 24, 20, 4, 4
SLOTS = [13, -1, 2, 7, -1, 0]  # two rows write nothing (another DCP rank's tokens / padding)


def make(dtype, lora=True, seed=0, cache_dtype=None):
    """Inputs of one call: (positional tensors, keyword weights); the cache is NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    ang = torch.rand(T, ROPE // 2, generator=g, dtype=torch.float64) * 6.0
    weights = dict(
        input_norm_weight=(1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)).to(dtype),
        q_a_weight=w(RQ, H) if lora else None,
        q_a_norm_weight=(1 + 0.1 * torch.randn(RQ, generator=g, dtype=torch.float64)).to(dtype) if lora else None,
        q_b_weight=w(HQ * (NOPE + ROPE), RQ if lora else H),
        kv_a_weight=w(R + ROPE, H),
        kv_a_norm_weight=(1 + 0.1 * torch.randn(R, generator=g, dtype=torch.float64)).to(dtype),
        w_uk=w(HQ, NOPE, R, scale=NOPE ** -0.5),
    )
    hidden = w(T, H, scale=3.0)
    cache = torch.full((NB, BS, 1, R + ROPE), float("nan"), dtype=cache_dtype or dtype)
    return (hidden, cache, torch.tensor(SLOTS), ang.cos().to(dtype), ang.sin().to(dtype)), weights


def run(args, weights, interleave, fn=mla_preprocess):
    return fn(*args, **weights, eps=1e-6, rope_interleave=interleave)


def ref(args, weights, interleave, dtype=torch.float64):
    hidden, cache, slots, cos, sin = args
    return mla_preprocess_ref(hidden, weights["input_norm_weight"], weights["q_a_weight"], weights["q_a_norm_weight"],
                              weights["q_b_weight"], weights["kv_a_weight"], weights["kv_a_norm_weight"],
                              weights["w_uk"], cos, sin, cache, slots, 1e-6, interleave, dtype=dtype)


def err(a, b):
    """Max abs difference over finite reference entries, relative to the reference's max magnitude."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    return ((a - b).abs()[fin].max() / b[fin].abs().max().clamp(min=1e-30)).item() if fin.any() else 0.0


def check_cache(cache, ref_cache, kv):
    """Written slots hold kv (cast to the cache dtype); every other row is still NaN."""
    rows = cache.view(-1, R + ROPE)
    written = torch.zeros(rows.shape[0], dtype=torch.bool)
    for t, s in enumerate(SLOTS):
        if s >= 0:
            written[s] = True
            assert torch.equal(rows[s], kv[t, 0].to(cache.dtype))
    assert rows[~written].isnan().all()
    assert torch.equal(rows[written].isnan(), torch.zeros_like(rows[written], dtype=torch.bool))
    assert torch.equal(ref_cache.view(-1, R + ROPE).isnan(), rows.isnan())


@pytest.mark.parametrize("lora", [True, False], ids=["q-lora", "q-proj"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_float64_chain(dtype, lora, interleave):
    args, weights = make(dtype, lora)
    out = run(args, weights, interleave)
    want = ref(args, weights, interleave)
    plain = ref(args, weights, interleave, dtype=dtype)  # the same chain computed plainly in this dtype
    assert out.q.shape == (T, HQ, R + ROPE) and out.kv.shape == (T, 1, R + ROPE) and out.x.shape == (T, H)
    assert out.q_lora.shape == ((T, RQ) if lora else (T, 0))
    for got, w, p in zip(out, want[:4], plain[:4]):
        assert got.dtype == dtype
        if got.numel() == 0:
            continue
        if dtype == torch.bfloat16:
            assert err(got, w) <= 2 * err(p, w) + 1e-3
        else:  # RMSNorm normalizes in float32 as the models do, in float64 for a float64 run (no float32 cast)
            assert err(got, w) < (1e-5 if dtype == torch.float32 else 1e-12)
    check_cache(args[1], want[4], out.kv)
    tol = {torch.bfloat16: 2 * err(plain[4], want[4]) + 1e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert err(args[1], want[4]) <= tol


def test_absorption_equals_the_expanded_scores():
    """q . [c | k_rope] equals the expanded MLA score sum q_nope.(W_UK c) + q_rope.k_rope (float64)."""
    args, weights = make(torch.float64)
    out = run(args, weights, True)
    hidden, cache, slots, cos, sin = args
    q_lora = out.q_lora
    q = (q_lora @ weights["q_b_weight"].T).view(T, HQ, NOPE + ROPE)
    c, k_rope = out.kv[:, 0, :R], out.kv[:, 0, R:]
    k_nope = torch.einsum("hnr,sr->shn", weights["w_uk"], c)  # per-head keys from the latent
    expanded = torch.einsum("thn,shn->ths", q[..., :NOPE], k_nope) + torch.einsum("thd,sd->ths", out.q[..., R:], k_rope)
    absorbed = torch.einsum("thd,sd->ths", out.q, out.kv[:, 0])
    assert torch.allclose(absorbed, expanded, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("over", [{}, {"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["v3", "no-q-lora", "half-split"])
def test_bitwise_equal_to_the_models_path(dtype, over):
    """The models' mla_project + write_kv_mla, bit for bit: switching to the op leaves tokens unchanged."""
    from cpattn.models import deepseek_v3 as ds
    from cpattn.models.common import rms_norm, rope_cos_sin, rope_inv_freq
    from cpattn.ops import write_kv_mla

    cfg = ds.DeepseekV3Config.tiny(**over)
    params = ds.init_params(cfg, seed=3, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, cfg.hidden_size, generator=g).to(dtype)
    inv_freq, factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 4, 9, 17]), inv_freq, factor, dtype)
    slots = torch.tensor([3, -1, 0, 6, -1])
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pre = "model.layers.1.self_attn."
    x = rms_norm(h, params["model.layers.1.input_layernorm.weight"], cfg.rms_norm_eps)
    q, kv, q_lora = ds.mla_project(params, cfg, pre, x, cos, sin)
    cache_models = torch.full((2, 4, 1, width), float("nan"), dtype=dtype)
    write_kv_mla(cache_models, kv[:, 0, : cfg.kv_lora_rank], kv[:, 0, cfg.kv_lora_rank :], slots)
    cache = torch.full_like(cache_models, float("nan"))
    w = mla_weights(params, pre, num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim,
                    v_head_dim=cfg.v_head_dim)
    out = mla_preprocess(h, cache, slots, cos, sin, **w, eps=cfg.rms_norm_eps, rope_interleave=cfg.rope_interleave)
    assert torch.equal(out.q, q) and torch.equal(out.kv, kv) and torch.equal(out.x, x)
    assert torch.equal(out.q_lora, q_lora) if q_lora is not None else out.q_lora.shape == (5, 0)
    assert torch.equal(cache.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       cache_models.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_cache_in_another_dtype_and_no_tokens():
    args, weights = make(torch.float32, cache_dtype=torch.bfloat16)
    out = run(args, weights, True)
    check_cache(args[1], ref(args, weights, True)[4], out.kv)
    hidden, cache, slots, cos, sin = args
    empty = mla_preprocess(hidden[:0], cache, slots[:0], cos[:0], sin[:0], **weights, eps=1e-6, rope_interleave=True)
    assert empty.q.shape == (0, HQ, R + ROPE) and empty.q_lora.shape == (0, RQ)


def test_generic_body_and_cpu_kernel_agree():
    """The device-generic body (the graph decomposition) writes and returns exactly what the CPU kernel does."""
    args, weights = make(torch.float32)
    a = run(args, weights, True)
    body = registry._BODIES["mla_preprocess"]
    hidden, cache, slots, cos, sin = args
    cache2 = torch.full_like(cache, float("nan"))
    w = weights
    b = body(hidden, w["input_norm_weight"], w["q_a_weight"], w["q_a_norm_weight"], w["q_b_weight"],
             w["kv_a_weight"], w["kv_a_norm_weight"], w["w_uk"], cos, sin, cache2, slots, 1e-6, True, 1e-6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(cache.view(torch.int32), cache2.view(torch.int32))
    assert "mla_preprocess" in registry.decompositions()


def _op_args(args, weights, interleave=True):
    hidden, cache, slots, cos, sin = args
    w = weights
    return (hidden, w["input_norm_weight"], w["q_a_weight"], w["q_a_norm_weight"], w["q_b_weight"], w["kv_a_weight"],
            w["kv_a_norm_weight"], w["w_uk"], cos, sin, cache, slots, 1e-6, interleave, 1e-6)


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("lora", [True, False])
def test_opcheck(lora):
    args, weights = make(torch.float32, lora)
    torch.library.opcheck(torch.ops.cpattn.mla_preprocess.default, _op_args(args, weights))


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opaque", [False, True], ids=["decomposed", "opaque-op"])
def test_compile_fullgraph(backend, opaque):
    args, weights = make(torch.float32)
    eager_cache = torch.full_like(args[1], float("nan"))
    eager = run((args[0], eager_cache, *args[2:]), weights, True)

    if opaque:
        def step(*a):
            return torch.ops.cpattn.mla_preprocess(*a)
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        out = compiled(*_op_args(args, weights))
    else:
        def step(hidden, cache, slots, cos, sin):
            return tuple(mla_preprocess(hidden, cache, slots, cos, sin, **weights, eps=1e-6, rope_interleave=True))
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        out = compiled(*args)
    tol = 0 if backend == "aot_eager" else 1e-5
    for a, b in zip(out, eager):
        assert err(a, b) <= tol if a.numel() else a.shape == b.shape
    rows, eager_rows = args[1].view(-1, R + ROPE), eager_cache.view(-1, R + ROPE)
    assert torch.equal(rows.isnan(), eager_rows.isnan())  # the same rows written, the rest still NaN
    assert err(rows, eager_rows) <= tol


@pytest.mark.parametrize("change,match", [
    (dict(w_uk=torch.zeros(HQ, NOPE, R + 1)), "kv_cache must be"),
    (dict(q_a_norm_weight=None), "go together"),
    (dict(kv_a_norm_weight=torch.zeros(R + 1)), "kv_a_norm_weight must be"),
    (dict(q_b_weight=torch.zeros(3, RQ)), "q_b_weight must be"),
    (dict(kv_a_weight=torch.zeros(R + ROPE, H, dtype=torch.float64)), "cast the weights"),
])
def test_errors_name_the_argument(change, match):
    args, weights = make(torch.float32)
    with pytest.raises(ValueError, match=match):
        run(args, {**weights, **change}, True)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_preprocess(args[0], args[1], args[2].float(), args[3], args[4], **weights, eps=1e-6, rope_interleave=True)


# ------------------------------------------------------------------------------------------- NPU plumbing
def fake_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                       rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None,
                       rmsnorm_epsilon_cq=1e-5, rmsnorm_epsilon_ckv=1e-5, cache_mode="PA_BSND",
                       query_norm_flag=False, calls=None):
    """Documented semantics of torch_npu.npu_mla_prolog_v3 (non-quantized, TND), in float64."""
    assert cache_mode == "TND" and cache_index is None and query_norm_flag
    for t in (token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rope_sin, rope_cos, kv_cache, kr_cache):
        assert t.is_contiguous() and t.dtype == torch.bfloat16
    f = lambda t: t.double()  # noqa: E731
    n, d, hckv = weight_uk.shape
    dr = rope_sin.shape[-1]

    def rms(x, gamma, eps):
        return f(gamma) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x):  # "interleave-half"
        x1, x2 = x[..., ::2], x[..., 1::2]
        cos, sin = f(rope_cos), f(rope_sin)
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return torch.cat([x1, x2], -1) * cos + torch.cat([-x2, x1], -1) * sin

    x = f(token_x)
    cq = rms(x @ f(weight_dq), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)  # [T, Hcq]
    qc = (cq @ f(weight_uq_qr)).view(x.shape[0], n, d + dr)
    q_n = torch.einsum("tnd,ndk->tnk", qc[..., :d], f(weight_uk))
    q_r = rope(qc[..., d:])
    ckr = x @ f(weight_dkv_kr)  # [T, Hckv + Dr]
    kv_cache.copy_(rms(ckr[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)[:, None])
    kr_cache.copy_(rope(ckr[:, hckv:])[:, None])
    if calls is not None:
        calls.append(cache_mode)
    return q_n.bfloat16(), q_r.bfloat16(), None, cq.bfloat16(), None


def test_npu_kernel_plumbing_against_the_documented_semantics(monkeypatch):
    calls = []
    stub = types.ModuleType("torch_npu")
    stub.npu_mla_prolog_v3 = lambda *a, **k: fake_mla_prolog_v3(*a, **k, calls=calls)
    stub.npu_format_cast = lambda t, fmt: t  # the layout change does not alter values
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    monkeypatch.setattr(mla_preprocess_npu, "fits_prolog", lambda *a: True)  # documented sizes are far bigger
    args, weights = make(torch.bfloat16)
    hidden, cache, slots, cos, sin = args
    out = mla_preprocess_npu.mla_preprocess_npu(*_op_args(args, weights))
    assert calls == ["TND"]
    want = ref(args, weights, True)
    plain = ref(args, weights, True, dtype=torch.bfloat16)
    for got, w, p in zip(out, want[:4], plain[:4]):
        assert got.shape == w.shape and err(got, w) <= 2 * err(p, w) + 1e-2
    check_cache(cache, want[4], out[1])


def test_npu_kernel_falls_back_outside_the_documented_limits():
    args, weights = make(torch.float32)  # float32, tiny sizes: not the prolog's
    assert not mla_preprocess_npu.fits_prolog(args[0], weights["q_a_weight"], weights["w_uk"], args[3], args[1], True)
    cache2 = torch.full_like(args[1], float("nan"))
    a = mla_preprocess_npu.mla_preprocess_npu(*_op_args(args, weights))  # never imports torch_npu
    b = run((args[0], cache2, *args[2:]), weights, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert "torch_npu" not in sys.modules
