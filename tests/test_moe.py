"""Mixture-of-experts blocks (cpattn.models.moe) against float64 references written plainly, and capture.

- routers: the chosen experts and weights equal a per-token float64 loop
  (softmax greedy, group-limited, renormalized; the sigmoid router);
- the dense, sync-free expert sum equals the sparse one and a per-token
  loop in float64;
- under ``torch.compile(fullgraph=True)`` "auto" takes the dense path (the
  sparse loop's host sync cannot be traced);
- a whole decode step of every MoE family passes ``check_static``
  (aot_eager, fullgraph, no recompiles) and equals the eager step, which
  runs the sparse path.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from cpattn.comm.sim import SimMesh
from cpattn.engine.decode import decode_step
from cpattn.engine.family import get_family
from cpattn.engine.paged_cache import PagedShard
from cpattn.graphs import check_static
from cpattn.models import deepseek_v2, deepseek_v3, qwen3_moe
from cpattn.models.moe import experts_dense, experts_sparse, moe_experts, sigmoid_route, softmax_route, use_dense

pytestmark = pytest.mark.usefixtures("one_thread")

G = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, generator=G, dtype=torch.float64) * scale


def plain_softmax_route(x, router, top_k, norm, scale, n_group, topk_group):
    """Token by token: probabilities, eligible groups by their best expert, top-k among the eligible."""
    weights, experts = [], []
    e = router.shape[0]
    for row in x:
        probs = torch.softmax(router @ row, dim=0)
        per = e // n_group
        best = [max(probs[g * per : (g + 1) * per].tolist()) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -best[g])[:topk_group]
        eligible = [j for j in range(e) if j // per in groups]
        chosen = sorted(eligible, key=lambda j: -probs[j].item())[:top_k]
        w = probs[chosen]
        if norm:
            w = w / w.sum()
        weights.append(w * scale)
        experts.append(chosen)
    return torch.stack(weights), torch.tensor(experts)


def as_sets(weights, experts):
    """{expert: weight} per token (the order of the k slots carries no meaning)."""
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(weights, experts)]


@pytest.mark.parametrize("n_group,topk_group,k,norm,scale", [(1, 1, 2, False, 1.0), (1, 1, 2, True, 1.0),
                                                            (4, 2, 3, False, 2.5), (4, 1, 2, True, 1.0)])
def test_softmax_route_matches_plain_loop(n_group, topk_group, k, norm, scale):
    """(With k <= topk_group the limit could never bind: the k best experts lie in the k best groups.)"""
    x, router = rnd(48, 16), rnd(8, 16)
    w, e = softmax_route(x, router, top_k=k, norm_topk_prob=norm, routed_scaling_factor=scale, n_group=n_group,
                         topk_group=topk_group, logits_dtype=torch.float64)
    want_w, want_e = plain_softmax_route(x, router, k, norm, scale, n_group, topk_group)
    got, want = as_sets(w, e), as_sets(want_w, want_e)
    assert [sorted(g) for g in got] == [sorted(g) for g in want]
    assert w.dtype == torch.float64  # a float64 run routes in float64 (a float32 router: 1 ulp = 1e-7 in the logits)
    for g, h in zip(got, want):
        for j in h:
            assert abs(g[j] - h[j]) <= 1e-12 * scale
    if topk_group < n_group:  # the limit is active: some token's global top-k lies outside its groups
        free_w, free_e = softmax_route(x, router, top_k=k, logits_dtype=torch.float64)
        assert [sorted(g) for g in as_sets(free_w, free_e)] != [sorted(g) for g in got]


def test_sigmoid_route_matches_plain_loop():
    x, router, bias = rnd(7, 16), rnd(8, 16), rnd(8, scale=0.3)
    w, e = sigmoid_route(x, router, bias, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5)
    for row, wr, er in zip(x, w, e):
        s = torch.sigmoid(router @ row)
        c = s + bias
        group = [sum(sorted(c[g * 2 : g * 2 + 2].tolist())[-2:]) for g in range(4)]
        keep = sorted(range(4), key=lambda g: -group[g])[:2]
        chosen = sorted([j for j in range(8) if j // 2 in keep], key=lambda j: -c[j].item())[:2]
        assert sorted(er.tolist()) == sorted(chosen)
        want = s[chosen] / s[chosen].sum() * 2.5
        assert dict(zip(er.tolist(), wr.tolist())) == pytest.approx(dict(zip(chosen, want.tolist())), abs=1e-12)
    assert w.dtype == torch.float64  # float64 activations: scores, choice and weights in float64


def expert_weights(e=6, h=16, i=8):
    return rnd(e, 2 * i, h, scale=0.3), rnd(e, h, i, scale=0.3)


def test_dense_equals_sparse_and_plain_loop_float64():
    gate_up, down = expert_weights()
    x = rnd(11, 16)
    w, e = softmax_route(x, rnd(6, 16), top_k=2, norm_topk_prob=True, logits_dtype=torch.float64)
    w = w.double()
    sparse = experts_sparse(x, w, e, gate_up, down)
    dense = experts_dense(x, w, e, gate_up, down)
    plain = torch.stack([sum(w[t, j] * F.linear(F.silu(F.linear(x[t], gate_up[e[t, j], :8])) *
                                                F.linear(x[t], gate_up[e[t, j], 8:]), down[e[t, j]])
                             for j in range(2)) for t in range(11)])
    assert (sparse - plain).abs().max() <= 1e-12 * plain.abs().max()
    assert (dense - plain).abs().max() <= 1e-12 * plain.abs().max()
    assert sparse.dtype == dense.dtype == torch.float64


def test_dense_keeps_the_activation_dtype():
    gate_up, down = (t.to(torch.bfloat16) for t in expert_weights())
    x = rnd(5, 16).to(torch.bfloat16)
    w, e = softmax_route(x, rnd(6, 16), top_k=2)
    out = experts_dense(x, w, e, gate_up, down)
    ref = experts_sparse(x.double(), w.double(), e, gate_up.double(), down.double())
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.slow
def test_moe_impl_choice_and_capture():
    assert not use_dense("auto") and use_dense("dense") and not use_dense("sparse")
    with pytest.raises(ValueError, match="moe_impl must be one of"):
        use_dense("grouped")
    with pytest.raises(ValueError, match="moe_impl must be one of"):
        qwen3_moe.Qwen3MoeConfig.tiny(moe_impl="grouped")
    gate_up, down = (t.float() for t in expert_weights())
    x = rnd(4, 16).float()

    router, bias = rnd(6, 16).float(), rnd(6).float()

    def block(x, impl):  # both routers, then the expert sum
        w, e = softmax_route(x, router, top_k=2, n_group=3, topk_group=2)
        w2, e2 = sigmoid_route(x, router, bias, top_k=2, n_group=3, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.0)
        return moe_experts(x, w, e, gate_up, down, impl=impl) + moe_experts(x, w2, e2, gate_up, down, impl=impl)

    torch._dynamo.reset()
    got = torch.compile(functools.partial(block, impl="auto"), backend="aot_eager", fullgraph=True)(x)
    assert torch.allclose(got, block(x, "sparse"), atol=1e-6)
    with pytest.raises(Exception, match="(?i)tolist|data-dependent|graph break|unique"):
        torch.compile(functools.partial(block, impl="sparse"), backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()


CAPTURE = {
    "qwen3_moe": lambda: qwen3_moe.Qwen3MoeConfig.tiny(),
    "deepseek_v2": lambda: deepseek_v2.DeepseekV2Config.tiny(),
    "deepseek_v3": lambda: deepseek_v3.DeepseekV3Config.tiny(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CAPTURE))
def test_moe_decode_step_is_capturable(name):
    """A decode step (DCP group of one, 3 requests, one padding request) through check_static."""
    family, cfg = get_family(name), CAPTURE[name]()
    assert family.capturable
    params = family.init_params(cfg, seed=1, std=0.2)
    group = SimMesh(1).groups()[0]
    shard = PagedShard.empty(family.kv_layouts(cfg), capacity=[12] * 3, dcp_size=1, block_size=4, interleave_size=1)
    step = functools.partial(decode_step, family=family, cfg=cfg, group=group, merge="ag_rs")
    gen = torch.Generator().manual_seed(2)

    def batch(lens):
        return {"tokens": torch.randint(0, cfg.vocab_size, (3,), generator=gen), "seq_lens": torch.tensor(lens),
                "block_table": shard.block_table.clone(), "cu_seqlens_q": torch.arange(4, dtype=torch.int32)}

    state = {"params": params, "shard": shard}
    for s in range(1, 9):  # fill 8 positions eagerly (the sparse path)
        step(state, batch([s] * 3))
    torch._dynamo.reset()
    outs = check_static(step, state, [batch([9, 5, 7]), batch([3, 9, 1]), batch([9, 0, 2])])
    torch._dynamo.reset()
    assert all(torch.isfinite(o[0][[0, 2]]).all() for o in outs)  # row 1 of the last batch is padding
