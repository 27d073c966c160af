"""GLM-5 (``glm_moe_dsa``): DSA with top-k shared across layers, exact against Hugging Face ``transformers``.

Tiny seeded random HF models (machinery in hf_oracle.py), 6 heads (DCP 2
and 3 divide them), 32 indexer heads of 16 dims (no exact top-k ties, so
HF's own cached generate is well defined), top-8 of up to 53 keys (the
selection is active), 4 layers:

- "mixed": ``index_topk_pattern = "FSSF"`` (full, shared, shared, full);
- "freq": ``index_topk_freq = 2, index_skip_topk_offset = 1`` (F, S, F, S).

Checked: prompt logits <= 1e-4 relative and 32 greedy tokens equal to HF
``generate(do_sample=False)`` (near-tie flips counted, DESIGN.md §5) under
(pcp, dcp) in {(1,1), (2,1), (3,1), (1,2), (1,3)}, DSA-CP on 2 and 3 ranks
with both splits, P/D, PCP with DCP, speculative verification (1 + k
rows); the selection API of every step against a float64 oracle; a cached
prefix (chunked prefill) with shared layers; no indexer-key cache on shared
layers (bytes counted against HF's cache); bytes a DCP=2 decode step sends
for a full and a shared layer; the decode step captured (aot_eager) on one
rank and on 2 real gloo ranks (with Qwen3-MoE), equal to eager at every
capture size.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import NEW_TOKENS, PROMPT_LENS, VOCAB, Reference, forward_logits, perturbed, rel_err  # noqa: E402
from near_tie import check_choices  # noqa: E402
from ref import topk_order  # noqa: E402

import cpattn  # noqa: E402
from cpattn.comm.launch import spawn  # noqa: E402
from cpattn.comm.sim import SimMesh  # noqa: E402
from cpattn.dcp import dcp_plan  # noqa: E402
from cpattn.engine import driver  # noqa: E402
from cpattn.engine.batch import Prompts  # noqa: E402
from cpattn.engine.decode import decode_step  # noqa: E402
from cpattn.engine.dense_cache import DenseKVCache  # noqa: E402
from cpattn.drafters.ngram import NgramDrafter  # noqa: E402
from cpattn.engine.family import KVLayout  # noqa: E402
from cpattn.engine.paged_cache import DCPStep, PagedShard  # noqa: E402
from cpattn.engine.prefill import gather_unshard, prefill  # noqa: E402
from cpattn.engine.prefill_steps import Prefix  # noqa: E402
from cpattn.graphs import check_static  # noqa: E402
from cpattn.models import glm_moe_dsa as glm  # noqa: E402
from cpattn.models import load_checkpoint, normalize_params  # noqa: E402
from cpattn.models.generate import disagg_generate, generate, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=6, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, max_position_embeddings=64, index_topk=8, index_head_dim=16, index_n_heads=32,
            initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
CONFIGS = {"mixed": {"index_topk_pattern": "FSSF"}, "freq": {"index_topk_freq": 2, "index_skip_topk_offset": 1}}
FLIPS: list[tuple[str, int]] = []  # near-tie flips seen (DESIGN.md §5: count them)
_REFS: dict[str, Reference] = {}


def hf_model(name: str, seed: int = 0, **over):
    return perturbed(transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig(**{**BASE, **CONFIGS[name],
                                                                                        **over}), seed)


def reference(name: str) -> Reference:
    if name not in _REFS:
        _REFS[name] = Reference(f"glm5-{name}", glm, hf_model(name), FLIPS)
    return _REFS[name]


# -- configuration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"index_topk_pattern": "FSSFS"}, {"index_topk_freq": 3},
                                {"index_topk_freq": 2, "index_skip_topk_offset": 3},
                                {"indexer_types": ["full", "shared", "full", "full", "shared"]}],
                         ids=["default", "pattern", "freq3", "freq2-offset3", "explicit"])
def test_layer_kinds_follow_hf(kw):
    """indexer_types as HF derives them; shared layers have no indexer weights in HF or in init_params."""
    hf_cfg = transformers.GlmMoeDsaConfig(**{**BASE, "num_hidden_layers": 5, **kw})
    for source in (hf_cfg, hf_cfg.to_dict(), {k: v for k, v in hf_cfg.to_dict().items() if k != "indexer_types"}
                   | {k: v for k, v in kw.items()}):
        assert glm.GlmMoeDsaConfig.from_hf(source).indexer_types == tuple(hf_cfg.indexer_types)
    cfg = glm.GlmMoeDsaConfig.from_hf(hf_cfg)
    hf = transformers.GlmMoeDsaForCausalLM(hf_cfg)
    assert [layer.self_attn.indexer is None for layer in hf.model.layers] == [t == "shared" for t in cfg.indexer_types]
    assert set(glm.init_params(cfg)) == set(normalize_params(hf.state_dict()))


def test_config_defaults_and_errors():
    """GLM-5's own defaults (rms_norm_eps 1e-5, n_group 1, 3 dense layers, 32 x 128 indexer) and named refusals."""
    d = {k: v for k, v in BASE.items() if k not in ("first_k_dense_replace", "index_n_heads", "index_head_dim",
                                                   "index_topk")}
    cfg = glm.GlmMoeDsaConfig.from_hf({**d, "model_type": "glm_moe_dsa"})
    hf = transformers.GlmMoeDsaConfig(**d)
    assert (cfg.rms_norm_eps, cfg.n_group, cfg.topk_group) == (hf.rms_norm_eps, hf.n_group, hf.topk_group) == (
        1e-5, 1, 1)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types) == ("dense",) * 3 + ("sparse",)
    with pytest.raises(ValueError, match="make layer 0 'full'"):
        glm.GlmMoeDsaConfig.from_hf({**BASE, "index_topk_pattern": "SFFF"})
    with pytest.raises(ValueError, match="index_topk_pattern 'FXSF'"):
        glm.GlmMoeDsaConfig.from_hf({**BASE, "index_topk_pattern": "FXSF"})
    with pytest.raises(ValueError, match="model_type"):
        glm.GlmMoeDsaConfig.from_hf({**BASE, "model_type": "deepseek_v32"})
    with pytest.raises(ValueError, match="indexer_types must give one of"):
        glm.GlmMoeDsaConfig.tiny(indexer_types=("full", "shared"))


