"""Model shapes read through the model families' own ``from_hf`` (no third ``config.json`` parser).

A built-in entry here is the release's published ``config.json`` fields (the
dict below); :func:`spec_from_family` hands it, or a user's ``config.json``, to
the family's configuration class (``cpattn.models.<family>...from_hf``, the
same check the engine loads checkpoints with) and turns that config into a
:class:`~cpattn.plan.specs.ModelSpec`. The family modules import torch, so
this module imports them only when a family entry is asked for.

Families read this way: Qwen3, Qwen3-MoE, DeepSeek-V2 / V3 (and Kimi-K2,
``kimi_k2``: the V3 architecture), V3.2, GLM-5 (``glm_moe_dsa``) and
DeepSeek-V4; every built-in entry but the dense Llama3-405B anchor (no
cpattn family; a literal in :mod:`cpattn.plan.specs`) is one of them. Each
release's fields below are those of its Hugging Face ``config.json`` that
shapes depend on.

DeepSeek-V4-Flash's fields: the Hugging Face ``deepseek-ai/DeepSeek-V4-Flash``
``config.json`` (as mirrored in alibaba/rtp-llm's V4 config test, "as
published on HF"): 43 layers, hidden 4096, 64 query heads of 512 on one K = V
head, q LoRA 1024, grouped output (8 groups, LoRA 1024), sliding window 128,
``compress_ratios`` 0, 0, then CSA (4) / HCA (128) alternating, indexer 64 x
128 with top-512, 256 routed experts (top-6) of 2048 plus one shared expert,
hyper-connections x 4. Weights: fp8 (the Instruct release ships FP4 routed
experts and FP8 attention / dense weights; ``--weights`` overrides).

Example
-------
>>> m = spec_from_family("deepseek-v4-flash")
>>> m.attention, m.layers, m.layer_kinds.count("csa"), m.layer_kinds.count("hca"), m.window
('v4', 43, 21, 20, 128)
>>> round(m.total_params() / 1e9), round(m.active_params_per_token() / 1e9)  # the release: 284B, 13B active
(284, 13)
"""

from __future__ import annotations

from typing import Any

_V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers and the MTP layer's placeholder
DEEPSEEK_V4_FLASH = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": _V4_FLASH_RATIOS, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "vocab_size": 129280,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}
_V3_TRUNK = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_theta": 10000,
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
}
DEEPSEEK_R1 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **_V3_TRUNK}
DEEPSEEK_V32 = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], **_V3_TRUNK,
                "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}
KIMI_K2 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **_V3_TRUNK,  # kimi_k2 in its file
           "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
           "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
           "max_position_embeddings": 131072}
GLM_5 = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880,
         "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
         "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
         "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
         "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "index_topk": 2048,
         "index_n_heads": 32, "index_head_dim": 128, "max_position_embeddings": 202752}
QWEN3_235B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
              "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
              "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
              "tie_word_embeddings": False}
# name -> (label, published config.json fields, weight dtype, where the fields come from)
FAMILY_BUILTINS = {
    "deepseek-v3.2": ("DeepSeek-V3.2", DEEPSEEK_V32, "fp8", "deepseek-ai/DeepSeek-V3.2-Exp config.json (fp8 weights)"),
    "deepseek-r1": ("DeepSeek-R1", DEEPSEEK_R1, "fp8",
                    "deepseek-ai/DeepSeek-R1 config.json (the V3 architecture, fp8 weights)"),
    "glm-5": ("GLM-5", GLM_5, "bf16", "zai-org GLM-5 config.json (glm_moe_dsa; every layer counted with its own "
              "indexer)"),
    "qwen3-235b-a22b": ("Qwen3-235B-A22B", QWEN3_235B, "bf16", "Qwen/Qwen3-235B-A22B config.json"),
    "kimi-k2": ("Kimi-K2", KIMI_K2, "fp8", "moonshotai/Kimi-K2-Instruct config.json (the DeepSeek-V3 "
                "architecture; model_type kimi_k2; fp8 weights)"),
    "deepseek-v4-flash": ("DeepSeek-V4-Flash", DEEPSEEK_V4_FLASH, "fp8", "deepseek-ai/DeepSeek-V4-Flash config.json "
                          "(fp8 weights)"),
}
ALIASES = {"kimi_k2": "deepseek_v3"}  # model_type values of checkpoints a family here reads
FAMILY_TYPES = ("qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4",
                *ALIASES)  # config.json model_type values read through a family


def _config_class(kind: str):
    """The family's configuration class for a ``model_type`` (V4's without importing its model module)."""
    if kind == "deepseek_v4":
        from cpattn.models.deepseek_v4_config import DeepseekV4Config

        return DeepseekV4Config
    from cpattn.models.family import get_family

    return get_family(kind).config_class


