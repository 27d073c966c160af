"""Qwen3.5 text through cpattn.models.qwen3_next, against tiny seeded transformers 5.24 models.

- ``Qwen3_5ForCausalLM`` (``qwen3_5_text``): 3 / 1 attention heads, 1 / 3 linear heads, the layer pattern
  full, linear, linear, full, linear; prompt logits within 1e-4 relative, 12 greedy tokens equal to ``generate``;
- the Hub's composite form (``Qwen3_5ForConditionalGeneration``, ``model_type`` ``qwen3_5``: nested
  ``text_config``, weights under ``model.language_model.``, a vision tower text generation ignores): the same
  config and weights load, and the text logits match.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import perturbed  # noqa: E402
from near_tie import check_tokens, rel_err  # noqa: E402
from test_qwen3_next_hf import caches, step  # noqa: E402

from cpattn.models import qwen3_next as qn  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW = 80, 12
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=5, num_attention_heads=3,
            num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=1, linear_num_value_heads=3, initializer_range=0.2, rms_norm_eps=1e-5,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                         "linear_attention"],
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
FLIPS: list = []


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (17, 9)]


def test_text_model_matches_hf():
    hf = perturbed(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**TEXT), seed=1)
    cfg, params = qn.Qwen3NextConfig.from_hf(hf.config), qn.load_params(hf.state_dict())
    assert cfg.split_projections and cfg.mlp_layer_types == ("dense",) * 5 and cfg.rotary_dim == 4
    ps = prompts()
    kv, rec = caches(cfg, 2, 17 + NEW)
    with torch.no_grad():
        logits, kv, rec = step(params, cfg, kv, rec, ps)
        for b, got in enumerate(logits.split([17, 9])):
            assert rel_err(got, hf(ps[b][None]).logits[0]) <= 1e-4
        last = logits[torch.tensor([16, 25])]
        toks, logs = [[], []], [[], []]
        for _ in range(NEW):
            nxt = last.argmax(-1)
            for b in range(2):
                toks[b].append(int(nxt[b]))
                logs[b].append(last[b])
            last, kv, rec = step(params, cfg, kv, rec, [nxt[:1], nxt[1:]])
        for b in range(2):
            out = hf.generate(ps[b][None], attention_mask=torch.ones_like(ps[b][None]), max_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            check_tokens(torch.tensor(toks[b]), torch.stack(logs[b]), out.sequences[0, ps[b].numel():],
                         torch.stack(out.logits, 1)[0], f"qwen3_5 request {b}", FLIPS)
    assert len(FLIPS) <= 1


def test_composite_checkpoint_form_loads_and_matches():
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = transformers.Qwen3_5Config(text_config=dict(TEXT), vision_config=vision)
    hf = perturbed(transformers.Qwen3_5ForConditionalGeneration, config, seed=2)
    d = hf.config.to_dict()
    assert d["model_type"] == "qwen3_5" and "text_config" in d
    cfg, params = qn.Qwen3NextConfig.from_hf(d), qn.load_params(hf.state_dict())
    assert not any(n.startswith(("model.visual", "model.language_model")) for n in params)
    ps = prompts()
    kv, rec = caches(cfg, 1, 17)
    with torch.no_grad():
        logits, _, _ = step(params, cfg, kv, rec, ps[:1])
        assert rel_err(logits, hf(input_ids=ps[0][None]).logits[0]) <= 1e-4
    with pytest.raises(ValueError, match=r"'text_config' is None; expected the text model's config"):
        qn.Qwen3NextConfig.from_hf({"model_type": "qwen3_5"})
