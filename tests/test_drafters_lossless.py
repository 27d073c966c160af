"""MTP, Eagle3 and DSpark under PCP prefill and DCP decode: lossless, identical drafts on every rank, drafts equal
a no-cache recomputation, P/D (simulated and gloo), float32, graph mode.

Targets and heads are the shipped tiny trained ones (tests/data/speculative, see spec_methods_cases.py), so
drafts do get accepted and every rollback path runs. The reference is plain single-device greedy generation
(conftest.py's ``one_device``, :mod:`ref.greedy`: each token the argmax of a fresh full one-device prefill's last
row, no engine code); float64 makes every logit match to
rounding, so tokens must be identical; float32 counts near-tie flips (DESIGN.md §5).
"""

from __future__ import annotations

import pytest
import torch
from near_tie import check_tokens
from spec_methods_cases import TARGET_OF, V4_CFG, Recorder
from spec_methods_cases import check_lossless as check
from spec_methods_cases import (
    head, prompts, reference_drafts, run_cases, same_on_every_rank, target, v4_prompts, v4_target, v4_trained,
)

from cpattn.comm.launch import spawn
from cpattn.comm.sim import simulate
from cpattn.engine import driver
from cpattn.engine.drafters import speculative_fields
from cpattn.models.generate import (
    disagg_generate, generate, pcp_dcp_config, pcp_dcp_generate_on_rank, pd_generate_on_rank, speculative_generate,
)

NEW = 14
METHODS = ("mtp", "eagle3", "dspark")

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def reference(one_device):
    """method -> (model, params, cfg, prompts, plain one-device greedy of NEW tokens) of the method's target;
    the greedy is conftest.py's ``one_device`` (a fresh full prefill per token, no engine code)."""
    def ref(method: str, dtype=torch.float64):
        model, cfg, params = target(TARGET_OF[method], dtype)
        ps = prompts(TARGET_OF[method])
        return model, params, cfg, ps, one_device(model, params, cfg, ps, NEW)

    return ref


# k = 1..4, each over its own topology: one device; PCP 2 prefill; DCP 2 decode; PCP 2 + DCP 2
CASES = [(m, k, topo) for m in METHODS for k, topo in zip((1, 2, 3, 4), ("1x1", "pcp2", "dcp2", "pcp2+dcp2"))]


@pytest.mark.slow
@pytest.mark.parametrize("method,k,topo", CASES, ids=[f"{m}-k{k}-{t}" for m, k, t in CASES])
def test_equals_plain_greedy(reference, method, k, topo):
    model, params, cfg, ps, ref = reference(method)
    d = head(method)
    if topo == "pcp2+dcp2":
        if method == "dspark":  # PCP takes DSpark for DeepSeek-V4 DSA only: a PCP prefill + DCP decode engine pair
            pre, dec = driver.engine_configs(model, cfg, pcp_size=2, dcp_size=2, num_speculative_tokens=k)
            outs = simulate(2, driver.generate_on_rank, model, params, cfg, ps, NEW, prefill=pre,
                            decode=dec.replace(**speculative_fields(d)), drafter=d)
        else:  # one engine with PCP and DCP (opt-in): the guide's method for the attention kind
            outs = simulate(2, pcp_dcp_generate_on_rank, model, params, cfg, ps, NEW,
                            config=pcp_dcp_config(model, cfg, 2), drafter=d, num_speculative_tokens=k)
        same_on_every_rank(outs)
        out = outs[0]
    else:
        pcp, dcp = {"1x1": (1, 1), "pcp2": (2, 1), "dcp2": (1, 2)}[topo]
        out = speculative_generate(model, params, cfg, ps, NEW, drafter=d, num_speculative_tokens=k, pcp_size=pcp,
                                   dcp_size=dcp, interleave_size=2 if dcp > 1 else 1)
    check(out, ref, k)


