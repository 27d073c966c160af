"""The planner reads model shapes through the families' own from_hf (issue 28 point 2): every built-in but the
dense Llama anchor, and every config.json of a family's model_type, with the family's checks."""

import json

import pytest

from cpattn.plan.families import FAMILY_BUILTINS, _config_class, spec_from_config
from cpattn.plan.specs import BUILTINS, get_model


@pytest.mark.parametrize("name", sorted(FAMILY_BUILTINS))
def test_builtins_are_the_family_configs_read_by_from_hf(name, monkeypatch):
    label, config, weights, _ = FAMILY_BUILTINS[name]
    kind = {"kimi-k2": "deepseek_v3"}.get(name, config["model_type"])
    cls = _config_class(kind)
    seen = []
    original = cls.from_hf.__func__
    monkeypatch.setattr(cls, "from_hf", classmethod(lambda c, d: seen.append(d) or original(c, d)))
    spec = get_model(name)
    assert len(seen) == 1 and seen[0]["num_hidden_layers"] == spec.layers and spec.name == label
    assert spec.weights == weights and name not in BUILTINS


def test_a_config_json_of_each_family_goes_through_its_checks(tmp_path):
    base = {"num_hidden_layers": 3, "hidden_size": 64, "vocab_size": 50, "num_attention_heads": 4,
            "q_lora_rank": 16, "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "intermediate_size": 32,
            "first_k_dense_replace": 1, "n_shared_experts": 1, "index_topk": 8, "index_n_heads": 2,
            "index_head_dim": 16}
    path = tmp_path / "config.json"
    kinds = (("deepseek_v3", "mla"), ("kimi_k2", "mla"), ("deepseek_v32", "dsa"), ("glm_moe_dsa", "dsa"))
    for kind, attention in kinds:
        path.write_text(json.dumps({**base, "model_type": kind}))
        spec = get_model(str(path))
        assert spec.attention == attention and (spec.dense_layers, spec.experts, spec.shared_experts) == (1, 4, 1)
        path.write_text(json.dumps({**base, "model_type": kind, "qk_rope_head_dim": 3}))
        with pytest.raises(ValueError, match="qk_rope_head_dim.*even"):  # the family's check (the old parser took it)
            get_model(str(path))
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 50,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]}
    path.write_text(json.dumps(qwen))
    spec = get_model(str(path))
    assert (spec.attention, spec.kv_heads, spec.dense_layers, spec.intermediate) == ("gqa", 2, 1, 96)
    path.write_text(json.dumps({**qwen, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        get_model(str(path))


def test_mlp_fields_follow_the_family_layer_types():
    from cpattn.models.qwen3_moe import Qwen3MoeConfig

    cfg = Qwen3MoeConfig.from_hf({"model_type": "qwen3_moe", "num_hidden_layers": 3, "hidden_size": 8,
                                  "vocab_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "head_dim": 4, "intermediate_size": 16, "moe_intermediate_size": 4,
                                  "num_experts": 4, "num_experts_per_tok": 2})
    spec = spec_from_config(cfg, name="t", weights="bf16")
    assert spec.dense_layers == 0 and spec.intermediate == 0  # no dense layer: its width is not a cost
    assert [spec.mlp_params(i)[1] for i in range(3)] == [4 * 3 * 8 * 4] * 3
