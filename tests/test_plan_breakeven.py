"""plan.pcp_break_even: the prompt length above which PCP lowers one request's TTFT versus one rank; and
`cpattn plan calibrate` never replaces an existing profile unless asked."""

import dataclasses
import json

import pytest

from cpattn.config import ConfigError
from cpattn.plan import Layout, get_model, get_profile, pcp_break_even
from cpattn.plan.breakeven import bench_break_even, pcp_ttfts
from cpattn.plan.profiles import CPU_DEFAULT, Link, load_profile
from cpattn.plan.bench_model import predict_pcp

H200 = get_profile("h200")


@pytest.mark.parametrize("name,lay", [("deepseek-r1", Layout(8, 2)), ("qwen3-235b-a22b", Layout(1, 8)),
                                      ("deepseek-v3.2", Layout(4, 2))])
def test_break_even_is_where_pcp_starts_to_win(name, lay):
    spec = get_model(name)
    n = pcp_break_even(spec, lay, H200)
    assert n is not None and n % 64 == 0
    pcp, one = pcp_ttfts(spec, H200, lay, n)
    assert pcp < one
    if n > 64:
        pcp, one = pcp_ttfts(spec, H200, lay, n - 64)
        assert pcp >= one
    for longer in (4 * n, 64 * n):  # and keeps winning
        pcp, one = pcp_ttfts(spec, H200, lay, longer)
        assert pcp < one


def test_a_slower_link_moves_the_break_even_up():
    spec, lay = get_model("deepseek-r1"), Layout(4, 2)  # one node: the PCP ring on the intra link
    slow = dataclasses.replace(H200, links={**H200.links, "intra": Link(alpha=1e-3, beta=H200.links["intra"].beta)})
    assert pcp_break_even(spec, lay, slow) > 4 * pcp_break_even(spec, lay, H200)
    never = dataclasses.replace(H200, links={**H200.links, "intra": Link(alpha=10.0, beta=1e9)})
    assert pcp_break_even(spec, lay, never, max_tokens=1 << 16) is None


def test_break_even_goes_through_the_rules():
    with pytest.raises(ConfigError, match="dcp_size"):  # PCP with DCP: refused by the engine
        pcp_break_even("qwen3-235b-a22b", Layout(8, 2, 2), "h200")
    with pytest.raises(ValueError, match="pcp >= 2"):
        pcp_break_even("deepseek-r1", Layout(8), "h200")


def test_bench_break_even_matches_the_bench_prediction():
    prof = dataclasses.replace(CPU_DEFAULT, links={**CPU_DEFAULT.links, "ring": Link(alpha=5e-2, beta=1.5e9)})
    n = bench_break_even(prof)
    assert n is not None and n > 64
    ratio = lambda s: predict_pcp(prof, seq=s, heads=32, kv_heads=8, head_dim=128)["ratio"]  # noqa: E731
    assert ratio(n) < 1 <= ratio(n - 64)


def test_cli_prints_the_break_even_per_pcp_layout(capsys):
    from cpattn.plan.cli import main

    assert main(["--model", "deepseek-r1", "--input-len", "8192", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = get_model("deepseek-r1")
    assert data["pcp_break_even"]["tp=4 pcp=2 dcp=1"] == pcp_break_even(spec, Layout(4, 2), H200)
    assert all("pcp=1 " not in k for k in data["pcp_break_even"])


# ----------------------------------------------------------------------------- calibrate never overwrites
@pytest.fixture
def default_profile(tmp_path, monkeypatch):
    import cpattn.bench.perf.calibrate as cal
    import cpattn.plan.profiles as profiles

    path = tmp_path / "cache" / "cpu_profile.json"
    monkeypatch.setattr(profiles, "CPU_PROFILE_PATH", str(path))
    calls = []
    monkeypatch.setattr(cal, "calibrate", lambda **kw: calls.append(kw) or dataclasses.replace(CPU_DEFAULT,
                                                                                               device="fitted"))
    return path, calls


def test_calibrate_refuses_to_replace_the_default_profile(default_profile, capsys):
    from cpattn.bench.perf.cli import main

    path, calls = default_profile
    path.parent.mkdir()
    path.write_text("{}")  # another process's profile
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--quick"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--force" in err and "--out" in err
    assert path.read_text() == "{}" and calls == []  # refused before any work
    assert main(["calibrate", "--quick", "--force"]) == 0
    assert load_profile(str(path)).device == "fitted" and len(calls) == 1


def test_calibrate_writes_a_missing_default_or_an_explicit_out(default_profile, tmp_path, capsys):
    from cpattn.bench.perf.cli import main

    path, calls = default_profile
    assert main(["calibrate", "--quick"]) == 0 and load_profile(str(path)).device == "fitted"
    other = tmp_path / "mine.json"
    other.write_text("{}")
    assert main(["calibrate", "--quick", "--out", str(other)]) == 0  # --out names the file: asked
    assert load_profile(str(other)).device == "fitted"
    assert "PCP break-even of `cpattn bench pcp`" in capsys.readouterr().out
