"""cpattn plan: --compute-dtype (the profile's peaks, e.g. FP8 GEMMs) and DP attention in the layout space."""

import json

import pytest

from cpattn.plan import Layout, Options, get_model, get_profile, predict
from cpattn.plan.rules import layout_problems, layout_space


def _json(argv, capsys):
    from cpattn.plan.cli import main

    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dp_attention_layouts_join_the_space_through_the_rules(capsys):
    spec = get_model("qwen3-235b-a22b")
    plain = layout_space(spec, 8)[0]
    ok, refused = layout_space(spec, 8, dp_attention=True)
    assert all(lay.dp == 1 for lay in plain) and set(plain) < set(ok)
    assert {lay.dp for lay in ok} == {1, 2, 4, 8} and all(lay.devices == 8 for lay in ok)
    assert all(layout_problems(spec, lay) == [] for lay in ok)
    assert any(r.layout == Layout(4, 1, 2, dp=2) for r in refused)  # 4 // 4 KV heads = 1 < dcp 2
    data = _json(["--model", "qwen3-235b-a22b", "--input-len", "8192", "--concurrency", "8", "--dp-attention"],
                 capsys)
    assert {p["layout"]["dp"] for p in data["predictions"]} == {1, 2, 4, 8}


def test_compute_dtype_sets_the_peak(capsys):
    spec, prof = get_model("deepseek-r1"), get_profile("h200")
    bf16 = predict(spec, prof, Layout(8), context=65536, batch=1)
    fp8 = predict(spec, prof, Layout(8), context=65536, batch=1, opts=Options(compute_dtype="fp8"))
    assert fp8.parts["prefill"]["gemm"] == pytest.approx(bf16.parts["prefill"]["gemm"] / 2, rel=0.02)  # 2x peak
    data = _json(["--model", "deepseek-r1", "--input-len", "65536", "--layout", "tp=8", "--compute-dtype", "fp8"],
                 capsys)
    assert data["predictions"][0]["ttft_s"] == pytest.approx(fp8.ttft_s)


def test_unknown_compute_dtype_is_one_line_exit_2(capsys):
    from cpattn.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--profile", "ascend-910c", "--compute-dtype", "fp8"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--compute-dtype" in err and "int8" in err
