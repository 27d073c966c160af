"""cpattn.plan: "fits False" names the memory term that overflows (weights, activations, KV) and the smallest
change that fits, each change checked by recomputing the memory."""

import dataclasses
import json

import pytest

from cpattn.plan import Layout, Options, get_model, get_profile, layouts, predict, recommend
from cpattn.plan.fits import fit_changes
from cpattn.plan.memory import memory_terms

H200 = get_profile("h200")


def test_glm5_bf16_weights_overflow_and_fp8_fits():
    # the README's example: every layout unfit because of the bf16 weights, not the context
    spec = get_model("glm-5")
    preds = [predict(spec, H200, lay, context=131072, batch=1) for lay in layouts(spec, 8)]
    assert preds and all(not p.fits and p.overflow == "weights" for p in preds)
    for p in preds:
        m = p.memory
        assert m["weights"] > m["usable"] and m["short"] == pytest.approx(m["weights"] - m["usable"])
    best, why = recommend(preds)
    assert best is None and "weights overflow on 7 of 7" in why and "context" not in why
    changes = fit_changes(spec, H200, 8, 131072, 1, Options())
    assert changes[0]["change"] == "--weights fp8" and changes[0]["term"] == "weights"
    fp8 = spec.replace(weights="fp8")
    for name in changes[0]["layouts"]:  # each offered layout really fits with the change
        lay = next(x for x in layouts(fp8, 8) if str(x) == name)
        assert predict(fp8, H200, lay, context=131072, batch=1).fits


def test_kv_overflow_is_named_and_the_largest_batch_fits():
    spec = get_model("deepseek-r1")
    preds = [predict(spec, H200, lay, context=131072, batch=64) for lay in layouts(spec, 8)]
    assert all(p.overflow == "KV" for p in preds)
    assert "KV cache overflows on 7 of 7" in recommend(preds)[1]
    changes = {c["change"].split()[0]: c for c in fit_changes(spec, H200, 8, 131072, 64, Options())}
    b = int(changes["--batch"]["change"].split()[1])
    fits = lambda n: any(memory_terms(spec, H200, lay, 131072, n, Options())["overflow"] is None  # noqa: E731
                         for lay in layouts(spec, 8))
    assert fits(b) and not fits(b + 1)  # the largest batch that fits, not a guess


def test_activations_overflow_names_max_batched_tokens():
    spec = get_model("deepseek-r1")
    prof = dataclasses.replace(H200, mem_bytes=125e9)  # the weights leave ~22 GB on tp=8
    opts = Options(max_batched_tokens=1 << 20)
    m = memory_terms(spec, prof, Layout(8), 1 << 20, 1, opts)
    assert m["overflow"] == "activations" and m["activations"] > m["usable"] - m["weights"]
    changes = fit_changes(spec, prof, 8, 1 << 20, 1, opts)
    assert changes and changes[0]["change"].startswith("--max-batched-tokens ")
    n = int(changes[0]["change"].split()[1])
    assert n < 1 << 20 and any(memory_terms(spec, prof, lay, 1 << 20, 1, dataclasses.replace(
        opts, max_batched_tokens=n))["overflow"] is None for lay in layouts(spec, 8))


def test_a_cure_that_leaves_another_term_is_combined():
    # Kimi-K2 fp8 does not fit 8 x H200; int4 fits the weights, then the 64 requests' KV needs fp8 too
    changes = fit_changes(get_model("kimi-k2"), H200, 8, 131072, 64, Options())
    assert changes[0]["change"] == "--weights int4 and --kv-cache-dtype fp8" and changes[0]["term"] == "weights"


def test_cli_shows_the_term_and_the_change(capsys):
    from cpattn.plan.cli import main

    argv = ["--model", "glm-5", "--context", "131072", "--devices", "8", "--profile", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "weights +66.1 GB" in out and "smallest change that fits: --weights fp8" in out
    assert main([*argv, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fit_changes"][0]["change"] == "--weights fp8"
    assert {p["overflow"] for p in data["predictions"]} == {"weights"}
    assert all(p["memory"]["weights"] > p["memory"]["usable"] for p in data["predictions"])
