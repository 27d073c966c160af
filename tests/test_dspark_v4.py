"""DSpark on a DeepSeek-V4 target: the head fuses layers' hyper-connection streams ([T, n_hc, H], flattened to
n_hc * H features), lossless under every layout, identical drafts on every rank, trained by self-distillation.

The target is a random-init tiny V4 (sliding, CSA and HCA layers, 2 streams; float64), the head a DSpark head
trained in the fixture for a few seconds on the target's own greedy continuations (``greedy_data`` takes a
family with its own stages through the engine), so drafts are accepted and rejected and every rollback runs.
The oracle is plain one-device greedy generation (conftest.py's ``one_device``, :mod:`ref.greedy`: a fresh
full one-device prefill per token, no engine code; the forward is checked against Hugging Face's V4); float64
makes every logit match to rounding, so tokens must be equal.
The target and head live in spec_methods_cases.py; real gloo ranks (P/D 2 -> 2) run in
test_drafters_lossless.py::test_on_gloo_ranks with the other methods.
"""

from __future__ import annotations

import json

import pytest
import torch

from cpattn.comm.sim import simulate
from cpattn.lab import sequence as sq
from cpattn.lab import target as tg
from cpattn.drafters.dspark import DSparkConfig, DSparkDrafter
from cpattn.engine.drafters import TargetHidden
from cpattn.models import deepseek_v4 as v4
from cpattn.models.generate import (
    disagg_generate, pcp_dcp_config, pcp_dcp_generate_on_rank, speculative_generate,
)
from spec_methods_cases import DATA, Recorder, check_lossless, same_on_every_rank
from spec_methods_cases import V4_CFG as CFG
from spec_methods_cases import v4_prompts as prompts
from spec_methods_cases import v4_target as target
from spec_methods_cases import v4_trained as trained

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 14


def head() -> DSparkDrafter:
    return trained()[0]


@pytest.fixture(scope="module")
def reference(one_device):
    """Plain one-device greedy of the V4 target: conftest.py's ``one_device`` (a fresh full prefill per token,
    no engine code); its logits are the recompute's, compared at 1e-9."""
    return one_device("deepseek_v4", target(), CFG, prompts(), NEW)