@pytest.mark.parametrize("method", METHODS)
def test_drafts_equal_a_no_cache_recomputation(reference, method):
    """Every proposal of the cached, rolled-back, uniformly padded draft state (DCP 2, k = 3) equals the
    drafter recomputed from scratch on the target's hidden states of the history."""
    model, params, cfg, ps, ref = reference(method)
    rec = Recorder(head(method))
    out = speculative_generate(model, params, cfg, ps, NEW, drafter=rec, num_speculative_tokens=3, dcp_size=2)
    check(out, ref, 3)
    seen = {(tuple(h), tuple(d)) for histories, drafts in rec.log for h, d in zip(histories, drafts)}  # both ranks'
    assert len(seen) >= 12
    for h, got in sorted(seen):
        assert reference_drafts(rec.drafter, model, params, cfg, list(h), 3) == list(got), f"history {h}"


def test_no_cache_reference_attends_in_float64():
    """The no-cache references' attention (sequence.masked_attention) keeps a float64 run in float64: its
    drafts are compared token for token with the cached drafter's, so a float32 softmax there would make that
    comparison a greedy choice after a cast (weights 1 float32 ulp apart; a near tie flips a draft)."""
    from cpattn.lab.sequence import masked_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    mask = torch.rand(5, 7, generator=g)[:, :5] < 0.7
    mask[:, 0] = True
    got = masked_attention(q, k[:5], v[:5], mask, 0.3)
    kk, vv = k[:5].repeat_interleave(2, dim=1), v[:5].repeat_interleave(2, dim=1)  # [M, Hq, D]
    s = torch.einsum("nhd,mhd->hnm", q, kk) * 0.3
    w = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)  # [Hq, N, M], float64 throughout
    want = torch.einsum("hnm,mhd->nhd", w, vv)
    assert got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-13


@pytest.mark.parametrize("method", METHODS)
def test_pd_simulated(reference, method):
    model, params, cfg, ps, ref = reference(method)
    out = disagg_generate(model, params, cfg, ps, NEW, pcp_size=2, dcp_size=2, drafter=head(method),
                          num_speculative_tokens=2)
    check(out, ref, 2)


@pytest.mark.parametrize("method", METHODS)
def test_float32(reference, method):
    """float32: verification logits within 1e-4 of plain decode; a differing token only at a near tie."""
    model, params, cfg, ps, ref = reference(method, torch.float32)
    out = speculative_generate(model, params, cfg, ps, NEW, drafter=head(method, dtype=torch.float32),
                               num_speculative_tokens=3, dcp_size=2, interleave_size=2)
    flips: list = []
    for b in range(len(ps)):
        check_tokens(out.tokens[b], out.logits[b], ref.tokens[b], ref.logits[b], f"{method} request {b}", flips)
    assert len(flips) <= 1 and out.stats.accepted > 0, flips


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_graph_mode(reference, method):
    """FULL_DECODE_ONLY: the verify step and the draft steps replay captures (sizes multiples of 1 + k where a
    request brings 1 + k rows), with the tokens and logits of eager."""
    model, params, cfg, ps, ref = reference(method)
    k = 3
    rec = Recorder(head(method))
    out = speculative_generate(model, params, cfg, ps, NEW, drafter=rec, num_speculative_tokens=k, dcp_size=2,
                               graph=True)
    check(out, ref, k)
    eager = speculative_generate(model, params, cfg, ps, NEW, drafter=head(method), num_speculative_tokens=k,
                                 dcp_size=2)
    assert torch.equal(out.tokens, eager.tokens)
    # a replay pads its batch to the captured size, and a float64 matmul over another row count may round the
    # last bit differently on some CPUs (AVX-512 / AMX: up to 7.1e-15 here, bit-equal on others)
    torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=1e-12)
    assert out.stats.graph_steps == out.stats.steps
    proposals = out.stats.steps + 1  # the step loop proposes after the prefill and after every decode step
    for state in rec.states:
        catch_up = state.runners[1 + k]
        assert all(s % (1 + k) == 0 for s in catch_up.sizes)
        assert catch_up.stats.eager == 1 and catch_up.stats.reasons == {"prefill": 1}  # the prompt's catch-up
        assert catch_up.stats.graph == proposals - 1
        if method != "dspark":  # the chain steps, one row per request: every one replayed
            assert state.runners[1].stats.graph == (k - 1) * proposals and state.runners[1].stats.eager == 0