# -- exactness against HF ------------------------------------------------------------------------------------------

LAYOUTS = [(1, 1, "balanced"), (2, 1, "balanced"), (2, 1, "contiguous"), (3, 1, "balanced"), (3, 1, "contiguous"),
           (1, 2, "balanced"), (1, 3, "balanced")]


@pytest.mark.slow
@pytest.mark.parametrize("pcp,dcp,split", LAYOUTS, ids=[f"pcp{p}-dcp{d}-{s}" for p, d, s in LAYOUTS])
def test_generate_matches_hf(pcp, dcp, split):
    """Full and shared layers under one device, DSA-CP prefill (2 and 3 ranks, both splits), DCP decode (2, 3)."""
    ref = reference("mixed")
    kw = {"dcp_merge": "a2a" if dcp == 3 else "ag_rs", "interleave_size": 2 if dcp == 3 else 1, "block_size": 4}
    gen = generate(glm, ref.params, ref.cfg, ref.prompts, NEW_TOKENS, pcp_size=pcp, dcp_size=dcp, dsa_split=split, **kw)
    assert gen.tokens.shape == (len(PROMPT_LENS), NEW_TOKENS)
    ref.check(gen)


@pytest.mark.slow
def test_every_other_layer_shared_matches_hf():
    """F, S, F, S (index_topk_freq): one device, then DSA-CP 2 (contiguous) with DCP 2."""
    ref = reference("freq")
    assert ref.cfg.indexer_types == ("full", "shared", "full", "shared")
    ref.check(generate(glm, ref.params, ref.cfg, ref.prompts, NEW_TOKENS))
    ref.check(generate(glm, ref.params, ref.cfg, ref.prompts, NEW_TOKENS, pcp_size=2, dcp_size=2,
                       dsa_split="contiguous", interleave_size=2))


