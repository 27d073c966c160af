"""scripts/bench_sbs.py: the field-by-field comparison of two benchmark payloads (its runs are not tested here)."""

import doctest
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_sbs.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_sbs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doctests_pass():
    res = doctest.testmod(_module())
    assert res.attempted >= 4 and res.failed == 0


def test_compare_reports_keys_ints_and_time_ratios():
    m = _module()
    base = {"rows": [{"ttft_ms": 10.0, "bytes": 100, "equal": True}, {"one_s": 0.0, "bytes": 5}], "note": "a"}
    head = {"rows": [{"ttft_ms": 15.0, "bytes": 100, "equal": False}, {"one_s": 2.0, "bytes": 6}], "extra": 1}
    c = m.compare(base, head)
    assert not c["same_keys"] and c["only_base"] == ["note"] and c["only_head"] == ["extra"]
    assert c["ints"] == 3 and sorted(c["ints_differ"]) == ["rows[0].equal: True -> False", "rows[1].bytes: 5 -> 6"]
    assert c["time_ratios"] == [1.5]  # the 0-second base is skipped, never divided by
    same = m.compare(base, base)
    assert same["same_keys"] and not same["ints_differ"] and same["time_ratios"] == [1.0]


def test_bad_base_is_a_usage_error(capsys):
    assert _module().main(["--base", "no-such-revision-xyz", "pcp"]) == 2
    assert "--base no-such-revision-xyz" in capsys.readouterr().err
