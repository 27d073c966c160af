"""MLAPO in the models: the DCP decode step writes the latent cache with the fused op (mla_preprocess).

Every MLA family (DeepSeek-V2, V3, V3.2, GLM-5) decodes through
:func:`cpattn.ops.mla_preprocess` where the step offers its paged latent
cache; the tokens must be conftest.py's ``one_device`` recompute's (float64: a
fresh one-device full prefill per token, no engine code), and the
logits bitwise those of the same run with the fused op switched off
(``mla_preprocess=False``): the op runs the model's own projection chain,
so fusing changes no rounding, in float64 and in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpattn
from cpattn.engine import driver
from cpattn.models import deepseek_v2, deepseek_v3, deepseek_v32, glm_moe_dsa

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(1, 12)), [5, 6, 7], [9]]
FAMILIES = {
    "deepseek_v2": (deepseek_v2.FAMILY, deepseek_v2.DeepseekV2Config),
    "deepseek_v3": (deepseek_v3.FAMILY, deepseek_v3.DeepseekV3Config),
    "deepseek_v32": (deepseek_v32.FAMILY, deepseek_v32.DeepseekV32Config),
    "glm_moe_dsa": (glm_moe_dsa.FAMILY, glm_moe_dsa.GlmMoeDsaConfig),
}


def run(family, params, cfg, dcp, **engine):
    pre, dec = driver.engine_configs(family, cfg, pcp_size=1, dcp_size=dcp, interleave_size=2, **engine)
    # the fixed-batch composition: its decode stage runs the fused op once per layer per decode step
    return cpattn.simulate(dcp, driver.composed_on_rank, family, params, cfg, PROMPTS, 6, prefill=pre, decode=dec)


def counting(monkeypatch):
    calls = []
    fused = deepseek_v3._mla_fused

    def spy(*a, **kw):
        calls.append(1)
        return fused(*a, **kw)

    monkeypatch.setattr(deepseek_v3, "_mla_fused", spy)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_decode_equals_reference_and_unfused(one_device, name, dcp, monkeypatch):
    family, config = FAMILIES[name]
    cfg = config.tiny()
    assert cfg.mla_preprocess  # on by default
    params = family.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    ref = one_device(family, params, cfg, PROMPTS, 6)
    calls = counting(monkeypatch)
    fused = run(family, params, cfg, dcp)
    assert len(calls) == 5 * cfg.num_hidden_layers * dcp  # every decode step after the first token, every layer
    unfused = run(family, params, dataclasses.replace(cfg, mla_preprocess=False), dcp)
    assert len(calls) == 5 * cfg.num_hidden_layers * dcp  # switched off: not called again
    for f, u in zip(fused, unfused):
        assert torch.equal(f.tokens, ref.tokens)
        assert torch.allclose(f.logits, ref.logits, rtol=1e-9, atol=1e-9)
        assert torch.equal(f.logits, u.logits)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_fused_decode_in_bf16(name, monkeypatch):
    """bf16 weights, DCP 2: the fused decode's logits are bitwise the unfused decode's."""
    family, config = FAMILIES[name]
    cfg = config.tiny()
    params = family.init_params(cfg, seed=1, std=0.2, dtype=torch.bfloat16)
    calls = counting(monkeypatch)
    fused = run(family, params, cfg, 2)
    assert calls
    for f, u in zip(fused, run(family, params, dataclasses.replace(cfg, mla_preprocess=False), 2)):
        assert torch.equal(f.logits, u.logits)


@pytest.mark.slow
def test_fused_decode_captured(one_device, monkeypatch):
    """The compiled decode (aot_eager, fullgraph; one rank: the simulated mesh's collectives do not trace) with the
    fused op traced in gives the one-device recompute's tokens. (GLM-5's and V3.2's DSA steps: test_glm5.py's
    check_static.)"""
    family, cfg = deepseek_v3.FAMILY, deepseek_v3.DeepseekV3Config.tiny()
    params = family.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)
    ref = one_device(family, params, cfg, PROMPTS, 6)
    calls = counting(monkeypatch)
    torch._dynamo.reset()
    (graph,) = run(family, params, cfg, 1, graph_mode="FULL_DECODE_ONLY", graph_backend="aot_eager",
                   capture_sizes=[4])
    torch._dynamo.reset()
    assert calls  # traced into the captured step
    assert graph.facts.runner["graph"] == 5 and graph.facts.runner["eager"] == 0  # every step replayed
    assert torch.equal(graph.tokens, ref.tokens)
    assert torch.allclose(graph.logits, ref.logits, rtol=1e-6, atol=1e-6)  # float32 logits, compiled sum order
