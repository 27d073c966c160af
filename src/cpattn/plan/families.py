"""Model shapes read through the model families' own ``from_hf`` (no third ``config.json`` parser).

A built-in entry here is the release's published ``config.json`` fields (the
dict below); :func:`spec_from_family` hands it, or a user's ``config.json``, to
the family's configuration class (``cpattn.models.<family>...from_hf``, the
same check the engine loads checkpoints with) and turns that config into a
:class:`~cpattn.plan.specs.ModelSpec`. The family modules import torch, so
this module imports them only when a family entry is asked for.

Families read this way: DeepSeek-V4 (``model_type`` ``deepseek_v4``).

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
# name -> (published config.json fields, weight dtype, where the fields come from)
FAMILY_BUILTINS = {
    "deepseek-v4-flash": (DEEPSEEK_V4_FLASH, "fp8", "deepseek-ai/DeepSeek-V4-Flash config.json, read by "
                          "cpattn.models.deepseek_v4_config.DeepseekV4Config.from_hf (fp8 weights)"),
}
FAMILY_TYPES = ("deepseek_v4",)  # config.json model_type values read through a family here


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
    """A built-in family entry (:data:`FAMILY_BUILTINS`) or a ``config.json`` dict whose ``model_type`` is in
    :data:`FAMILY_TYPES`, read by the family's ``from_hf`` (its checks raise a one-line ``ValueError`` naming
    the field)."""
    if isinstance(name_or_config, str):
        config, default_weights, source = FAMILY_BUILTINS[name_or_config]
        label = name or {"deepseek-v4-flash": "DeepSeek-V4-Flash"}.get(name_or_config, name_or_config)
    else:
        config, default_weights, source = name_or_config, "fp8", "config.json (DeepseekV4Config.from_hf)"
        label = name or config.get("_name_or_path") or config.get("model_type", "model")
    kind = config.get("model_type")
    if kind != "deepseek_v4":
        raise ValueError(f"model_type is {kind!r}; the planner reads {', '.join(FAMILY_TYPES)} through its family")
    from cpattn.models.deepseek_v4_config import DeepseekV4Config

    return spec_from_v4(DeepseekV4Config.from_hf(dict(config)), name=label, weights=weights or default_weights,
                        kv_dtype=kv_dtype or "fp8", source=source)
