"""cpattn plan validate reports, beside each predicted PCP / DCP ratio, what the naive 1/P guess says and its error."""

import json

from cpattn.plan.validate import table


def test_table_prices_the_naive_guess_against_the_measurement():
    rows = table([("pcp", 0.55, 0.6, 0.5), ("dcp", 0.7, 0.5, 0.5), ("graph", 2.0, 2.1)])
    assert abs(rows[0]["naive_error"] - 0.1 / 0.6) < 1e-12 and rows[0]["within_15%"] and not rows[0]["naive_within_15%"]
    assert rows[1]["naive_error"] == 0.0 and not rows[1]["within_15%"]
    assert rows[2]["naive"] is None and rows[2]["naive_error"] is None


def test_cli_validate_shows_the_naive_column(tmp_path, capsys):
    from cpattn.plan.cli import main

    bench = {"spec": {"seq_lens": [4096], "heads": 16, "kv_heads": 16, "head_dim": 128}, "world_size": 2,
             "rows": [{"method": "ring", "vs_one_rank": 0.6, "cpu_vs_one_rank": 0.55}]}
    path = tmp_path / "pcp.json"
    path.write_text(json.dumps(bench))
    assert main(["validate", "--profile", "cpu", "--pcp-json", str(path), "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    pcp = rows[0]
    assert pcp["measured"] == 0.6 and pcp["naive"] == 0.5 and abs(pcp["naive_error"] - 0.1 / 0.6) < 1e-12
    assert all(r["naive"] == 0.5 for r in rows if r["what"].startswith("bench dcp"))
    assert main(["validate", "--profile", "cpu", "--pcp-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "naive_error" in out and "naive 1/P guess (PCP and DCP rows): within 15% on 0 of 1" in out
