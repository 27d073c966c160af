"""cpattn plan validate reports, beside each predicted PCP / DCP ratio, what the naive 1/P guess says and its error."""

import json

from cpattn.bench.perf.validate import table


def test_table_prices_the_naive_guess_against_the_measurement():
    rows = table([("pcp", 0.55, 0.6, 0.5), ("dcp", 0.7, 0.5, 0.5), ("graph", 2.0, 2.1)])
    assert abs(rows[0]["naive_error"] - 0.1 / 0.6) < 1e-12 and rows[0]["within_15%"] and not rows[0]["naive_within_15%"]
    assert rows[1]["naive_error"] == 0.0 and not rows[1]["within_15%"]
    assert rows[2]["naive"] is None and rows[2]["naive_error"] is None


def test_cli_validate_shows_the_naive_column(tmp_path, capsys):
    from cpattn.bench.perf.cli import main

    bench = {"spec": {"seq_lens": [4096], "heads": 16, "kv_heads": 16, "head_dim": 128}, "world_size": 2,
             "rows": [{"method": "ring", "vs_one_rank": 0.6, "cpu_vs_one_rank": 0.55}]}
    path = tmp_path / "pcp.json"
    path.write_text(json.dumps(bench))
    assert main(["validate", "--profile", "cpu", "--pcp-json", str(path), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows, keep = data["rows"], data["earns_keep"]
    assert keep["break_even"] is None or keep["break_even"] % 64 == 0
    pcp = rows[0]
    assert pcp["measured"] == 0.6 and pcp["naive"] == 0.5 and abs(pcp["naive_error"] - 0.1 / 0.6) < 1e-12
    assert all(r["naive"] == 0.5 for r in rows if r["what"].startswith("bench dcp"))
    assert main(["validate", "--profile", "cpu", "--pcp-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "naive_error" in out and "naive 1/P guess (PCP and DCP rows): within 15% on 0 of 1" in out
    assert keep["line"] in out and "where the model earns its keep" in out


def test_where_the_model_earns_its_keep_names_the_rows_that_depart_from_one_over_p():
    from cpattn.bench.perf.validate import where_the_model_earns_its_keep

    rows = table([("dcp merge-bound", 0.9, 0.85, 0.5), ("dcp merge-bound, unmeasured", 0.8, None, 0.5),
                  ("pcp near 1/P", 0.52, 0.6, 0.5), ("dcp wrong", 0.9, 0.5, 0.5), ("graph", 2.0, 2.1)])
    k = where_the_model_earns_its_keep(rows, 2048)
    assert k["departs"] == ["dcp merge-bound", "dcp merge-bound, unmeasured", "dcp wrong"]
    assert (k["measured"], k["model_right"], k["naive_right"]) == (2, 1, 1)
    assert "3 of 4 PCP / DCP rows" in k["line"] and "from 2048 tokens" in k["line"]
    assert "never wins" in where_the_model_earns_its_keep(rows, None)["line"]
