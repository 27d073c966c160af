"""cpattn plan --pd: a PCP prefill engine, a DCP decode engine and the KV moved between them, both sides through
the engine's P/D rules."""

import json

import pytest

from cpattn.config import ConfigError
from cpattn.plan import Layout, get_model, get_profile, predict
from cpattn.plan.pd import predict_pd

H200 = get_profile("h200")


def test_pd_split_adds_the_kv_transfer_to_the_prefill_ttft():
    spec = get_model("deepseek-r1")
    pre, dec = Layout(1, 8), Layout(8, 1, 8)
    r = predict_pd(spec, H200, pre, dec, context=131072, batch=2)
    kv = 131072 * spec.layers * (512 + 64) * 2  # MLA latent + rope, bf16, every layer
    inter = H200.links["inter"]
    assert r["transfer_s"] == pytest.approx(inter.alpha + kv / (8 * inter.beta))  # 8 PCP shards -> 8 DCP shards
    p = predict(spec, H200, pre, context=131072, batch=2)
    d = predict(spec, H200, dec, context=131072, batch=2)
    assert r["ttft_p99_s"] == pytest.approx(p.ttft_p99_s + r["transfer_s"]) and r["tpot_s"] == d.tpot_s
    assert r["devices"] == 16 and r["tokens_per_s_per_device"] == pytest.approx(d.tokens_per_s_per_device / 2)


def test_a_decode_engine_with_pcp_is_refused_by_the_engine_rule(capsys):
    with pytest.raises(ConfigError, match="kv_consumer"):
        predict_pd(get_model("deepseek-r1"), H200, Layout(1, 8), Layout(4, 2), context=8192, batch=1)
    from cpattn.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "deepseek-r1", "--pd", "tp=1,pcp=8/tp=4,pcp=2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--pd" in err and "fix: set pcp_size=1" in err
    with pytest.raises(SystemExit) as e:
        main(["--pd", "tp=1,pcp=8"])
    assert e.value.code == 2 and "PREFILL/DECODE" in capsys.readouterr().err


def test_cli_pd_rows_in_json(capsys):
    from cpattn.plan.cli import main

    assert main(["--model", "deepseek-r1", "--input-len", "32768", "--pd", "tp=1,pcp=8/tp=8,dcp=8",
                 "--pd", "tp=1,pcp=8/tp=4,pcp=2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["decode"] for r in data["pd"]] == ["tp=8 pcp=1 dcp=8"]
    assert data["pd_refused"][0]["decode"] == "tp=4 pcp=2 dcp=1"
    assert data["pd"][0]["ttft_p99_s"] > data["pd"][0]["transfer_s"] > 0
