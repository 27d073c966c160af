"""Every family ``cpattn.models.load_checkpoint`` lists loads from transformers' own ``save_pretrained``.

For each ``model_type`` in ``FAMILY_MODULES``: a tiny seeded HF model (norms
and biases perturbed, so every weight matters) is saved with
``save_pretrained`` -- the names each family's checkpoints really carry
(per-expert MoE weights; DeepSeek-V4 in DeepSeek's original names,
``layers.0.attn.wq_a`` / ``hc_attn_fn`` ...) -- and loaded back through the
one loader the CLI and the API share. Its prompt logits equal HF's within
1e-4 relative (fp32, the suite's whole-model bound). DeepSeek-V4 also loads
from HF-named tensors (a state dict saved as is).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import forward_logits, perturbed, perturbed_v4, rel_err  # noqa: E402

from cpattn.engine.family import FAMILY_MODULES, get_family  # noqa: E402
from cpattn.models import load_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PROMPT = 64, 13
BASE = dict(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)
MLA = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
           q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=16,
           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
           first_k_dense_replace=1, max_position_embeddings=64)
DSA = dict(index_topk=6, index_n_heads=16, index_head_dim=8)  # top-6 of 13 keys: the selection is active

QWEN35_TEXT = dict(**BASE, hidden_size=32, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                   layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_num_key_heads=1, linear_num_value_heads=2)
QWEN35_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                     spatial_merge_size=2, temporal_patch_size=2)

# model_type -> (HF model class, HF config); tiny, and each stresses what its loader must get right
HF = {
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        **BASE, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        **BASE, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "deepseek_v2": ("DeepseekV2ForCausalLM", lambda: transformers.DeepseekV2Config(
        **BASE, **MLA, topk_method="group_limited_greedy", routed_scaling_factor=2.0)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config(**BASE, **MLA)),
    "deepseek_v32": ("DeepseekV32ForCausalLM", lambda: transformers.DeepseekV32Config(**BASE, **MLA, **DSA)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", lambda: transformers.GlmMoeDsaConfig(
        **{**BASE, "num_hidden_layers": 3}, **MLA, **DSA, index_topk_pattern="FSF")),
    "deepseek_v4": ("DeepseekV4ForCausalLM", lambda: transformers.DeepseekV4Config(
        **{**BASE, "num_hidden_layers": 3}, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
        head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=4,
        o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=12, index_topk=2, hc_mult=2,
        max_position_embeddings=64)),
    "qwen3_next": ("Qwen3NextForCausalLM", lambda: transformers.Qwen3NextConfig(
        **BASE, hidden_size=32, intermediate_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    # the Hub's composite forms: nested text_config, model.language_model.* weights, a vision tower (ignored)
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", lambda: transformers.Qwen3_5Config(
        text_config=dict(QWEN35_TEXT, intermediate_size=48), vision_config=QWEN35_VISION)),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", lambda: transformers.Qwen3_5MoeConfig(
        text_config=dict(QWEN35_TEXT, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2), vision_config=QWEN35_VISION)),
}


def hf_model(model_type: str, seed: int = 0):
    """A tiny seeded HF model of ``model_type``, eager, with norms / biases / sinks perturbed off their init."""
    cls, config = HF[model_type]
    if model_type != "deepseek_v4":
        return perturbed(getattr(transformers, cls), config(), seed)
    return perturbed_v4(config(), seed)


def our_logits(model_type: str, params: dict, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """Prompt logits [T, V] of one request on one device."""
    family = get_family(model_type)
    if family.cache == "hybrid":  # a hybrid forward also takes the linear layers' step
        from cpattn.engine.dense_cache import DenseKVCache

        n = tokens.numel()
        attn = DenseKVCache.empty(family.kv_layouts(cfg), batch=1, max_len=n).step([n])
        return family.forward(params, cfg, tokens, attn, family.recurrent_cache(cfg, batch=1).step([n]))
    if model_type != "deepseek_v4":
        import importlib

        return forward_logits(importlib.import_module(FAMILY_MODULES[model_type]), params, cfg, tokens,
                              [0, tokens.numel()])
    from cpattn.models import deepseek_v4 as v4
    from cpattn.v4.step import V4Step

    step = V4Step(v4.empty_cache(cfg, batch=1, max_len=32), [tokens.numel()])
    return family.forward(params, cfg, tokens, step)


def test_every_listed_family_has_a_case():
    assert sorted(HF) == sorted(FAMILY_MODULES)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAMILY_MODULES))
def test_save_pretrained_loads_with_hf_logits(tmp_path, model_type):
    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path)
    config, params = load_checkpoint(tmp_path)
    family = get_family(config)
    assert family.name == model_type
    cfg = family.config_class.from_hf(config)
    tokens = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]
        got = our_logits(model_type, params, cfg, tokens)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4, f"{model_type}: logits off by {rel_err(got, want):.2e}"


@pytest.mark.slow
def test_deepseek_v4_loads_both_spellings_alike(tmp_path):
    """DeepSeek's original names (save_pretrained) and HF's module names (a raw state dict) load to the
    same params; a bf16 load keeps the reference's float32 tensors float32 (the family's dtype rule)."""
    from safetensors.torch import save_file

    hf = hf_model("deepseek_v4")
    hf.save_pretrained(tmp_path / "original")
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "original" / "config.json").read_text())
    _, a = load_checkpoint(tmp_path / "original")
    _, b = load_checkpoint(tmp_path / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, low = load_checkpoint(tmp_path / "original", dtype=torch.bfloat16)
    assert low["model.layers.0.attn_hc.fn"].dtype == torch.float32
    assert low["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert low["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
