"""The training lab (cpattn.lab) stands outside the runtime; its old paths still import, with a warning;
each family config writes its own config.json (``to_hf``) and reads it back (``from_hf``)."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest
import torch

MOVED = ("train", "objectives", "sequence", "corpus", "target", "report", "progress")

RUNTIME = ("cpattn", "cpattn.engine", "cpattn.drafters", "cpattn.serve", "cpattn.engine.drafters",
           "cpattn.drafters.mtp", "cpattn.drafters.eagle3", "cpattn.drafters.dspark", "cpattn.drafters.ngram",
           "cpattn.drafters.draft_model", "cpattn.drafters.chain", "cpattn.drafters.cache",
           "cpattn.drafters.checkpoint", "cpattn.cli")


@pytest.mark.slow  # a fresh interpreter imports the runtime (seconds), as test_import_order
def test_the_runtime_never_imports_the_lab():
    """Importing the runtime (engine, drafters, server, CLI) loads no module of the lab, by either path."""
    lab = [f"cpattn.lab.{m}" for m in MOVED] + [f"cpattn.drafters.{m}" for m in MOVED]
    code = ("import importlib, sys, warnings\n"
            "warnings.filterwarnings('error', message='.*moved to cpattn.lab', category=DeprecationWarning)\n"
            f"for m in {RUNTIME!r}: importlib.import_module(m)\n"
            f"print([m for m in sys.modules if m.startswith('cpattn.lab') or m in {lab!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the runtime imported the lab: {out.stdout.strip()}"


@pytest.mark.parametrize("name", MOVED)
def test_the_old_path_warns_and_exposes_the_same_objects(name):
    new = importlib.import_module(f"cpattn.lab.{name}")
    sys.modules.pop(f"cpattn.drafters.{name}", None)  # a fresh import of the old path: its warning is once per import
    with pytest.warns(DeprecationWarning, match=rf"cpattn\.drafters\.{name} moved to cpattn\.lab\.{name}"):
        old = importlib.import_module(f"cpattn.drafters.{name}")
    public = [n for n in vars(new) if not n.startswith("_")]
    assert public and all(getattr(old, n) is getattr(new, n) for n in public)
    private = [n for n in vars(new) if n.startswith("_") and not n.startswith("__")]
    assert all(getattr(old, n) is getattr(new, n) for n in private)  # read through, e.g. target._greedy_chunk
    with pytest.raises(AttributeError, match=f"moved to 'cpattn.lab.{name}'"):
        old.no_such_name


def configs():
    """One tiny config per family, and variants that exercise what config.json spells differently."""
    from cpattn.models import deepseek_v2, deepseek_v3, deepseek_v32, glm_moe_dsa, qwen3, qwen3_moe
    from cpattn.models import deepseek_v4_config as deepseek_v4
    from cpattn.models import qwen3_next_config as qn

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    return {
        "qwen3": qwen3.Qwen3Config.tiny(),
        "qwen3-tied-bias": qwen3.Qwen3Config.tiny(tie_word_embeddings=True, attention_bias=True, rms_norm_eps=1e-5),
        "qwen3_moe": qwen3_moe.Qwen3MoeConfig.tiny(),
        "qwen3_moe-dense-between": qwen3_moe.Qwen3MoeConfig.tiny(
            num_hidden_layers=3, mlp_layer_types=("sparse", "dense", "sparse")),
        "deepseek_v2": deepseek_v2.DeepseekV2Config.tiny(),
        "deepseek_v3": deepseek_v3.DeepseekV3Config.tiny(),
        "deepseek_v3-yarn-no-q-lora": deepseek_v3.DeepseekV3Config.tiny(rope=yarn, q_lora_rank=None,
                                                                         rope_interleave=False),
        "deepseek_v3-dense-after-sparse": deepseek_v3.DeepseekV3Config.tiny(
            num_hidden_layers=3, mlp_layer_types=("dense", "sparse", "dense")),
        "deepseek_v32": deepseek_v32.DeepseekV32Config.tiny(),
        "glm_moe_dsa": glm_moe_dsa.GlmMoeDsaConfig.tiny(),
        "deepseek_v4": deepseek_v4.DeepseekV4Config.tiny(),
        "deepseek_v4-yarn": deepseek_v4.DeepseekV4Config.tiny(
            rope_compress={"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                           "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                           "attention_factor": 1.0}),  # from_hf forces the compress scale to 1
        "qwen3_next": qn.Qwen3NextConfig.tiny(),
        "qwen3_next-dense": qn.Qwen3NextConfig.tiny(num_experts=0, num_experts_per_tok=0,
                                                    mlp_layer_types=("dense",) * 4, tie_word_embeddings=True),
        "qwen3_5": qn.Qwen3_5Config.tiny(),
        "qwen3_5_moe": qn.Qwen3_5MoeConfig.tiny(),
    }


CASES = ("qwen3", "qwen3-tied-bias", "qwen3_moe", "qwen3_moe-dense-between", "deepseek_v2", "deepseek_v3",
         "deepseek_v3-yarn-no-q-lora", "deepseek_v3-dense-after-sparse", "deepseek_v32", "glm_moe_dsa",
         "deepseek_v4", "deepseek_v4-yarn", "qwen3_next", "qwen3_next-dense", "qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("case", CASES)
def test_to_hf_round_trips_through_from_hf_and_json(case):
    from cpattn.models.family import get_family

    cfg = configs()[case]
    d = json.loads(json.dumps(cfg.to_hf()))  # what config.json holds
    fam = get_family(d)  # model_type names the family whose config it is
    assert fam.config_class is type(cfg)
    assert fam.config_class.from_hf(d) == cfg


@pytest.mark.slow
def test_transformers_reads_to_hf_as_the_same_model():
    transformers = pytest.importorskip("transformers")
    hf = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "deepseek_v2": "DeepseekV2Config",
          "deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig",
          "deepseek_v4": "DeepseekV4Config", "qwen3_next": "Qwen3NextConfig", "qwen3_5": "Qwen3_5Config",
          "qwen3_5_moe": "Qwen3_5MoeConfig"}
    for case, cfg in configs().items():
        d = cfg.to_hf()
        if case == "deepseek_v3-dense-after-sparse":
            continue  # transformers' DeepSeek-V3 knows only first_k_dense_replace; cpattn reads mlp_layer_types
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = getattr(transformers, hf[d["model_type"]])(**{k: v for k, v in d.items() if k != "model_type"})
        assert type(cfg).from_hf(theirs) == cfg, case


def test_target_save_writes_the_configs_to_hf(tmp_path):
    from cpattn.lab import target as tg

    cfg = tg.tiny_config("qwen3", vocab_size=16, hidden_size=16, num_layers=1)
    tg.save(tmp_path, "qwen3", cfg, tg.init("qwen3", cfg, seed=0), dtype=torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == {**cfg.to_hf(), "torch_dtype": "bfloat16"}
    assert tg.load(tmp_path)[:2] == ("qwen3", cfg)
    with pytest.warns(DeprecationWarning, match=r"use cfg\.to_hf\(\)"):
        assert tg.hf_config("qwen3", cfg) == cfg.to_hf()