@pytest.mark.slow
def test_on_gloo_ranks(reference, one_device):
    """Real gloo processes: P/D (2 prefill -> 2 decode ranks, hidden states sent with the KV, each name's
    width first) for each method, and DSpark on DeepSeek-V4 (its rows are n_hc * H streams); identical drafts
    on both decode ranks."""
    runs = []
    for method, k in zip(METHODS, (3, 2, 4)):
        model, params, cfg, ps, ref = reference(method)
        runs.append(((model, params, cfg, ps, NEW), head(method), k, ref))
    v4_args = ("deepseek_v4", v4_target(), V4_CFG, v4_prompts(), NEW)
    runs.append((v4_args, v4_trained()[0], 3, one_device(*v4_args)))
    cases = [(pd_generate_on_rank, args, {"pcp_size": 2, "dcp_size": 2, "block_size": 4, "drafter": d,
                                          "num_speculative_tokens": k}) for args, d, k, _ in runs]
    per_rank = spawn(4, run_cases, cases)
    for i, (_, _, _, ref) in enumerate(runs):
        for rank in per_rank:
            assert torch.equal(rank[i].tokens, ref.tokens)
        dec = [rank[i] for rank in per_rank[2:]]
        assert dec[0].stats.accepted > 0 and dec[0].stats.draft_digest == dec[1].stats.draft_digest


@pytest.mark.slow
def test_graph_compiled(reference):
    """The verify step (returning the hidden rows the drafter reads) and Eagle3's catch-up step compiled by
    torch.compile (aot_eager, fullgraph; one rank: a compiled step cannot trace the simulated mesh's threads)
    and replayed for every step: the tokens of plain greedy generation. (Each draft step alone compiles and
    replays equal to eager in test_drafters_units.py::test_draft_steps_are_capturable.)"""
    model, params, cfg, ps, ref = reference("eagle3")
    rec = Recorder(head("eagle3"))
    out = speculative_generate(model, params, cfg, ps[:2], 8, drafter=rec, num_speculative_tokens=1,
                               graph="aot_eager")
    assert torch.equal(out.tokens, ref.tokens[:2, :8])
    assert out.stats.graph_steps == out.stats.steps and out.stats.accepted > 0
    (state,) = rec.states
    assert state.runners[2].stats.graph == out.stats.steps  # all but the prompt's catch-up (one per decode step)


@pytest.mark.slow
def test_other_targets_with_random_heads(one_device):
    """Losslessness does not depend on the head: Eagle3 on Qwen3-MoE, MTP on DeepSeek-V3.2 and on GLM-5 (DSA with
    shared-indexer layers), random heads, under PCP + DCP on one engine (the guide's methods for GQA and DSA)."""
    from cpattn.drafters.eagle3 import Eagle3Drafter
    from cpattn.drafters.mtp import MTPDrafter
    from cpattn.models import deepseek_v32, glm_moe_dsa, qwen3_moe

    ps = [[5, 9, 2, 7, 7, 1, 3], [4], [8, 8, 8, 8, 3]]
    mcfg = qwen3_moe.Qwen3MoeConfig.tiny()
    mparams = qwen3_moe.init_params(mcfg, seed=4, std=0.3, dtype=torch.float64)
    dcfg = deepseek_v32.DeepseekV32Config.tiny()
    dparams = deepseek_v32.init_params(dcfg, seed=2, dtype=torch.float64)
    gcfg = glm_moe_dsa.GlmMoeDsaConfig.tiny()
    gparams = glm_moe_dsa.init_params(gcfg, seed=2, dtype=torch.float64)
    for model, params, cfg, d in (
            ("qwen3_moe", mparams, mcfg, Eagle3Drafter.random(mparams, mcfg, std=0.3, dtype=torch.float64)),
            ("deepseek_v32", dparams, dcfg, MTPDrafter.random("deepseek_v32", dcfg, target_params=dparams, std=0.3,
                                                              dtype=torch.float64)),
            ("glm_moe_dsa", gparams, gcfg, MTPDrafter.random("glm_moe_dsa", gcfg, target_params=gparams, std=0.3,
                                                             dtype=torch.float64))):
        ref = one_device(model, params, cfg, ps, 10)
        outs = simulate(2, pcp_dcp_generate_on_rank, model, params, cfg, ps, 10,
                        config=pcp_dcp_config(model, cfg, 2, interleave_size=2), drafter=d, num_speculative_tokens=2)
        same_on_every_rank(outs)
        assert torch.equal(outs[0].tokens, ref.tokens)
