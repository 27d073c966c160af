"""The main job on a saved checkpoint of every family: ``cpattn demo --model DIR`` runs to the end with tokens checked.

For each family a tiny seeded Hugging Face model is written with
``save_pretrained`` (config.json + safetensors); the demo loads it like any
checkpoint, prefills with PCP (DSA-CP for DSA models) on gloo ranks, hands
the KV to DCP decode ranks and checks every decoded token against its own
single-device run (exit 0, ``tokens_match``). The single-device tokens are
also compared here with the checkpoint's own HF ``generate(do_sample=False)``
on the demo's prompts, so the checkpoint path (config.json parsing, weight
names) is checked against the model that wrote it. GLM-5's decode step is
compiled (aot_eager, FULL_DECODE_ONLY) and must replay every step; the others
decode eagerly.

GLM-5 runs through ``cpattn demo`` itself (``demo.main``: flags, checks, the
reference, one gloo spawn, the report, the JSON file, the exit status). The
other families run the very stages ``demo.main`` runs, from the same flags,
but their ranks share one gloo spawn (each family's run in turn on the same two
processes) instead of one spawn each: a spawn's start (two processes importing
torch) was most of each family's time.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpattn.bench import demo  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 96
TINY = ["--prompt-len", "24", "--batch", "2", "--max-new-tokens", "4", "--block-size", "4", "--reps", "1",
        "--no-progress"]
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
              pad_token_id=None, max_position_embeddings=64)
MLA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)
DSA = dict(index_topk=8, index_head_dim=16, index_n_heads=32)

FAMILIES = {  # model_type: (HF class, config, demo flags)
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        **COMMON, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        ["--pcp", "1", "--dcp", "1", "--graph-mode", "none"]),  # PCP/DCP: test_demo.py's embedded Qwen3
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        **COMMON, hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        ["--pcp", "1", "--dcp", "2", "--graph-mode", "none"]),
    "deepseek_v2": ("DeepseekV2ForCausalLM", lambda: transformers.DeepseekV2Config(
        **COMMON, **{**MLA, "q_lora_rank": None}, topk_method="greedy"),
        ["--pcp", "2", "--dcp", "1", "--graph-mode", "none"]),
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: transformers.DeepseekV3Config(
        **COMMON, **MLA, num_key_value_heads=4, n_group=2, topk_group=1),
        ["--pcp", "2", "--dcp", "2", "--graph-mode", "none", "--merge", "a2a"]),
    "deepseek_v32": ("DeepseekV32ForCausalLM", lambda: transformers.DeepseekV32Config(
        **COMMON, **MLA, **DSA, num_key_value_heads=4, n_group=2, topk_group=1),
        ["--pcp", "2", "--dcp", "2", "--graph-mode", "none"]),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", lambda: transformers.GlmMoeDsaConfig(
        **{**COMMON, "num_hidden_layers": 3}, **MLA, **DSA, num_key_value_heads=4, index_topk_pattern="FSF"),
        ["--pcp", "2", "--dcp", "2", "--backend", "aot_eager", "--no-eager-row"]),
}
THROUGH_MAIN = "glm_moe_dsa"  # the compiled one runs through cpattn demo itself


def hf_tokens(hf, spec) -> list[list[int]]:
    """HF greedy tokens for the demo's prompts (the first token comes from the prefill, as in the demo)."""
    tokens, cu = demo.prompts(spec, VOCAB)
    out = []
    with torch.no_grad():
        for a, b in zip(cu, cu[1:]):
            p = tokens[a:b][None]
            seq = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=spec.max_new_tokens,
                              do_sample=False, pad_token_id=0)
            out.append(seq[0, p.shape[1]:].tolist())
    return out


def _save(root, name):
    """The family's tiny seeded HF model, saved as a checkpoint directory: (model, config, directory)."""
    cls, config, _ = FAMILIES[name]
    torch.manual_seed(0)
    config = config()
    config._attn_implementation = "eager"
    hf = getattr(transformers, cls)(config).eval()
    hf.save_pretrained(root / name)
    return hf, config, root / name


def _argv(name, ckpt, path):
    return ["--model", str(ckpt), *TINY, *FAMILIES[name][2], "--json", str(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (exit status, the demo's JSON, HF model, HF config, checkpoint directory). ``THROUGH_MAIN`` by
    ``demo.main``; the others by main's own steps (parse the flags, check, the one-device reference in this
    process, the ranks, summarize, report, write the JSON), their two-rank runs sharing one gloo spawn."""
    from cpattn.bench.common import write_json
    from cpattn.bench.demo_report import report, summarize
    from cpattn.bench.demo_run import reference
    from cpattn.comm.launch import spawn
    from cpattn.comm.sim import simulate
    from gloo_cases import demo_cases

    root = tmp_path_factory.mktemp("families")
    saved = {name: _save(root, name) for name in FAMILIES}
    out = {}
    path = root / f"{THROUGH_MAIN}.json"
    code = demo.main(_argv(THROUGH_MAIN, saved[THROUGH_MAIN][2], path))
    out[THROUGH_MAIN] = (code, json.loads(path.read_text()))

    names = [n for n in FAMILIES if n != THROUGH_MAIN]
    args = {n: demo.parser().parse_args(_argv(n, saved[n][2], root / f"{n}.json")) for n in names}
    specs = {n: demo._spec(a, None) for n, a in args.items()}
    engines = {n: demo.check(s) for n, s in specs.items()}
    before = torch.get_num_threads()
    try:
        refs = {}
        for n in names:
            torch.set_num_threads(args[n].threads)  # as main: the reference gets what one rank gets
            refs[n] = reference(specs[n])
        two = [n for n in names if specs[n].world_size == 2]
        ranks = dict(zip(two, spawn(2, demo_cases, [specs[n] for n in two], threads=1, timeout_s=900)[0]))
        for n in names:
            if n not in ranks:  # one rank (Qwen3 at PCP 1 / DCP 1): no collective, so no process of its own
                assert specs[n].world_size == 1
                ranks[n] = simulate(1, demo.run_rank, specs[n], args[n].threads)[0]
    finally:
        torch.set_num_threads(before)
    for n in names:
        s = summarize(ranks[n], refs[n], specs[n], engines[n])
        assert f"cpattn demo: {n} (" in report(s)
        write_json(args[n].json, s)
        out[n] = (0 if s["ok"] else 1, json.loads(open(args[n].json).read()))
    return {n: (*out[n], *saved[n]) for n in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_demo_runs_a_saved_checkpoint(runs, name):
    code, out, hf, config, ckpt = runs[name]
    flags = FAMILIES[name][2]
    assert code == 0 and out["tokens_match"] is True, out["checks"]
    assert out["model"] == name and out["config"]["num_hidden_layers"] == config.num_hidden_layers
    assert all(c["equal_tokens"] == c["total_tokens"] == 8 for c in out["checks"].values())
    spec = demo.Spec(model_dir=str(ckpt), prompt_len=24, batch=2, max_new_tokens=4)
    assert out["reference_tokens"] == hf_tokens(hf, spec)
    if "--graph-mode" not in flags:  # GLM-5: the whole decode step compiled and replayed for every step
        assert out["whole_step_captured"] is True and out["graph"]["all_steps_replayed"] is True
        assert out["graph"]["backend"] == "aot_eager"
