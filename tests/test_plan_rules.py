"""cpattn.plan prices only layouts the engine accepts: the one rule check is EngineConfig.create, and a refused
layout is reported with its rule and fix (API, table and --json -)."""

import json

import pytest

from cpattn.config import ConfigError, EngineConfig
from cpattn.plan import Layout, get_model, get_profile, layouts, predict
from cpattn.plan.rules import engine_fields, layout_problems, layout_space

# the layouts, each broken by a rule EngineConfig enforces
REFUSED = [("deepseek-r1", Layout(8, 1, 3)), ("deepseek-r1", Layout(4, 1, 8)),
           ("qwen3-235b-a22b", Layout(8, 1, 4)), ("qwen3-235b-a22b", Layout(2, 1, 2))]


def _engine_problems(spec, lay):
    try:
        EngineConfig.create(**engine_fields(spec, lay))
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("name,lay", REFUSED, ids=lambda x: str(x))
def test_predict_refuses_what_the_engine_refuses(name, lay):
    spec = get_model(name)
    with pytest.raises(ConfigError) as e:
        predict(spec, get_profile("h200"), lay, context=131072, batch=1)
    assert e.value.problems == _engine_problems(spec, lay) != []
    line = e.value.problems[0]
    assert line.startswith("dcp_size: saw") and "; rule: " in line and "; fix: " in line


def test_the_check_is_the_engines_own(monkeypatch):
    # not a copy of the rules: make the engine refuse every layout, and the planner refuses them too
    def refuse(cls, **flat):
        raise ConfigError("EngineConfig", ["tp_size: saw anything; rule: the engine's; fix: none"])

    monkeypatch.setattr(EngineConfig, "create", classmethod(refuse))
    spec = get_model("deepseek-r1")
    with pytest.raises(ConfigError, match="the engine's"):
        predict(spec, get_profile("h200"), Layout(8), context=1024, batch=1)
    assert layouts(spec, 8) == []


def test_layout_space_splits_candidates_by_the_engine():
    for name in ("deepseek-r1", "qwen3-235b-a22b", "glm-5"):
        spec = get_model(name)
        ok, refused = layout_space(spec, 8)
        assert ok and all(_engine_problems(spec, lay) == [] for lay in ok)
        assert all(list(r.problems) == _engine_problems(spec, r.layout) for r in refused)
        assert all(lay.tp * lay.pcp == 8 for lay in ok + [r.layout for r in refused])
    qwen = {str(r.layout) for r in layout_space(get_model("qwen3-235b-a22b"), 8)[1]}
    assert "tp=8 pcp=1 dcp=4" in qwen and "tp=8 pcp=1 dcp=8" in qwen
    # the engine's opt-in prices PCP with DCP (and only then are such layouts candidates)
    both = layout_space(get_model("deepseek-r1"), 8, allow_pcp_with_dcp=True)[0]
    assert Layout(4, 2, 2) in both and Layout(4, 2, 2) not in layouts(get_model("deepseek-r1"), 8)
    assert layout_problems(get_model("deepseek-r1"), Layout(4, 2, 2))


def _run(argv, capsys):
    from cpattn.plan.cli import main

    code = main(argv)
    return code, capsys.readouterr()


def test_cli_reports_refused_layouts_in_table_and_json(capsys):
    argv = ["--model", "qwen3-235b-a22b", "--context", "8192", "--devices", "8"]
    code, out = _run(argv, capsys)
    assert code == 0 and "refused by the engine's rules" in out.out
    line = next(x for x in out.out.splitlines() if x.strip().startswith("- tp=8 pcp=1 dcp=4:"))
    assert "GQA models need" in line and "fix: use dcp_size in [2, 1]" in line
    code, out = _run([*argv, "--json", "-"], capsys)
    data = json.loads(out.out)
    refused = {r["name"]: r for r in data["refused"]}
    assert refused["tp=8 pcp=1 dcp=4"]["rules"][0].startswith("GQA models need")
    assert refused["tp=8 pcp=1 dcp=4"]["fixes"][0].startswith("use dcp_size in [2, 1]")
    assert {p["layout"]["dcp"] for p in data["predictions"] if p["layout"]["tp"] == 8} == {1, 2}


def test_cli_layout_flag_prices_the_accepted_and_reports_the_refused(capsys):
    code, out = _run(["--model", "deepseek-r1", "--context", "8192", "--layout", "tp=8,dcp=2",
                      "--layout", "tp=8,dcp=3", "--json", "-"], capsys)
    data = json.loads(out.out)
    assert code == 0 and [p["layout"]["dcp"] for p in data["predictions"]] == [2]
    assert data["refused"][0]["name"] == "tp=8 pcp=1 dcp=3" and "tp_size % dcp_size" in data["refused"][0]["rules"][0]


@pytest.mark.parametrize("argv,words", [
    (["--model", "deepseek-r1", "--layout", "tp=8,dcp=3"], ("--layout", "dcp_size", "fix: use dcp_size in [2, 4, 1]")),
    (["--model", "qwen3-235b-a22b", "--layout", "tp=2,dcp=2"], ("--layout", "GQA models need", "fix:")),
    (["--layout", "tp=8,dcq=3"], ("--layout", "tp=, pcp=, dcp=", "fix: e.g.")),
    (["--layout", "pcp=2"], ("--layout", "tp= is required",)),
])
def test_cli_refused_or_bad_layout_is_one_line_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        _run(argv, capsys)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert all(w in err for w in words), err
