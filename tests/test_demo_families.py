"""The main job on a saved checkpoint of every family: ``cpattn demo --model DIR`` runs to the end with tokens checked.

For each family a tiny seeded Hugging Face model is written with
``save_pretrained`` (config.json + safetensors); the demo loads it like any
checkpoint, prefills with PCP (DSA-CP for DSA models) on gloo ranks, hands
the KV to DCP decode ranks and checks every decoded token against its own
single-device run (exit 0, ``tokens_match``). The single-device tokens are
also compared here with the checkpoint's own HF ``generate(do_sample=False)``
on the demo's prompts, so the checkpoint path (config.json parsing, weight
names) is checked against the model that wrote it. GLM-5's decode step is
compiled (aot_eager, FULL_DECODE_ONLY) and must replay every step; the others
decode eagerly (one gloo spawn each keeps the file quick).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpattn.bench import demo  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 96
TINY = ["--prompt-len", "24", "--batch", "2", "--max-new-tokens", "4", "--block-size", "4", "--reps", "1",
        "--no-progress"]
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
              pad_token_id=None, max_position_embeddings=64)
MLA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)
DSA = dict(index_topk=8, index_head_dim=16, index_n_heads=32)

FAMILIES = {  # model_type: (HF class, config, demo flags)
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        **COMMON, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        ["--pcp", "1", "--dcp", "1", "--graph-mode", "none"]),  # PCP/DCP: test_demo.py's embedded Qwen3
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        **COMMON, hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        ["--pcp", "1", "--dcp", "2", "--graph-mode", "none"]),
    "deepseek_v2": ("DeepseekV2ForCausalLM", lambda: transformers.DeepseekV2Config(
        **COMMON, **{**MLA, "q_lora_rank": None}, topk_method="greedy"),
        ["--pcp", "2", "--dcp", "1", "--graph-mode", "none"]),
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config(
        **COMMON, **MLA, num_key_value_heads=4, n_group=2, topk_group=1),
        ["--pcp", "2", "--dcp", "2", "--graph-mode", "none", "--merge", "a2a"]),
    "deepseek_v32": ("DeepseekV32ForCausalLM", lambda: transformers.DeepseekV32Config(
        **COMMON, **MLA, **DSA, num_key_value_heads=4, n_group=2, topk_group=1),
        ["--pcp", "2", "--dcp", "2", "--graph-mode", "none"]),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", lambda: transformers.GlmMoeDsaConfig(
        **{**COMMON, "num_hidden_layers": 3}, **MLA, **DSA, num_key_value_heads=4, index_topk_pattern="FSF"),
        ["--pcp", "2", "--dcp", "2", "--backend", "aot_eager", "--no-eager-row"]),
}


def hf_tokens(hf, spec: demo.Spec) -> list[list[int]]:
    """HF greedy tokens for the demo's prompts (the first token comes from the prefill, as in the demo)."""
    tokens, cu = demo.prompts(spec, VOCAB)
    out = []
    with torch.no_grad():
        for a, b in zip(cu, cu[1:]):
            p = tokens[a:b][None]
            seq = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=spec.max_new_tokens,
                              do_sample=False, pad_token_id=0)
            out.append(seq[0, p.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_demo_runs_a_saved_checkpoint(tmp_path, name):
    cls, config, flags = FAMILIES[name]
    torch.manual_seed(0)
    config = config()
    config._attn_implementation = "eager"
    hf = getattr(transformers, cls)(config).eval()
    ckpt = tmp_path / name
    hf.save_pretrained(ckpt)
    path = tmp_path / "demo.json"
    code = demo.main(["--model", str(ckpt), *TINY, *flags, "--json", str(path)])
    out = json.loads(path.read_text())
    assert code == 0 and out["tokens_match"] is True, out["checks"]
    assert out["model"] == name and out["config"]["num_hidden_layers"] == config.num_hidden_layers
    assert all(c["equal_tokens"] == c["total_tokens"] == 8 for c in out["checks"].values())
    spec = demo.Spec(model_dir=str(ckpt), prompt_len=24, batch=2, max_new_tokens=4)
    assert out["reference_tokens"] == hf_tokens(hf, spec)
    if "--graph-mode" not in flags:  # GLM-5: the whole decode step compiled and replayed for every step
        assert out["whole_step_captured"] is True and out["graph"]["all_steps_replayed"] is True
        assert out["graph"]["backend"] == "aot_eager"
