"""The benchmark harness: interleaved rounds (order recorded), median [low-high], no division by a zero time,
``--json -`` purity (stdout is JSON alone; report and progress on stderr)."""

import json
import math

from cpattn.bench import harness
from cpattn.bench.common import Samples


def test_compare_interleaves_rounds_and_records_the_order_it_ran():
    ran = []
    fns = {n: (lambda n=n: ran.append(n)) for n in "ABC"}
    c = harness.compare(fns, reps=3, inner=2, warmup=1)
    expected = [(0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"), (2, "C"), (2, "A"), (2, "B")]
    assert c.order == expected  # round i starts with variant i: never all-A, then all-B
    assert ran[:3] == list("ABC")  # one warmup call each, then `inner` back-to-back calls per sample
    assert ran[3:] == [n for _, n in expected for _ in range(2)]
    assert all(len(s.wall) == len(s.cpu) == 3 for s in c.samples.values())


def test_spread_and_ratio_are_median_low_high_of_fixed_samples():
    s = harness.spread([0.5, 0.1, 0.3, 0.2, 0.4])
    assert (s.low, s.median, s.high) == (0.1, 0.3, 0.5) and str(s) == "0.3 [0.1-0.5]"
    c = harness.Comparison({"a": Samples((2.0, 6.0, 3.0), (1.0, 1.0, 1.0)),
                            "b": Samples((1.0, 2.0, 1.0), (4.0, 2.0, 1.0))})
    r = c.ratio("a", "b")  # per round: 2, 3, 3 -- paired samples, not median(a) / median(b) = 1.5
    assert (r.low, r.median, r.high, r.best) == (2.0, 3.0, 3.0, 2.0)
    cpu = c.ratio("a", "b", clock="cpu")  # CPU-time ratio from the same rounds: 0.25, 0.5, 1
    assert (cpu.low, cpu.median, cpu.high) == (0.25, 0.5, 1.0)


def test_a_zero_time_is_never_divided_by():
    c = harness.Comparison({"a": Samples((1.0, 2.0, 3.0), (0.0, 0.0, 0.0)),
                            "b": Samples((0.0, 1.0, 1.0), (0.0, 0.0, 0.0))})
    r = c.ratio("a", "b")  # round 0's denominator is 0: left out, no ZeroDivisionError
    assert (r.low, r.median, r.high) == (2.0, 2.5, 3.0) and math.isnan(r.best)
    assert all(math.isnan(x) for x in c.ratio("a", "b", clock="cpu").as_dict().values())
    p = harness.paired([1.0, 2.0], [0.0, 0.0])
    assert all(math.isnan(x) for x in p.as_dict().values())


def _toy_main(argv):
    p = harness.parser("cpattn bench toy", "A toy benchmark.", quick="two rounds")
    args = p.parse_args(argv)
    with harness.Report(args) as out:
        out.progress("timing a and b")
        c = harness.compare({"a": lambda: sum(range(200)), "b": lambda: sum(range(100))}, reps=2 if args.quick else 4)
        rows = [{"variant": n, "ms": 1e3 * s.median} for n, s in c.samples.items()]
        out.line(f"toy, a / b = {c.ratio('a', 'b')}")
        print("a stray print")  # a benchmark's own print goes where the report goes
        out.table(rows, ["variant", "ms"])
        out.payload = {"rows": rows, "order": c.order}
    return 0


def test_json_dash_puts_only_json_on_stdout_and_the_report_and_progress_on_stderr(capsys):
    assert _toy_main(["--quick", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    payload = json.loads(out)  # the whole of stdout is one JSON document
    assert [r["variant"] for r in payload["rows"]] == ["a", "b"] and len(payload["order"]) == 4
    assert "... timing a and b" in err and "toy, a / b =" in err and "a stray print" in err
    assert err.splitlines()[-4].split() == ["variant", "ms"]  # the table: header, rule, two rows


def test_without_json_the_report_is_on_stdout_and_progress_on_stderr(capsys, tmp_path):
    path = tmp_path / "toy.json"
    assert _toy_main(["--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "toy, a / b =" in out and "variant" in out and "timing" not in out
    assert "... timing a and b" in err
    assert len(json.loads(path.read_text())["order"]) == 8