@pytest.mark.slow
def test_pd_and_speculative_match_hf():
    """P/D (DSA-CP 2 prefill -> whole blocks -> DCP 2 decode) and speculative verification of 1 + 3 rows
    per request over DCP 2 (n-gram drafts, through a DecodeRunner)."""
    ref = reference("mixed")
    ref.check(disagg_generate(glm, ref.params, ref.cfg, ref.prompts, NEW_TOKENS, pcp_size=2, dcp_size=2))
    spec = speculative_generate(glm, ref.params, ref.cfg, ref.prompts, NEW_TOKENS, drafter=NgramDrafter(),
                                num_speculative_tokens=3, pcp_size=2, dcp_size=2, graph=True, capture_sizes=[4, 8])
    ref.check(spec)
    assert spec.stats.drafted == 3 * spec.stats.rows and spec.stats.graph_steps > 0


def test_selection_is_active_and_shared_layers_follow_it():
    """index_topk below the length changes the logits (the selection matters); with it at the length or above,
    GLM-5 equals DeepSeek-V3 dense MLA on the same weights (DESIGN.md §4.4's free check)."""
    from cpattn.models import deepseek_v3

    ref = reference("mixed")
    tokens, cu = torch.cat(ref.prompts), [0, PROMPT_LENS[0], sum(PROMPT_LENS)]
    sparse = forward_logits(glm, ref.params, ref.cfg, tokens, cu)
    dense_cfg = glm.GlmMoeDsaConfig(**{**ref.cfg.__dict__, "index_topk": 64})
    dense = forward_logits(glm, ref.params, dense_cfg, tokens, cu)
    assert rel_err(sparse, dense) > 1e-3
    v3_cfg = deepseek_v3.DeepseekV3Config(**{k: v for k, v in ref.cfg.__dict__.items()
                                            if not k.startswith("index")})
    assert rel_err(dense, forward_logits(deepseek_v3, ref.params, v3_cfg, tokens, cu)) <= 1e-5


@pytest.mark.parametrize("over", [{"rms_norm_eps": 0.05, "tie_word_embeddings": True}], ids=["large-eps-tied"])
def test_load_checkpoint(tmp_path, over):
    """save_pretrained -> load_checkpoint gives HF's logits; a large rms_norm_eps makes the latent norms'
    own 1e-6 matter."""
    hf = hf_model("mixed", seed=3, **over)
    hf.save_pretrained(tmp_path)
    config, params = load_checkpoint(tmp_path)
    cfg = glm.GlmMoeDsaConfig.from_hf(config)
    assert cfg == glm.GlmMoeDsaConfig.from_hf(hf.config)
    tokens = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]
    assert rel_err(forward_logits(glm, params, cfg, tokens, [0, 19]), want) <= 1e-4


# -- the selection API of every step, against a float64 oracle -------------------------------------------------------


def _layer_inputs(t: int, g: torch.Generator, h=4, d=12, hi=3, di=4):
    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    return {"q": r(t, h, d), "kv0": r(t, 1, d), "kv1": r(t, 1, d), "qi": r(t, hi, di), "wi": r(t, hi).abs(),
            "ki": r(t, di)}


LAYS = (KVLayout(1, 12, 8, values_in_keys=True, index_head_dim=4), KVLayout(1, 12, 8, values_in_keys=True))


def oracle(x, lens, topk, scale):
    """Layer 0 (full) and layer 1 (shared) on packed requests of ``lens`` tokens, plainly, in float64.

    Each query scores its visible keys with layer 0's indexer, keeps the topk best (score desc, position asc)
    and attends them in layer 0's and layer 1's latent rows alike.
    """
    outs = ([], [])
    at = 0
    for n in lens:
        for i in range(n):
            t = at + i
            keys = range(at, at + i + 1)
            s = [float((x["wi"][t] * (x["qi"][t] @ x["ki"][k]).relu()).sum()) for k in keys]
            chosen = topk_order(s, topk)
            for out, kv in zip(outs, (x["kv0"], x["kv1"])):
                lat = kv[[at + j for j in chosen], 0]  # [k, d]
                p = torch.softmax(x["q"][t] @ lat.T * scale, -1)  # [h, k]
                out.append(p @ lat[:, :8])
        at += n
    return torch.stack(outs[0]), torch.stack(outs[1])


