"""One policy for the guide's limitation lists (docs/compat.md): where cpattn is exact it runs, with a
compatibility note; ``strict_guide=True`` refuses what vLLM-Ascend's engine would refuse; correctness rules
stay refusals."""

from __future__ import annotations

import warnings

import pytest

from cpattn.config import ConfigError, EngineConfig, GuideCompatWarning
from cpattn.drafters.draft_model import truncated
from cpattn.drafters.ngram import NgramDrafter
from cpattn.models import qwen3
from cpattn.models.generate import generate, pcp_dcp_config, pcp_dcp_generate

CFG = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7]]


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_token_drafters_under_pcp_with_dcp_run_lossless_with_a_note(kind):
    params = qwen3.init_params(CFG)
    drafter = NgramDrafter() if kind == "ngram" else truncated("qwen3", params, CFG, 1)
    config = pcp_dcp_config("qwen3", CFG, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = pcp_dcp_generate("qwen3", params, CFG, PROMPTS, 10, config=config, drafter=drafter,
                               num_speculative_tokens=2)
    assert out.tokens.equal(generate("qwen3", params, CFG, PROMPTS, 10).tokens)  # lossless vs plain greedy
    notes = [str(w.message) for w in seen if issubclass(w.category, GuideCompatWarning)]
    assert any(f"speculative_method: saw '{kind}' with pcp_size=2" in n for n in notes), notes
    assert out.stats.drafted > 0  # the drafter took part


def test_strict_guide_refuses_what_the_guide_refuses():
    spec = dict(speculative_method="ngram", num_speculative_tokens=2)
    with pytest.warns(GuideCompatWarning):
        cfg = pcp_dcp_config("qwen3", CFG, 2).replace(**spec)
    assert [n.split(":")[0] for n in cfg.compat_notes()] == ["allow_pcp_with_dcp", "speculative_method"]
    with pytest.raises(ConfigError) as info:
        cfg.replace(strict_guide=True)
    assert [p.split(":")[0] for p in info.value.problems] == ["allow_pcp_with_dcp", "speculative_method"]
    strict = EngineConfig.create(tp_size=2, dcp_size=2, attention="mla", strict_guide=True)
    assert strict.strict_guide and strict.replace(block_size=64).strict_guide  # kept through replace


@pytest.mark.parametrize("flat, param", [
    (dict(tp_size=4, num_attention_heads=6), "tp_size"),                                     # heads divisible
    (dict(tp_size=2, dcp_size=2, attention="mla", kv_transfer="pool"), "cp_kv_cache_interleave_size"),  # blocks
    (dict(pcp_size=2, kv_transfer="pd", kv_role="kv_consumer", cp_kv_cache_interleave_size=128), "pcp_size"),  # P/D
])
def test_correctness_rules_stay_refusals(flat, param):
    with pytest.raises(ConfigError, match=rf"  - {param}: saw "):
        EngineConfig.create(**flat)


def test_notes_are_empty_where_the_guide_agrees():
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuideCompatWarning)
        cfg = EngineConfig.create(attention="mla", pcp_size=2, speculative_method="mtp", num_speculative_tokens=3,
                                  graph_mode="FULL_DECODE_ONLY", strict_guide=True)
    assert cfg.compat_notes() == []


@pytest.mark.parametrize("p, n", [(3, 2), (2, 3), (3, 4), (4, 3), (1, 3)])
def test_engine_layout_fixes_pass_every_rule(p, n):
    """The engine's refusal of a layout (ranks, DCP vs heads) offers (pcp, dcp, ranks) that pass every rule."""
    import re

    from cpattn.engine import checks
    from cpattn.engine.family import get_family

    cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    common = dict(num_attention_heads=4, num_kv_heads=1, tp_splits_kv_heads=False)
    pre = EngineConfig.create(pcp_size=p, **common)
    dec = EngineConfig.create(tp_size=n, dcp_size=n, **{**common, "num_attention_heads": None})
    fam, w = get_family("qwen3"), max(p, n)
    found = checks.engine_problems(fam, cfg, pre, dec, world_size=w, topology="colocated")
    assert found
    offers = [tuple(int(x) if x else w for x in m) for line in found
              for m in re.findall(r"(?:run (\d+) ranks with )?pcp_size=(\d+), dcp_size=(\d+)", line.rpartition("fix: ")[2])]
    assert offers, found
    for ranks, pp, nn in offers:
        ok = checks.engine_problems(fam, cfg, pre.replace(pcp_size=pp), dec.replace(tp_size=nn, dcp_size=nn),
                                    world_size=ranks, topology="colocated")
        assert ok == [], (p, n, found, (ranks, pp, nn), ok)


@pytest.mark.parametrize("argv", [["--pcp", "3"], ["--dcp", "8"], ["--pcp", "3", "--dcp", "3"], ["--dcp", "3"]])
def test_demo_size_fixes_pass_the_demo_check(argv, capsys):
    """`cpattn demo --pcp 3` / `--dcp 8` offered `--pcp W --dcp W`, which the heads rule refused next: every pair
    offered now passes the demo's whole check (before any rank starts)."""
    import re

    from cpattn.bench import demo

    def checked(args):
        a = demo.parser().parse_args(args)
        return demo.check(demo._spec(a, None))

    with pytest.raises(SystemExit) as e:
        checked(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    offers = re.findall(r"--pcp (\d+) --dcp (\d+)", err.rpartition("fix: ")[2])
    assert offers, err
    for p, n in offers:
        checked(["--pcp", p, "--dcp", n])  # raises SystemExit if refused
