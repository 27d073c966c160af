"""Prompts shorter than the PCP split (1 .. 2P-1 tokens): ranks that own no token must still run every
collective and give the one-device tokens, in every path that runs per rank (PCP, DSA-CP, PCP+DCP, P/D,
speculative), for every model family.

Float64 tiny models, so tokens must be identical to conftest.py's ``one_device`` (:mod:`ref.greedy`: a fresh
one-device full prefill per token, no engine code).
"""

from __future__ import annotations

import pytest
import torch
from ref.greedy import ONE_DEVICE

from cpattn.drafters.ngram import NgramDrafter
from cpattn.models import deepseek_v2, deepseek_v3, deepseek_v32, qwen3, qwen3_moe
from cpattn.models.generate import (
    disagg_generate, generate, pcp_dcp_config, pcp_dcp_generate, speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 3


def qwen3_cfg():
    return qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


FAMILIES = {"qwen3": (qwen3, qwen3_cfg), "qwen3_moe": (qwen3_moe, qwen3_moe.Qwen3MoeConfig.tiny),
            "deepseek_v2": (deepseek_v2, deepseek_v2.DeepseekV2Config.tiny),
            "deepseek_v3": (deepseek_v3, deepseek_v3.DeepseekV3Config.tiny),
            "deepseek_v32": (deepseek_v32, deepseek_v32.DeepseekV32Config.tiny)}
_CACHE: dict = {}


def model(name):
    if name not in _CACHE:
        module, make = FAMILIES[name]
        cfg = make()
        _CACHE[name] = (module, cfg, module.FAMILY.init_params(cfg, seed=0, std=0.3, dtype=torch.float64))
    return _CACHE[name]


def expect(name, prompts):
    module, cfg, params = model(name)
    return ONE_DEVICE(module.FAMILY, params, cfg, prompts, NEW).tokens  # conftest.py's one_device memo


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("pcp", [2, 3])
def test_every_short_length_under_pcp(name, pcp):
    """Each prompt length 1 .. 2P-1 alone, and all of them in one batch, with PCP then DCP on the same ranks."""
    module, cfg, params = model(name)
    batch = [list(range(5, 5 + n)) for n in range(1, 2 * pcp)]
    for prompts in [[p] for p in batch] + [batch]:
        want = expect(name, prompts)
        assert torch.equal(generate(module, params, cfg, prompts, NEW, pcp_size=pcp).tokens, want)
    out = pcp_dcp_generate(module, params, cfg, batch, NEW, config=pcp_dcp_config(module, cfg, 2, interleave_size=1))
    assert torch.equal(out.tokens, expect(name, batch))


@pytest.mark.parametrize("split", ["balanced", "contiguous"])
def test_dsa_cp_splits_with_idle_ranks(split):
    """DSA-CP over 4 ranks with 1- and 2-token prompts: with either split some ranks own nothing."""
    module, cfg, params = model("deepseek_v32")
    for prompts in ([[9]], [[9], [3, 4]]):
        out = generate(module, params, cfg, prompts, NEW, pcp_size=4, dsa_split=split)
        assert torch.equal(out.tokens, expect("deepseek_v32", prompts))


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_pd_and_speculative_with_one_token_prompts(name):
    module, cfg, params = model(name)
    prompts = [[7], [8, 9]]
    want = expect(name, prompts)
    assert torch.equal(disagg_generate(module, params, cfg, prompts, NEW, pcp_size=3, dcp_size=2,
                                       block_size=2).tokens, want)
    out = speculative_generate(module, params, cfg, prompts, NEW, drafter=NgramDrafter(), num_speculative_tokens=2,
                               pcp_size=3, dcp_size=2)
    assert torch.equal(out.tokens, want)