def test_dense_step_selection_matches_float64_oracle():
    lens, g = [7, 3], torch.Generator().manual_seed(0)
    x = _layer_inputs(sum(lens), g)
    step = DenseKVCache.empty(LAYS, batch=2, max_len=8, dtype=torch.float64).step(lens)
    out0, sel = step.dsa(0, x["q"], x["kv0"], x["qi"], x["wi"], x["ki"], 3, 0.3, return_selection=True)
    out1 = step.dsa_shared(1, x["q"], x["kv1"], sel, 0.3)
    want0, want1 = oracle(x, lens, 3, 0.3)
    assert sel.shape == (10, 3) and int(sel[0, 1]) == -1  # request-local positions, -1 past the visible keys
    assert torch.allclose(out0, want0, atol=1e-12, rtol=0) and torch.allclose(out1, want1, atol=1e-12, rtol=0)


@pytest.mark.parametrize("size,split", [(2, "balanced"), (3, "contiguous")])
def test_dsa_cp_step_selection_matches_float64_oracle(size, split):
    """DSA-CP: each rank reuses the selection it computed on the full layer, over the replicated cache."""
    from cpattn import pcp_shard, pcp_unshard
    from cpattn.dsa import dsa_cp_plan
    from cpattn.engine.prefill_steps import DSACPStep

    lens, g = [7, 4], torch.Generator().manual_seed(1)
    x = _layer_inputs(sum(lens), g)
    plan = dsa_cp_plan([0, 7, 11], size, split=split)

    def rank(grp):
        m = {k: pcp_shard(v, plan, grp.rank) for k, v in x.items()}
        step = DSACPStep(grp, plan, LAYS)
        out0, sel = step.dsa(0, m["q"], m["kv0"], m["qi"], m["wi"], m["ki"], 3, 0.3, return_selection=True)
        before = grp.stats.total_sent()
        out1 = step.dsa_shared(1, m["q"], m["kv1"], sel, 0.3)
        return out0, out1, grp.stats.as_dict()["calls"], grp.stats.total_sent() - before

    res = cpattn.simulate(size, rank)
    want0, want1 = oracle(x, lens, 3, 0.3)
    assert torch.allclose(pcp_unshard([r[0] for r in res], plan), want0, atol=1e-12, rtol=0)
    assert torch.allclose(pcp_unshard([r[1] for r in res], plan), want1, atol=1e-12, rtol=0)
    # the shared layer gathers only latents: [max_tokens, 12] float64 per rank to each other rank
    assert all(r[3] == plan.max_tokens * 12 * 8 * (size - 1) for r in res)


