"""cpattn.plan recommends for the objective a user has (ttft, tpot, throughput, goodput under SLOs), reports
near-ties as ties, and separates per-request TTFT (p50 / p99 under a concurrency) from the batch's makespan."""

import json

import pytest

from cpattn.plan import Layout, Options, get_model, get_profile, layouts, predict
from cpattn.plan.model import prefill_time, request_ttfts
from cpattn.plan.objective import SLO, goodput, rank, recommend, with_goodput

H200 = get_profile("h200")
R1 = get_model("deepseek-r1")


def _preds(spec=R1, devices=8, **kw):
    return [predict(spec, H200, lay, **kw) for lay in layouts(spec, devices)]


def test_near_ties_on_ttft_are_a_tie_broken_by_tpot():
    # the case: R1 at 1M tokens, TTFTs within a fraction of a percent, TPOTs far apart
    preds = _preds(devices=16, context=1_000_000, batch=1)
    r = rank(preds, "ttft", 0.02)
    fastest = min(preds, key=lambda p: p.ttft_p99_s)
    assert len(r["ties"]) > 1 and fastest in r["ties"]
    assert all(abs(p.ttft_p99_s / fastest.ttft_p99_s - 1) <= 0.02 for p in r["ties"])
    assert r["best"].tpot_s == min(p.tpot_s for p in r["ties"]) < fastest.tpot_s
    best, why = recommend(preds, "ttft")
    assert best is r["best"] and "a tie within 2%" in why and "broken by tpot" in why
    # no tolerance: the strict minimum again
    assert rank(preds, "ttft", 0.0)["best"] is fastest


@pytest.mark.parametrize("objective,key", [("tpot", lambda p: p.tpot_s),
                                           ("throughput", lambda p: -p.tokens_per_s_per_device)])
def test_each_objective_picks_its_own_metric(objective, key):
    preds = _preds(context=131072, batch=1)
    r = rank(preds, objective, 0.0)
    assert key(r["best"]) == min(key(p) for p in preds if p.fits)
    assert r["per_objective"]["ttft"] is rank(preds, "ttft", 0.0)["best"]


def test_goodput_is_the_largest_concurrency_that_meets_the_slos():
    slo, opts = SLO(ttft_s=2.0, tpot_s=0.05), Options(output=512)
    lay = Layout(8, 1, 4)
    g = goodput(R1, H200, lay, context=8192, slo=slo, opts=opts)
    c = g["concurrency"]
    at = lambda n: predict(R1, H200, lay, context=8192, batch=n, opts=opts)  # noqa: E731
    assert c >= 1 and slo.met(at(c).ttft_p99_s, at(c).tpot_s) and not slo.met(at(c + 1).ttft_p99_s, at(c + 1).tpot_s)
    p = at(c)
    assert g["tokens_per_s_per_device"] == pytest.approx(c / (p.ttft_p50_s + 512 * p.tpot_s) / 8 * 512)
    preds = with_goodput(_preds(context=8192, batch=1, opts=opts), R1, H200, context=8192, slo=slo, opts=opts)
    best = rank(preds, "goodput", 0.0, slo)["best"]
    assert best.parts["goodput"]["tokens_per_s_per_device"] == max(
        q.parts["goodput"]["tokens_per_s_per_device"] for q in preds)


def test_slos_filter_and_an_unmeetable_slo_is_said():
    preds = _preds(context=131072, batch=1)
    slo = SLO(tpot_s=min(p.tpot_s for p in preds) * 1.01)
    assert all(p.tpot_s <= slo.tpot_s for p in rank(preds, "ttft", 0.02, slo)["eligible"])
    best, why = recommend(preds, "ttft", slo=SLO(ttft_s=1e-3))
    assert best is None and "no layout that fits meets the SLOs" in why and "closest" in why


def test_per_request_ttft_and_makespan_are_separate():
    opts = Options()
    p = predict(R1, H200, Layout(8), context=32768, batch=16, opts=opts)
    makespan = prefill_time(R1, H200, Layout(8), 32768, 16, opts)["total"]
    assert p.makespan_s == p.ttft_s == pytest.approx(makespan)
    # 32K prompts each fill a step: they finish one after another over the makespan
    assert p.ttft_p99_s == pytest.approx(makespan) and p.ttft_p50_s == pytest.approx(makespan * 8 / 16)
    one = predict(R1, H200, Layout(8), context=32768, batch=1, opts=opts)
    assert one.ttft_p50_s == one.ttft_p99_s == one.makespan_s
    # short prompts share steps: 8 of 1K tokens per 8192-token step
    assert request_ttfts(1.0, 16, 1024, 8192) == [0.5] * 8 + [1.0] * 8
    assert request_ttfts(1.0, 4, 4096, 8192, dp=2) == [1.0] * 4  # two replicas, two prompts a step each


def _json(argv, capsys):
    from cpattn.plan.cli import main

    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("objective,extra", [("ttft", []), ("tpot", []), ("throughput", []),
                                             ("goodput", ["--ttft-slo", "2s", "--tpot-slo", "50ms"])])
def test_cli_objective_recommends_what_rank_picks(objective, extra, capsys):
    argv = ["--model", "deepseek-r1", "--input-len", "8192", "--output-len", "512", "--concurrency", "4",
            "--objective", objective, *extra]
    data = _json(argv, capsys)
    slo = SLO(data["slo"]["ttft_s"], data["slo"]["tpot_s"])
    assert data["objective"] == objective and data["concurrency"] == 4 and data["input_len"] == 8192
    opts = Options(output=512)
    preds = [predict(R1, H200, lay, context=8192, batch=4, opts=opts) for lay in layouts(R1, 8)]
    if objective == "goodput":
        assert slo == SLO(2.0, 0.05)
        preds = with_goodput(preds, R1, H200, context=8192, slo=slo, opts=opts)
    r = rank(preds, objective, 0.02, slo)
    assert data["recommendation"] == str(r["best"].layout) and data["ties"] == [str(p.layout) for p in r["ties"]]
    assert all({"ttft_p50_s", "ttft_p99_s", "makespan_s"} <= set(p) for p in data["predictions"])


@pytest.mark.parametrize("argv,flag", [(["--objective", "goodput"], "--ttft-slo"),
                                       (["--ttft-slo", "2x"], "--ttft-slo"), (["--tpot-slo", "-1ms"], "--tpot-slo"),
                                       (["--objective", "latency"], "--objective"),
                                       (["--tie-tolerance", "2"], "--tie-tolerance")])
def test_cli_objective_usage_errors_are_one_line(argv, flag, capsys):
    from cpattn.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and flag in err and len(err.splitlines()) == 1


def test_help_shows_objectives_refusals_and_an_example_per_objective(capsys):
    from cpattn.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for objective in ("ttft", "tpot", "throughput", "goodput"):
        assert f"--objective {objective}" in out  # an example each
    assert "--ttft-slo" in out and "--tpot-slo" in out and "tie" in out
    assert "refused" in out and "rule and fix" in out and "--layout tp=8,dcp=4" in out
