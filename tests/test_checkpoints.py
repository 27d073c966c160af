"""Malformed or unsupported checkpoints are refused in one line, before any weight is read.

Each case starts from a good tiny Qwen3 checkpoint written by transformers'
``save_pretrained`` (the realistic writer), breaks one thing in config.json
or in the safetensors file, and asserts that ``cpattn.models.load_checkpoint``
and ``check_checkpoint`` raise one ValueError line naming the file and the
field (or tensor), with what was expected -- and that no tensor data was
read (``safetensors.safe_open`` is never called). A DeepSeek-V4 checkpoint
in DeepSeek's original names is refused naming the tensor as the file spells
it. ``cpattn demo --model DIR`` on a bad directory exits 2 with one line on
stderr before any rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from cpattn.models import check_checkpoint, load_checkpoint  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, eos_token_id=None, bos_token_id=None, pad_token_id=None)
L0 = "model.layers.0."


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny Qwen3 checkpoint from save_pretrained: (directory, its config dict, its tensors)."""
    d = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).save_pretrained(d)
    return d, json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))


def fp8(state):
    """compressed-tensors FP8: an F8_E4M3 weight and its per-channel ``weight_scale``."""
    w = state[L0 + "self_attn.q_proj.weight"]
    return {**state, L0 + "self_attn.q_proj.weight": w.to(torch.float8_e4m3fn),
            L0 + "self_attn.q_proj.weight_scale": torch.ones(w.shape[0], 1)}


def drop(name):
    return lambda state: {k: v for k, v in state.items() if k != name}


def change(name, fn):
    return lambda state: {**state, name: fn(state[name])}


# id: (config change or a whole config.json text, tensors change, what the one line must name)
CASES = {
    "fp8-weight-scale": ({}, fp8, ("model.safetensors", "q_proj.weight_scale", "not supported")),
    "quantization-config": ({"quantization_config": {"quant_method": "compressed-tensors"}}, fp8,
                            ("config.json", "quantization_config", "compressed-tensors")),
    "norm-shape-1": ({}, change(L0 + "input_layernorm.weight", lambda t: t[:1].clone()),
                     ("model.safetensors", "input_layernorm.weight", "[1]", "[32]")),
    "head-dim-0": ({"head_dim": 0}, None, ("config.json", "'head_dim' is 0", "positive integer")),
    "hidden-size-negative": ({"hidden_size": -128}, None, ("config.json", "'hidden_size' is -128", "positive")),
    "wrong-shape": ({}, change(L0 + "self_attn.o_proj.weight", lambda t: t[:, :16].clone()),
                    ("model.safetensors", "o_proj.weight", "[32, 16]", "[32, 32]")),
    "missing-tensor": ({}, drop(L0 + "self_attn.k_norm.weight"), ("model.safetensors", "k_norm.weight", "[8]")),
    "missing-head": ({}, drop("lm_head.weight"), ("model.safetensors", "lm_head.weight", "tie_word_embeddings")),
    "integer-weight": ({}, change(L0 + "mlp.down_proj.weight", lambda t: t.to(torch.int32)),
                       ("model.safetensors", "down_proj.weight", "I32", "floating-point")),
    "vocab-negative": ({"vocab_size": -64}, None, ("config.json", "'vocab_size' is -64", "positive integer")),
    "vocab-mismatch": ({"vocab_size": 100}, None, ("model.safetensors", "embed_tokens.weight", "vocab_size = 100")),
    "string-number": ({"hidden_size": "32"}, None, ("config.json", "'hidden_size' is '32' (a string)", "integer")),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, None,
                              ("config.json", "'num_key_value_heads' is 3", "divisor of num_attention_heads = 4")),
    "config-list": ("[1, 2]", None, ("config.json", "JSON list", "JSON object")),
    "config-invalid-json": ("{not json", None, ("config.json", "not valid JSON", "JSON object")),
    "config-string-true": ({"tie_word_embeddings": "false"}, None,
                           ("config.json", "tie_word_embeddings", "true or false")),
    "unknown-model-type": ({"model_type": "llama"}, None, ("config.json", "model_type 'llama'", "qwen3")),
    "layers-1e6": ({"num_hidden_layers": 10**6}, None,
                   ("model.safetensors", "num_hidden_layers", "1000000", "layers 0..1", "num_hidden_layers = 2")),
    "layers-too-few": ({"num_hidden_layers": 1}, None, ("model.safetensors", "layer 1", "num_hidden_layers' is 1")),
    "rope-type": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}}, None,
                  ("config.json", "rope_parameters", "'llama3'", "'default' or 'yarn'")),
    "bias-without-attention-bias": ({}, lambda s: {**s, L0 + "self_attn.q_proj.bias": torch.zeros(32)},
                                    ("model.safetensors", "q_proj.bias", "disagree")),
}