@pytest.mark.parametrize("size,interleave_size,q_len", [(1, 1, 1), (2, 1, 3), (3, 2, 1), (2, 2, 2)])
def test_dcp_step_selection_matches_float64_oracle(size, interleave_size, q_len):
    """Key-sharded exact top-k: each rank keeps the selected keys in its shard; a shared layer exchanges only
    its partials. q_len > 1: verification rows (1 + k per request), each with its own causal limit."""
    lens, g = [9, 5], torch.Generator().manual_seed(2)
    x = _layer_inputs(sum(lens), g)
    cu = [0, 9, 14]
    rows = torch.cat([torch.arange(cu[b + 1] - q_len, cu[b + 1]) for b in range(2)])  # the last q_len of each

    def rank(grp):
        shard = PagedShard.empty(LAYS, capacity=lens, dcp_size=size, block_size=2, interleave_size=interleave_size,
                                 dtype=torch.float64)
        full = dcp_plan(lens, lens, shard.block_table, dcp_size=size, interleave_size=interleave_size, block_size=2)
        for layer, kv in ((0, x["kv0"]), (1, x["kv1"])):  # every key in its owner's shard first
            shard.write(layer, kv, None, full.slot_mapping[grp.rank], x["ki"] if layer == 0 else None)
        meta = dcp_plan(lens, [q_len] * 2, shard.block_table, dcp_size=size, interleave_size=interleave_size,
                        block_size=2)
        step = DCPStep(grp, shard, meta)
        m = {k: v[rows] for k, v in x.items()}
        grp.stats.reset()
        out0, sel = step.dsa(0, m["q"], m["kv0"], m["qi"], m["wi"], m["ki"], 3, 0.3, return_selection=True)
        full_bytes = grp.stats.total_sent()
        out1 = step.dsa_shared(1, m["q"], m["kv1"], sel, 0.3)
        return out0, out1, full_bytes, grp.stats.total_sent() - full_bytes, grp.stats.as_dict()["calls"]

    res = cpattn.simulate(size, rank)
    want0, want1 = oracle(x, lens, 3, 0.3)
    t = rows.numel()
    for out0, out1, full_b, shared_b, calls in res:
        assert torch.allclose(out0, want0[rows], atol=1e-12, rtol=0)
        assert torch.allclose(out1, want1[rows], atol=1e-12, rtol=0)
        partials = t * 4 * (8 + 1) * 8 * (size - 1)  # [T, H, Dv + 1] float64 to each other rank
        assert shared_b == partials and full_b == partials + t * 3 * (8 + 8) * (size - 1)  # + (score, id) pairs
        # candidates (none to exchange on one rank), full layer's partials, shared layer's partials
        assert calls == {"all_gather": 3 if size > 1 else 2}


# -- chunked prefill / cached prefix with shared layers --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pcp,dcp", [(2, 2), (3, 1)])
def test_prefill_from_a_cached_prefix(one_device, pcp, dcp):
    """Prefill only past each prompt's cached prefix (shared layers' prefix rows carry no indexer key), hand off,
    decode: the tokens and logits of conftest.py's ``one_device`` recompute (float64)."""
    cfg = glm.GlmMoeDsaConfig.tiny()
    params = glm.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    prompts, context = [list(range(1, 30)), [5, 6, 7, 8, 9, 10, 11], [3, 4]], (17, 3, 1)
    ref = one_device(glm.FAMILY, params, cfg, prompts, 8)  # a fresh one-device full prefill per token
    one = SimMesh(1).groups()[0]
    full = prefill(one, glm.FAMILY, params, cfg, Prompts.of(prompts))
    rows = gather_unshard(one, full.rows, full.plan)  # [T, F]
    assert rows.shape[1] == sum(lay.row_width for lay in glm.kv_layouts(cfg))
    cu = Prompts.of(prompts).cu_seqlens
    prefix = Prefix(torch.cat([rows[a:a + c] for a, c in zip(cu, context)]), context)
    pre, dec = driver.engine_configs(glm.FAMILY, cfg, pcp_size=pcp, dcp_size=dcp, interleave_size=2)
    for gen in cpattn.simulate(max(pcp, dcp), driver.generate_on_rank, glm.FAMILY, params, cfg, prompts, 8,
                               prefill=pre, decode=dec, prefix=prefix):
        assert torch.equal(gen.tokens, ref.tokens)
        assert gen.logits.dtype == ref.logits.dtype == torch.float64  # float32 would round 1 ulp apart
        assert torch.allclose(gen.logits, ref.logits, rtol=1e-9, atol=1e-9)


# -- KV bytes: shared layers keep no indexer keys ------------------------------------------------------------------


