"""The engine's own pieces: cached-prefix prefill (the KV-pool hook), prompt validation, layout checks.

Tokens and logits are compared with conftest.py's ``one_device`` (:mod:`ref.greedy`: a fresh one-device full
prefill per token, no step loop or engine code; the model's forward is itself checked against Hugging Face in
test_models_hf.py); float64 tiny models, so tokens must be identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpattn
from cpattn.comm.sim import SimMesh
from cpattn.config import ConfigError
from cpattn.engine import driver
from cpattn.engine.batch import Prompts
from cpattn.engine.checks import engine_problems
from cpattn.engine.prefill import gather_unshard, prefill
from cpattn.engine.prefill_steps import Prefix
from cpattn.models import deepseek_v32, qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(1, 30)), [5, 6, 7, 8, 9, 10, 11], [3, 4]]
CONTEXT = (17, 3, 1)  # cached tokens per request: uneven, one of them a single token


def tiny(name):
    if name == "qwen3":
        cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=8)
        return qwen3.FAMILY, cfg
    return deepseek_v32.FAMILY, deepseek_v32.DeepseekV32Config.tiny()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "dsa"])
@pytest.mark.parametrize("pcp,dcp", [(1, 1), (2, 2), (3, 1), (1, 4)])
def test_prefill_from_a_cached_prefix(one_device, name, pcp, dcp):
    """Prefill only past each prompt's cached prefix (PCP / DSA-CP), hand off prefix + new rows, decode: the
    tokens of a full prefill on one device."""
    family, cfg = tiny(name)
    params = family.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    ref = one_device(family, params, cfg, PROMPTS, 8)
    one = SimMesh(1).groups()[0]
    full = prefill(one, family, params, cfg, Prompts.of(PROMPTS))
    rows = gather_unshard(one, full.rows, full.plan)  # [T, F] one device's rows, request order
    cu = Prompts.of(PROMPTS).cu_seqlens
    prefix = Prefix(torch.cat([rows[a:a + c] for a, c in zip(cu, CONTEXT)]), CONTEXT)
    pre, dec = driver.engine_configs(family, cfg, pcp_size=pcp, dcp_size=dcp, interleave_size=2)
    gens = cpattn.simulate(max(pcp, dcp), driver.generate_on_rank, family, params, cfg, PROMPTS, 8, prefill=pre,
                           decode=dec, prefix=prefix)
    assert ref.logits.dtype == ref.prompt_logits.dtype == torch.float64  # a float64 run's logits stay float64
    for g in gens:
        assert torch.equal(g.tokens, ref.tokens)
        assert g.logits.dtype == g.prompt_logits.dtype == torch.float64  # float32 would round 1 ulp apart
        assert torch.allclose(g.logits, ref.logits, rtol=1e-9, atol=1e-9)
        # prompt logits cover only the computed tokens
        computed = torch.cat([ref.prompt_logits[a + c : b] for a, b, c in zip(cu, cu[1:], CONTEXT)])
        assert torch.allclose(g.prompt_logits, computed, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("prompts, fragment", [
    ([], "non-empty list"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 2.5]], "prompt 0 must be a 1-D sequence of int token ids"),
    ([[1, 64]], "token id 64; token ids must be in [0, 64)"),
    ([[-1]], "token id -1"),
])
def test_prompts_are_checked(prompts, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Prompts.of(prompts, vocab_size=64)


def test_engine_limits_are_named():
    family, cfg = tiny("qwen3")
    pre, dec = driver.engine_configs(family, cfg, pcp_size=2, dcp_size=4)
    lines = engine_problems(family, cfg, pre, dec, world_size=4)
    assert len(lines) == 1 and lines[0].startswith("world_size: saw 4 ranks for pcp_size=2, dcp_size=4")
    # 6 ranks for P=2, N=4 is P/D, which moves whole blocks: interleave must equal the block size
    assert engine_problems(family, cfg, pre, dec, world_size=6)[0].startswith("cp_kv_cache_interleave_size")
    eager_only = dataclasses.replace(family, name="toy_eager", capturable=False)  # a step with host syncs
    p2, d2 = driver.engine_configs(eager_only, cfg, dcp_size=2, graph_mode="FULL_DECODE_ONLY", graph_backend="cpu")
    assert any(x.startswith("graph_backend: saw 'cpu' for toy_eager") for x in
               engine_problems(eager_only, cfg, p2, d2, world_size=2))
    with pytest.raises(ConfigError, match="num_speculative_tokens: saw 2 without a drafter"):
        p3, d3 = driver.engine_configs(family, cfg, dcp_size=2, num_speculative_tokens=2)
        driver.generate("qwen3", family.init_params(cfg), cfg, PROMPTS, 4, prefill=p3, decode=d3)
