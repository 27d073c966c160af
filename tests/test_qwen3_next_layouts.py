"""Qwen3-Next through the fixed-batch engine under every (PCP, DCP) in {1, 2, 3} x {1, 2, 3} against HF, and
``cpattn demo --model DIR`` on a ``save_pretrained`` tiny Qwen3-Next checkpoint.

The oracle is ``tests/test_qwen3_next_engine.py``'s tiny float64 HF model (6 query heads / 1 KV head, so DCP 2
and 3 both divide them; linear heads 1 key / 3 value; pattern linear, full, linear, linear, full; MoE with a
shared expert; prompts of 13, 1 and 6 tokens, one shorter than either PCP size). That file runs (1, 1),
(2, 1), (1, 2), (2, 2) and P/D 2 -> 2; this one the other layouts: greedy tokens equal HF ``generate``,
prompt logits within 1e-5 of HF's (its norms and delta rule run in float32) and equal to one device's to
float64 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import perturbed  # noqa: E402
from test_qwen3_next_engine import PROMPT_LENS, reference, rel, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = [(3, 1, False), (1, 3, False)]
SLOW = [(2, 3, False), (3, 2, False), (3, 3, False), (3, 3, True), (2, 3, True)]


def _check(pcp, dcp, pd):
    _, _, _, hf_logits, hf_tokens = reference()
    gen = run(pcp, dcp, pd)
    assert torch.equal(gen.tokens, hf_tokens), f"PCP {pcp} DCP {dcp} P/D {pd}: {gen.tokens} vs HF {hf_tokens}"
    if gen.prompt_logits is not None:
        for b, got in enumerate(gen.prompt_logits.split(list(PROMPT_LENS))):
            assert rel(got, hf_logits[b]) <= 1e-5, f"request {b}"
        one = run(1, 1)
        assert rel(gen.prompt_logits, one.prompt_logits) <= 1e-12
    assert rel(gen.logits, run(1, 1).logits) <= 1e-12


@pytest.mark.parametrize("pcp,dcp,pd", FAST, ids=[f"pcp{p}-dcp{d}" for p, d, _ in FAST])
def test_layout_equals_hf(pcp, dcp, pd):
    _check(pcp, dcp, pd)


@pytest.mark.slow
@pytest.mark.parametrize("pcp,dcp,pd", SLOW, ids=[f"{'pd-' if x else ''}pcp{p}-dcp{d}" for p, d, x in SLOW])
def test_layout_equals_hf_slow(pcp, dcp, pd):
    _check(pcp, dcp, pd)


VOCAB = 96


@pytest.mark.slow
def test_demo_runs_a_saved_qwen3_next_checkpoint(tmp_path):
    """``cpattn demo --model DIR`` (in-process ``demo.main``: the flags, the one-device reference, one gloo spawn
    for PCP 2 -> DCP 2, the JSON) on a checkpoint written by ``save_pretrained``: exit 0, every decoded token
    equal to its one-device run, and that run's tokens equal the checkpoint's own HF ``generate``."""
    from cpattn.bench import demo

    hf_cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=1, head_dim=8, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None, max_position_embeddings=64)
    hf = perturbed(transformers.Qwen3NextForCausalLM, hf_cfg, seed=7).eval()
    ckpt, out_path = tmp_path / "qwen3_next", tmp_path / "demo.json"
    hf.save_pretrained(ckpt)
    code = demo.main(["--model", str(ckpt), "--prompt-len", "24", "--batch", "2", "--max-new-tokens", "4",
                      "--block-size", "4", "--reps", "1", "--no-progress", "--pcp", "2", "--dcp", "2",
                      "--graph-mode", "none", "--json", str(out_path)])
    out = json.loads(out_path.read_text())
    assert code == 0 and out["tokens_match"] is True, out["checks"]
    assert out["model"] == "qwen3_next" and out["config"]["num_hidden_layers"] == 3
    assert all(c["equal_tokens"] == c["total_tokens"] == 8 for c in out["checks"].values())
    spec = demo.Spec(model_dir=str(ckpt), prompt_len=24, batch=2, max_new_tokens=4)
    tokens, cu = demo.prompts(spec, VOCAB)
    want = []
    with torch.no_grad():
        for a, b in zip(cu, cu[1:]):
            p = tokens[a:b][None]
            seq = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=4, do_sample=False, pad_token_id=0)
            want.append(seq[0, p.shape[1]:].tolist())
    assert out["reference_tokens"] == want
