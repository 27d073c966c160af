"""What ``cpattn train-target`` / ``train-draft`` write is a target and a drafter: each method's output loads as
the docs say (the drafter registry), drafts, and generation stays lossless; long work shows its phases and
obeys ``--seconds``."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpattn.lab import target as tg
from cpattn.drafters.mtp import MTPDrafter
from cpattn.lab.train import main as train_draft
from cpattn.lab.train import target_main
from cpattn.drafters.registry import DRAFTERS
from cpattn.models.generate import generate, speculative_generate

pytestmark = pytest.mark.slow

SMALL = ["--hidden", "16", "--layers", "2", "--vocab", "32", "--steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for model in ("qwen3", "deepseek_v3"):
        out[model] = str(root / model)
        assert target_main(["--model", model, "--out", out[model], *SMALL]) == 0
    return out


@pytest.mark.parametrize("method, model", [("mtp", "deepseek_v3"), ("eagle3", "qwen3"), ("dspark", "qwen3")])
def test_trained_head_loads_from_its_directory_drafts_and_is_lossless(method, model, targets, tmp_path, capsys):
    out = str(tmp_path / method)
    assert train_draft(["--method", method, "--model", targets[model], "--out", out, "--seconds", "1",
                        "--prompts", "8", "--length", "24", "--depth", "2"]) == 0
    drafter = DRAFTERS[method].from_checkpoint(out)  # as docs/speculative.md loads it: the directory alone
    name, cfg, params = tg.load(targets[model])
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    spec = speculative_generate(name, params, cfg, prompts, 8, drafter=drafter, num_speculative_tokens=2)
    assert spec.tokens.equal(generate(name, params, cfg, prompts, 8).tokens)  # lossless: plain greedy's tokens
    assert spec.stats.drafted > 0
    err = capsys.readouterr().err
    for phase in ("loading the target", "generating data", "training", "saving"):
        assert f"train-draft: {phase}" in err, err


def test_mtp_without_shared_tensors_takes_them_from_the_target(targets, tmp_path):
    out = str(tmp_path / "mtp")
    assert train_draft(["--method", "mtp", "--model", targets["deepseek_v3"], "--out", out, "--prompts", "4",
                        "--length", "20", "--depth", "1", "--steps", "1", "--no-progress"]) == 0
    file = os.path.join(out, "model.safetensors")
    kept = {k: t for k, t in load_file(file).items() if not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    save_file(kept, file)  # a module written without the target's embedding and head
    with pytest.raises(ValueError, match=r"has no model\.layers\.2\.embed_tokens\.weight.*target=TARGET_DIR"):
        MTPDrafter.from_checkpoint(out)
    d = MTPDrafter.from_checkpoint(out, target=targets["deepseek_v3"])
    _, _, params = tg.load(targets["deepseek_v3"])
    assert torch.equal(d.params["model.layers.2.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_seconds_bounds_data_generation_and_training(targets, tmp_path, capsys):
    t0 = time.perf_counter()
    assert train_draft(["--method", "eagle3", "--model", targets["qwen3"], "--out", str(tmp_path / "e"),
                        "--seconds", "3", "--length", "48"]) == 0  # 256 prompts: more data than 1.5 s allows here
    wall = time.perf_counter() - t0
    assert wall < 3 + 20, wall  # the budget, plus loading and saving (generous: a shared machine)
    err = capsys.readouterr().err
    assert "train-draft: generating data done:" in err and "train-draft: training done:" in err, err


def test_train_target_prints_its_phases(tmp_path, capsys):
    assert target_main(["--model", "qwen3", "--out", str(tmp_path / "t"), "--hidden", "16", "--layers", "1",
                        "--vocab", "32", "--seconds", "1"]) == 0
    err = capsys.readouterr().err
    assert "train-target: training:" in err and "train-target: training done:" in err and "saving" in err, err