def write(d, good, conf, tensors):
    base_dir, config, state = good
    d.mkdir()
    (d / "config.json").write_text(conf if isinstance(conf, str) else json.dumps({**config, **conf}))
    save_file(tensors(state) if tensors else state, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_one_line_naming_file_and_field(tmp_path, good, case, monkeypatch):
    import safetensors

    conf, tensors, names = CASES[case]
    d = write(tmp_path / case, good, conf, tensors)

    def no_data(*a, **kw):
        raise AssertionError("tensor data was read before the checkpoint was checked")

    monkeypatch.setattr(safetensors, "safe_open", no_data)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as api:
        load_checkpoint(d)
    assert time.perf_counter() - t0 < 5, "the refusal must come at once"
    with pytest.raises(ValueError) as check:
        check_checkpoint(d)
    msg = str(api.value)
    assert msg == str(check.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert str(d) in msg, msg
    for name in names:
        assert name in msg, f"{case}: {name!r} not in: {msg}"


def test_good_checkpoint_passes_and_loads(tmp_path, good):
    d = write(tmp_path / "ok", good, {}, None)
    assert check_checkpoint(d) is None
    config, params = load_checkpoint(d, dtype=torch.float64)
    assert config["model_type"] == "qwen3" and params["model.norm.weight"].dtype == torch.float64


def test_truncated_safetensors_is_refused_naming_the_tensor(tmp_path, good):
    d = write(tmp_path / "cut", good, {}, None)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '.*' ends at byte \d+ .* truncated"):
        load_checkpoint(d)


@pytest.mark.slow  # a Hugging Face round trip: the full suite runs it, the fast lane does not
def test_deepseek_v4_original_names_are_checked_as_spelled(tmp_path):
    """A V4 tensor of the wrong shape is named as the file spells it (DeepSeek's names), after the family's
    renames matched it to what the model expects; a missing one by its params name; both spellings of one
    weight in one checkpoint are refused."""
    from test_checkpoint_load import hf_model

    src = tmp_path / "v4"
    hf_model("deepseek_v4").save_pretrained(src)
    state = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.hc_attn_fn" in state  # DeepSeek's spelling, renamed by the family on load
    save_file({**state, "model.layers.0.attn_hc.fn": state["model.layers.0.hc_attn_fn"].clone()},
              str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.attn_hc\.fn' both load as "
                                         r"'model\.layers\.0\.attn_hc\.fn'"):
        check_checkpoint(src)  # the two spellings of one weight: refused, not one of them silently
    state["model.layers.0.hc_attn_fn"] = state["model.layers.0.hc_attn_fn"][:, :8].contiguous()
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.hc_attn_fn' has shape "
                                         r"\[8, 8\] but config\.json gives \[8, 64\] \(from hidden_size = 32"):
        load_checkpoint(src)
    del state["model.layers.0.hc_attn_fn"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.0\.attn_hc\.fn'"):
        check_checkpoint(src)


@pytest.mark.slow
def test_demo_refuses_a_bad_checkpoint_before_any_rank(tmp_path, good):
    """num_hidden_layers 10**6 against 2 layers (which used to size 3.4 GB over 47 s, then a KeyError)."""
    conf = {"num_hidden_layers": 10**6}
    d = write(tmp_path / "bad", good, conf, None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cpattn", "demo", "--model", str(d)], capture_output=True, text=True,
                       env=env, timeout=120)
    took = time.perf_counter() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and str(d / "config.json" if "hidden_size" in conf else d / "model.safetensors") in lines[0]
    assert ("hidden_size" if "hidden_size" in conf else "num_hidden_layers") in lines[0]
    assert "rank" not in r.stderr.lower() and r.stdout == ""
    assert took < 30, f"the refusal took {took:.1f} s (starting ranks takes longer)"