def test_shared_layers_keep_no_indexer_keys():
    """Per token and layer: latent + rope (+ indexer key on full layers), as HF's own cache holds them."""
    hf = hf_model("mixed")
    cfg = glm.GlmMoeDsaConfig.from_hf(hf.config)
    with torch.no_grad():
        cache = hf(torch.arange(5)[None], use_cache=True).cache
    per_layer = [sum(t.numel() * t.element_size() for t in (lay.keys, lay.values, lay.indexer_keys)
                     if t is not None) // 5 for lay in cache.layers]
    assert per_layer == [lay.row_width * 4 for lay in glm.kv_layouts(cfg)] == [224, 160, 160, 224]
    assert glm.kv_bytes_per_token(cfg, torch.float32) == {"full": 224, "shared": 160, "model": 768,
                                                          "model_if_all_full": 896}
    dense = DenseKVCache.empty(glm.kv_layouts(cfg), batch=1, max_len=4)
    paged = PagedShard.empty(glm.kv_layouts(cfg), capacity=[8], dcp_size=2, block_size=4, interleave_size=1)
    assert [k is None for k in dense.k_index] == [k is None for k in paged.k_index] == [False, True, True, False]
    # GLM-5's release sizes (512 latent + 64 rope, 128-dim indexer key, bf16): 1408 bytes full, 1152 shared
    real = glm.GlmMoeDsaConfig.from_hf(transformers.GlmMoeDsaConfig().to_dict())
    assert glm.kv_bytes_per_token(real)["full"] == 1408 and glm.kv_bytes_per_token(real)["shared"] == 1152


# -- graph mode --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm_moe_dsa", "deepseek_v32"])
def test_decode_step_is_capturable_on_one_rank(name):
    """check_static (aot_eager, fullgraph, no recompile across contents): the DCP DSA step (GLM-5's full and
    shared layers; DeepSeek-V3.2's) has static shapes and no host sync; a padding request."""
    from cpattn.models import deepseek_v32

    if name == "glm_moe_dsa":
        family, cfg = glm.FAMILY, glm.GlmMoeDsaConfig.tiny(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                           mlp_layer_types=("dense", "sparse"))
    else:
        family, cfg = deepseek_v32.FAMILY, deepseek_v32.DeepseekV32Config.tiny()
    assert family.capturable
    params = family.init_params(cfg, seed=1, std=0.2)
    shard = PagedShard.empty(family.kv_layouts(cfg), capacity=[12] * 3, dcp_size=1, block_size=4, interleave_size=1)
    step = functools.partial(decode_step, family=family, cfg=cfg, group=SimMesh(1).groups()[0], merge="ag_rs")
    gen = torch.Generator().manual_seed(2)

    def batch(lens):
        return {"tokens": torch.randint(0, cfg.vocab_size, (3,), generator=gen), "seq_lens": torch.tensor(lens),
                "block_table": shard.block_table.clone(), "cu_seqlens_q": torch.arange(4, dtype=torch.int32)}

    state = {"params": params, "shard": shard}
    for s in range(1, 9):
        step(state, batch([s] * 3))
    torch._dynamo.reset()
    outs = check_static(step, state, [batch([9, 5, 7]), batch([3, 9, 1]), batch([9, 0, 2])], atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert all(torch.isfinite(o[0][[0, 2]]).all() for o in outs)


@pytest.mark.slow
def test_decode_steps_captured_on_gloo_ranks():
    """2 gloo ranks, DCP 2: GLM-5's decode step compiled (aot_eager, fullgraph) per capture size (2, 4) over gloo
    collectives; 1..4 requests (1 and 3 padded) replay a graph and equal the eager step. (Qwen3-MoE's step:
    captured on one rank in test_moe.py; any program over gloo collectives: test_graphs.py.)"""
    from glm5_gloo_cases import capture_many

    for name, per_rank in zip(("glm_moe_dsa",), zip(*spawn(2, capture_many, ["glm_moe_dsa"]))):
        for res in per_rank:
            assert [path for _, _, path, _, _, _ in res] == ["graph:2", "graph:2", "graph:4", "graph:4"], name
            for g_logits, e_logits, _, g_arg, e_arg, _ in res:  # float32, padded rows: up to a counted near tie
                check_choices(g_arg, g_logits, e_arg, e_logits, f"{name} graph vs eager, {len(g_arg)} requests", FLIPS,
                              rel=1e-5)
        assert torch.equal(per_rank[0][0][0], per_rank[1][0][0])  # every rank holds the same logits


def test_near_tie_flips_stay_rare():
    """Runs last in this file: of every layout compared above, at most one may end in a near-tie flip."""
    assert len(FLIPS) <= 1, FLIPS
