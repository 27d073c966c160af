"""DeepSeek-V4 checkpoint names -> the Hugging Face module names the model reads.

DeepSeek's released V4 checkpoints (and ``save_pretrained`` of the
transformers port, which writes the original layout back) name tensors
after the reference code: ``layers.3.attn.wq_a.weight``, ``attn.indexer.
compressor.wkv``, ``ffn.experts.7.w1.weight``, ``hc_attn_fn`` ... The
transformers port renames them on load; these are the same renames (facts
about the format, listed in the order they apply), so
:func:`cpattn.models.load_checkpoint` reads either spelling (the family
declares :func:`param_name` as its ``rename``).

Example
-------
>>> hf_name("layers.1.attn.indexer.compressor.wkv.weight")
'model.layers.1.self_attn.compressor.indexer.kv_proj.weight'
>>> hf_name("model.layers.0.ffn.experts.3.w1.weight"), hf_name("head.weight")
('model.layers.0.mlp.experts.3.gate_proj.weight', 'lm_head.weight')
>>> param_name("mtp.0.attn.wq_a.weight") is None
True
"""

from __future__ import annotations

import re

# (pattern, replacement), applied in order to a name without its "model." prefix
RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    # routed experts: w1 = gate, w3 = up, w2 = down (stacked later by normalize_params)
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."), (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
]


def hf_name(name: str) -> str:
    """The Hugging Face name of a V4 checkpoint tensor (already-HF names come back unchanged)."""
    bare = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in RENAMES:
        bare = re.sub(pattern, repl, bare)
    return bare if bare.startswith("lm_head.") else "model." + bare


def param_name(name: str) -> str | None:
    """The params name of a V4 checkpoint tensor, or None for the multi-token-prediction layers (not used)."""
    if name.startswith("mtp.") or ".mtp." in name:
        return None
    return hf_name(name)