def check(ref, out, k: int) -> None:
    check_lossless(out, ref, k, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_head_for_a_v4_target():
    """fc reads the fused layers' streams (2 layers x 2 streams x 32); the config round-trips through
    config.json with its target_hidden_size; a head saved before the field existed (Qwen3, [H] rows) loads
    with target_hidden_size = hidden_size; training lowered the loss."""
    d, losses, acc = trained()
    assert d.cfg.target_layer_ids == (0, 1) and d.cfg.target_hidden_size == CFG.hc_mult * CFG.hidden_size
    assert d.params["fc.weight"].shape == (CFG.hidden_size, 2 * CFG.hc_mult * CFG.hidden_size)
    assert d.cfg.intermediate_size == CFG.moe_intermediate_size and d.cfg.rope == CFG.rope_main
    saved = json.loads(json.dumps(d.cfg.to_dict()))
    assert saved["target_hidden_size"] == 64 and DSparkConfig.from_dict(saved) == d.cfg
    old = json.loads((DATA / "qwen3-dspark" / "config.json").read_text())
    assert "target_hidden_size" not in old
    qwen = DSparkDrafter.from_checkpoint(DATA / "qwen3-dspark")
    assert qwen.cfg.target_hidden_size == old["hidden_size"]
    assert qwen.cfg.feature_size == qwen.params["fc.weight"].shape[1]
    assert losses[-1] < 0.7 * losses[0] and acc[0] > 0.5
    with pytest.raises(ValueError, match="made for another target"):  # a V4 head on [H] rows
        d.start(1, 8).propose([[1, 2]], 2, [0], TargetHidden({i: torch.zeros(1, 1, 32) for i in (0, 1)}, (0,), (1,)))


# k = 2, 3 on one device and with PCP 2 prefill (DCP 2 decode, k = 4: the no-cache recomputation test)
@pytest.mark.slow
@pytest.mark.parametrize("k,pcp", [(2, 1), (3, 2)])
def test_equals_plain_greedy(reference, k, pcp):
    check(reference, speculative_generate("deepseek_v4", target(), CFG, prompts(), NEW, drafter=head(),
                                          num_speculative_tokens=k, pcp_size=pcp), k)


@pytest.mark.slow
def test_one_engine_pcp2_dcp2_and_pd(reference):
    """PCP 2 + DCP 2 on the same ranks (one engine, the colocated V4 hand-off) and P/D (PCP 2 -> DCP 2, the
    prompts' hidden states sent with the hand-off): identical drafts on both decode ranks."""
    outs = simulate(2, pcp_dcp_generate_on_rank, "deepseek_v4", target(), CFG, prompts(), NEW,
                    config=pcp_dcp_config("deepseek_v4", CFG, 2, interleave_size=2), drafter=head(),
                    num_speculative_tokens=3)
    same_on_every_rank(outs)
    check(reference, outs[0], 3)
    check(reference, disagg_generate("deepseek_v4", target(), CFG, prompts(), NEW, pcp_size=2, dcp_size=2,
                          drafter=head(), num_speculative_tokens=2), 2)


@pytest.mark.slow  # trains the head: the full suite runs it, the fast lane does not
def test_drafts_equal_a_no_cache_recomputation(reference):
    """DCP 2 decode, k = 4: lossless, and every proposal of the cached, rolled-back draft state (hidden rows
    from the verify steps) equals the head recomputed from scratch on the one-device prefill's hidden states
    of the history."""
    rec = Recorder(head())
    check(reference, speculative_generate("deepseek_v4", target(), CFG, prompts(), NEW, drafter=rec,
                                          num_speculative_tokens=4, dcp_size=2, interleave_size=2), 4)
    seen = {(tuple(h), tuple(d)) for histories, drafts in rec.log for h, d in zip(histories, drafts)}  # both ranks'
    assert len(seen) >= 12
    d = head()
    for h, got in sorted(seen):
        hid = tg.greedy_data("deepseek_v4", target(), CFG, torch.tensor([h]), len(h), d.hidden_layers).hidden
        feats = torch.cat([hid[i][0, : len(h) - 1] for i in d.cfg.target_layer_ids], -1)  # [L - 1, 2 x 2 x 32]
        assert sq.dspark_reference(d.params, d.cfg, list(h), feats, 4)[0] == list(got), f"history {h}"


@pytest.mark.slow
def test_graph_mode(reference):
    """FULL_DECODE_ONLY with DCP 2: the verify step (returning the streams) and the DSpark block step replay
    captures (the 'eager' backend: persistent buffers, padding), with plain greedy's tokens and logits."""
    k = 3
    rec = Recorder(head())
    out = speculative_generate("deepseek_v4", target(), CFG, prompts(), NEW, drafter=rec, num_speculative_tokens=k,
                               dcp_size=2, graph=True)
    check(reference, out, k)
    assert out.stats.graph_steps == out.stats.steps
    for state in rec.states:
        step = state.runners[1 + k]
        assert step.stats.eager == 1 and step.stats.reasons == {"prefill": 1}  # the prompt's catch-up
        assert step.stats.graph == out.stats.steps  # the step loop also proposes after the last step


@pytest.mark.slow
def test_train_draft_command_on_a_v4_checkpoint(tmp_path, capsys):
    """A random-init V4 target saved as a checkpoint (``target.save``) reads back equal; ``cpattn train-draft
    --method dspark`` trains a head for it that the registry loads; Eagle3 is refused with the rule."""
    from cpattn.lab.train import main as train_main
    from cpattn.drafters.registry import DRAFTERS

    cfg = v4.DeepseekV4Config.tiny()
    params = v4.init_params(cfg, seed=1, std=0.2)
    tg.save(tmp_path / "v4", "deepseek_v4", cfg, params)
    model, cfg2, params2 = tg.load(tmp_path / "v4")
    assert model == "deepseek_v4" and cfg2 == cfg and set(params2) == set(params)
    assert all(torch.equal(params2[n], params[n]) for n in params)
    with pytest.raises(SystemExit) as e:
        train_main(["--method", "eagle3", "--model", str(tmp_path / "v4"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "saw 'eagle3' for a deepseek_v4 target" in err and "--method dspark" in err
    out = tmp_path / "dspark"
    assert train_main(["--method", "dspark", "--model", str(tmp_path / "v4"), "--out", str(out), "--steps", "2",
                       "--prompts", "4", "--prompt-len", "4", "--length", "10", "--block-size", "2"]) == 0
    d = DRAFTERS["dspark"].from_checkpoint(out)
    assert d.cfg.target_hidden_size == cfg.hc_mult * cfg.hidden_size and d.cfg.block_size == 2
