"""The main job ``cpattn demo`` end to end on 2 gloo ranks, at tiny sizes.

The demo checks its own tokens against a single-device run; these tests
check that the check is real: the JSON says the tokens match and that every
decode step replayed a captured program, and a wrong reference makes the
exit status non-zero. The tokens are also compared here with an
independent single-device greedy run of the same embedded model
(:func:`cpattn.models.generate.generate`, dense cache, no graphs).
"""

from __future__ import annotations

import json

import pytest
import torch

from cpattn.bench import demo

TINY = ["--prompt-len", "40", "--batch", "3", "--max-new-tokens", "6", "--block-size", "4", "--reps", "1",
        "--no-progress"]


@pytest.fixture(scope="module")
def expected_tokens():
    """Greedy tokens of the embedded model for the TINY prompts, on one device by the plain model path."""
    from cpattn.models.generate import generate

    spec = demo.Spec(prompt_len=40, batch=3, max_new_tokens=6)
    module, cfg, params = demo.load_model(spec)
    tokens, cu = demo.prompts(spec, cfg.vocab_size)
    prompts = [tokens[a:b] for a, b in zip(cu, cu[1:])]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return generate(module, params, cfg, prompts, 6).tokens.tolist()
    finally:
        torch.set_num_threads(before)


def _run(tmp_path, *flags):
    path = tmp_path / "demo.json"
    code = demo.main([*TINY, *flags, "--json", str(path)])
    return code, json.loads(path.read_text())


@pytest.mark.slow
def test_demo_graph_mode_matches_single_device(tmp_path, capsys, expected_tokens):
    """PCP=2 prefill -> DCP=2 decode, the whole step compiled by inductor; batch 3 is padded to size 4."""
    code, out = _run(tmp_path, "--backend", "cpu")
    assert code == 0
    assert out["tokens_match"] is True
    assert out["reference_tokens"] == expected_tokens
    assert out["tokens"]["graph"] == expected_tokens and out["tokens"]["eager"] == expected_tokens
    g = out["graph"]
    assert g["backend"] == "cpu" and out["whole_step_captured"] is True
    assert g["all_steps_replayed"] and g["stats"]["graph"] == 5 and g["stats"]["eager"] == 0
    assert g["stats"]["sizes"] == {"4": 5} and g["stats"]["padded_tokens"] == 5  # 3 requests in a size-4 graph
    assert out["engines"]["prefill"]["pcp_size"] == 2 and out["engines"]["prefill"]["kv_role"] == "kv_producer"
    assert out["engines"]["decode"]["dcp_size"] == 2 and out["engines"]["decode"]["pcp_size"] == 1
    assert out["engines"]["decode"]["cp_kv_cache_interleave_size"] == out["engines"]["decode"]["block_size"] == 4
    par = out["rows"][1]
    assert par["KV_bytes_per_rank"] < out["rows"][0]["KV_bytes_per_rank"]
    # the step loop: the prefill step sends each KV row to its DCP owner (no separate hand-off)
    assert out["composition"] == "step loop"
    assert par["prefill_sent"] > 0 and par["handoff_sent"] == 0 and par["decode_sent_per_step"] > 0
    assert len(out["ttft_samples_ms"]) == 1 and out["tpot_ms"]["graph"]["low"] <= out["tpot_ms"]["graph"]["median"]
    assert out["graph_vs_eager"]["median"] > 0
    printed = capsys.readouterr().out
    assert "TTFT_ms" in printed and "TPOT_ms" in printed and "18/18 identical" in printed