def _mlp_fields(types, experts: int, per_token: int, moe: int, shared: int, dense: int) -> dict:
    """ModelSpec's MLP fields from a family's per-layer ``"dense"`` / ``"sparse"`` list (the dense ones lead)."""
    lead = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    return dict(dense_layers=lead if experts else len(types), experts=experts, experts_per_token=per_token,
                moe_intermediate=moe, shared_experts=shared, intermediate=dense if "dense" in types else 0)


def spec_from_config(cfg, *, name: str, weights: str, kv_dtype: str = "bf16", source: str = ""):
    """A :class:`~cpattn.plan.specs.ModelSpec` from a family's configuration object (Qwen3, Qwen3-MoE,
    DeepSeek-V2/V3/V3.2, GLM-5; V4: :func:`spec_from_v4`)."""
    from cpattn.plan.specs import ModelSpec

    common = dict(name=name, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                  heads=cfg.num_attention_heads, weights=weights, kv_dtype=kv_dtype, source=source)
    if hasattr(cfg, "num_key_value_heads"):  # Qwen3 / Qwen3-MoE: GQA
        moe = _mlp_fields(getattr(cfg, "mlp_layer_types", ("dense",) * cfg.num_hidden_layers),
                          getattr(cfg, "num_experts", 0), getattr(cfg, "num_experts_per_tok", 0),
                          getattr(cfg, "moe_intermediate_size", 0), 0, cfg.intermediate_size)
        return ModelSpec(attention="gqa", kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, **common, **moe)
    dsa = hasattr(cfg, "index_topk")
    moe = _mlp_fields(cfg.mlp_layer_types, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.n_shared_experts, cfg.intermediate_size)
    return ModelSpec(attention="dsa" if dsa else "mla", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                     qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                     v_head_dim=cfg.v_head_dim, index_heads=cfg.index_n_heads if dsa else 0,
                     index_dim=cfg.index_head_dim if dsa else 0, index_topk=cfg.index_topk if dsa else 0,
                     **common, **moe)


def spec_from_v4(cfg, *, name: str, weights: str = "fp8", kv_dtype: str = "fp8", source: str = ""):
    """A :class:`~cpattn.plan.specs.ModelSpec` from a :class:`~cpattn.models.deepseek_v4_config.DeepseekV4Config`
    (every layer a MoE layer with one shared expert, as the family builds it)."""
    from cpattn.plan.specs import ModelSpec

    rope = cfg.qk_rope_head_dim
    return ModelSpec(
        name=name, attention="v4", layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
        heads=cfg.num_attention_heads, kv_heads=1, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.head_dim - rope, qk_nope_head_dim=cfg.head_dim - rope, qk_rope_head_dim=rope,
        v_head_dim=cfg.head_dim, index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, moe_intermediate=cfg.moe_intermediate_size, experts=cfg.n_routed_experts,
        experts_per_token=cfg.num_experts_per_tok, shared_experts=1, dense_layers=0, weights=weights,
        kv_dtype=kv_dtype, source=source, layer_kinds=tuple(cfg.layer_types), window=cfg.sliding_window,
        csa_ratio=cfg.csa_ratio, hca_ratio=cfg.hca_ratio, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        hc_mult=cfg.hc_mult)


def spec_from_family(name_or_config: str | dict[str, Any], *, name: str | None = None, weights: str | None = None,
                     kv_dtype: str | None = None):
    """A built-in entry (:data:`FAMILY_BUILTINS`) or a ``config.json`` dict whose ``model_type`` is in
    :data:`FAMILY_TYPES`, read by the family's own ``from_hf`` (its checks raise a one-line ``ValueError`` naming
    the field). Weights: the entry's (or, for a file, its ``quantization_config``: fp8, NVFP4, int4; else bf16);
    KV: fp8 for V4, else bf16, unless given."""
    if isinstance(name_or_config, str):
        label, config, default_weights, source = FAMILY_BUILTINS[name_or_config]
    else:
        config = name_or_config.get("text_config", name_or_config)
        q = config.get("quantization_config") or {}
        default_weights = {"fp8": "fp8", "NVFP4": "nvfp4", "compressed-tensors": "int4"}.get(
            str(q.get("quant_method") or q.get("quant_algo")), "bf16")
        label = config.get("_name_or_path") or config.get("model_type", "model")
        source = f"config.json ({config.get('model_type')}, read by the family's from_hf)"
    kind = config.get("model_type")
    if kind not in FAMILY_TYPES:
        raise ValueError(f"model_type is {kind!r}; the planner reads {', '.join(FAMILY_TYPES)} through its family")
    kind = ALIASES.get(kind, kind)
    cfg = _config_class(kind).from_hf({**config, "model_type": kind})
    if kind == "deepseek_v4":
        return spec_from_v4(cfg, name=name or label, weights=weights or default_weights, kv_dtype=kv_dtype or "fp8",
                            source=source)
    return spec_from_config(cfg, name=name or label, weights=weights or default_weights, kv_dtype=kv_dtype or "bf16",
                            source=source)
