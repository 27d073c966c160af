"""Drafters read what a family declares (``ModelFamily.draft_target``), not config types.

The oracle is the config sniffing the drafters did before the declaration (kept here, test-only): every
family's declared target must give the same draft shapes, sizes and MTP layer N.
"""

import dataclasses
import importlib

import pytest

from cpattn.drafters import mtp, qwen3_next_mtp
from cpattn.drafters.dspark import DSparkConfig, target_sizes
from cpattn.drafters.eagle3 import Eagle3Config, attention_shape
from cpattn.models.draft_target import DraftTarget, target_of
from cpattn.models.family import FAMILY_MODULES, family_of_config, get_family


def sniffed(cfg) -> dict:
    """What the drafters read before families declared it: attribute and type sniffing (the reference)."""
    from cpattn.models.deepseek_v4 import DeepseekV4Config

    heads = cfg.num_attention_heads
    if isinstance(getattr(cfg, "num_key_value_heads", None), int) and isinstance(getattr(cfg, "head_dim", None), int):
        shape = (heads, cfg.num_key_value_heads, cfg.head_dim)
    else:
        shape = (heads, max(1, heads // 2), cfg.hidden_size // heads)
    if isinstance(cfg, DeepseekV4Config):
        sizes = (cfg.hc_mult * cfg.hidden_size, cfg.moe_intermediate_size, dict(cfg.rope_main))
    else:
        sizes = (cfg.hidden_size, cfg.intermediate_size, dict(cfg.rope))
    return {"shape": shape, "row": sizes[0], "intermediate": sizes[1], "rope": sizes[2]}


def sniffed_mtp_block(cfg):
    """MTP layer N as the two drafters appended it before (DeepSeek-format, then Qwen3-Next)."""
    if hasattr(cfg, "layer_types") and hasattr(cfg, "num_experts"):
        kind = "sparse" if cfg.num_experts else "dense"
        return dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1,
                                   layer_types=(*cfg.layer_types, "full_attention"),
                                   mlp_layer_types=(*cfg.mlp_layer_types, kind))
    kind = "sparse" if cfg.n_routed_experts else "dense"
    extra = {"mlp_layer_types": (*cfg.mlp_layer_types, kind), "num_hidden_layers": cfg.num_hidden_layers + 1}
    if hasattr(cfg, "indexer_types"):
        extra["indexer_types"] = (*cfg.indexer_types, "full")
    return dataclasses.replace(cfg, **extra)


def configs():
    """Each family's tiny config, and one without experts where the family has a switch for it."""
    out = []
    for name, module in FAMILY_MODULES.items():
        cls = importlib.import_module(module).FAMILY.config_class
        out.append((name, cls.tiny()))
        for over in ({"n_routed_experts": 0}, {"num_experts": 0}):
            try:
                out.append((name, cls.tiny(**over)))
            except TypeError:
                pass
    return out


CONFIGS = configs()
MTP_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_declared_target_equals_the_sniffed_one(name, cfg):
    fam = get_family(name)
    assert fam.draft_target is not None and get_family(cfg) is fam
    t = target_of(cfg)
    want = sniffed(cfg)
    assert isinstance(t, DraftTarget)
    assert (t.attention_shape, t.row_width, t.intermediate_size, t.rope) == (
        want["shape"], want["row"], want["intermediate"], want["rope"])
    assert attention_shape(cfg) == want["shape"]
    assert target_sizes(cfg) == {"target_hidden_size": want["row"], "intermediate_size": want["intermediate"],
                                 "rope": want["rope"], "max_position_embeddings": cfg.max_position_embeddings,
                                 "rms_norm_eps": cfg.rms_norm_eps}
    d = DSparkConfig.for_target(cfg, block_size=4, mask_token_id=3)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == want["shape"]
    assert d.feature_size == len(d.target_layer_ids) * want["row"]
    if want["row"] == cfg.hidden_size:
        e = Eagle3Config.for_target(cfg, draft_vocab=8)
        assert (e.num_attention_heads, e.num_key_value_heads, e.head_dim, e.intermediate_size, e.rope) == (
            *want["shape"], want["intermediate"], want["rope"])
    else:  # V4's streams: Eagle3 fuses [H] rows, so it refuses in one line naming DSpark
        with pytest.raises(ValueError, match="DSpark"):
            Eagle3Config.for_target(cfg)
    if name in MTP_FAMILIES:
        block = sniffed_mtp_block(cfg)
        assert mtp.block_config(cfg) == block and qwen3_next_mtp.block_config(cfg) == block
    else:
        with pytest.raises(ValueError, match="declares no MTP layer"):
            mtp.block_config(cfg)


def test_family_of_config_walks_the_mro_and_refuses_strangers():
    from cpattn.models.deepseek_v3 import DeepseekV3Config
    from cpattn.models.glm_moe_dsa import GlmMoeDsaConfig

    @dataclasses.dataclass(frozen=True)
    class Mine(GlmMoeDsaConfig):
        pass

    assert family_of_config(GlmMoeDsaConfig.tiny()).name == "glm_moe_dsa"  # not its parents' families
    assert family_of_config(DeepseekV3Config.tiny()).name == "deepseek_v3"
    base = dataclasses.asdict(GlmMoeDsaConfig.tiny())
    assert family_of_config(Mine(**base)).name == "glm_moe_dsa"
    with pytest.raises(ValueError, match="is no family's config"):
        family_of_config(object())
    with pytest.raises(ValueError, match="is no family's config"):
        target_of(3.0)


def test_a_family_without_a_draft_target_is_refused():
    fam = dataclasses.replace(get_family("qwen3"), draft_target=None)
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen3, "FAMILY", fam)
        with pytest.raises(ValueError, match="declares no draft_target"):
            target_of(cfg)