@pytest.mark.slow
def test_demo_mismatch_fails(tmp_path, capsys, monkeypatch):
    """A reference token changed on purpose: the demo must say so and exit non-zero (eager decode, DCP only).

    The whole of ``demo.main`` runs (flags, checks, reference, ranks, the check, report, JSON, exit status), its
    two ranks on the simulated mesh instead of a second gloo spawn: the mismatch is found after the ranks return
    (the perturbed reference lives in the report step), and the demo on gloo ranks is the test above's run.
    """
    from cpattn.comm import launch
    from cpattn.comm.sim import simulate

    def on_threads(world_size, fn, *args, threads=1, timeout_s=None):
        return simulate(world_size, fn, *args)

    monkeypatch.setattr(launch, "spawn", on_threads)
    before = torch.get_num_threads()  # the rank function sets this process's threads
    try:
        code, out = _run(tmp_path, "--graph-mode", "none", "--pcp", "1", "--perturb-reference")
    finally:
        torch.set_num_threads(before)
    assert code == 1
    assert out["tokens_match"] is False
    chk = out["checks"]["eager"]
    assert chk["equal_tokens"] == chk["total_tokens"] - 1
    assert chk["first_mismatch"]["request"] == 0 and chk["first_mismatch"]["token"] == 5
    assert "DIFFERENT" in capsys.readouterr().out


def test_demo_rejects_layouts_the_guide_forbids(capsys):
    """--dcp that does not divide the heads is refused before any rank starts; so is pcp != dcp != 1."""
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--dcp", "3", "--pcp", "1", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dcp=3" in err and "num_attention_heads" in err
    with pytest.raises(SystemExit):
        demo.main(["--pcp", "2", "--dcp", "4"])


def _offered_model_types() -> list[str]:
    """What ``cpattn demo --model-type`` offers (its --help choices)."""
    (action,) = [a for a in demo.parser()._actions if "--model-type" in a.option_strings]
    return list(action.choices)


# 1.5-4 s each on 2 cores: the full suite runs them; the fast lane keeps the dense, MoE and MLA families
SLOW_DEMO_FAMILIES = {"deepseek_v4", "qwen3_next", "glm_moe_dsa", "deepseek_v32"}


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_DEMO_FAMILIES else m
                                        for m in _offered_model_types()])
def test_demo_runs_every_offered_model_type(model_type, one_thread):
    """The demo's step loop (``run_rank``) for every embedded family (DeepSeek-V4's and Qwen3-Next's own runners
    included), PCP=2 + DCP=2 with the decode step through the graph runner, on 2 simulated ranks: the demo's checks
    pass (every token equals its one-device run), the engine counted what ran, and the report says so."""
    import cpattn
    from cpattn.bench import demo_report, demo_run

    spec = demo.Spec(model_type=model_type, prompt_len=24, batch=2, max_new_tokens=3, block_size=4, reps=1,
                     progress=False, backend="eager")
    engines = demo.check(spec)
    ref = demo_run.reference(spec)
    res = cpattn.simulate(spec.world_size, lambda g: demo.run_rank(g, spec))[0]
    s = demo_report.summarize(res, ref, spec, engines)
    assert s["ok"] and s["tokens_match"] and s["model"] == model_type, s["checks"]
    assert set(s["checks"]) == {"graph", "eager"}
    assert all(c["equal_tokens"] == c["total_tokens"] == 6 for c in s["checks"].values())
    assert s["graph"]["all_steps_replayed"] and s["rows"][1]["decode_sent_per_step"] > 0
    assert s["composition"] == "step loop" and s["rows"][1]["handoff_sent"] == 0 and s["rows"][1]["prefill_sent"] > 0
    # the engine's own counters: step 0 (the prefill of both prompts) eager, each decode step replayed
    assert {k: s["engine_stats"]["graph"][k] for k in ("steps", "eager_steps", "replayed_steps", "preemptions",
                                                       "blocks_used")} == dict(steps=3, eager_steps=1,
                                                                               replayed_steps=2, preemptions=0,
                                                                               blocks_used=0)
    assert s["engine_stats"]["eager"]["eager_steps"] == 3 and s["engine_stats"]["eager"]["replayed_steps"] == 0
    assert f"cpattn demo: {model_type} (" in demo_report.report(s)
