"""Smoke test of the pool micro-benchmark (no timing asserted): it runs, round-trips, and reports every pair."""

import json

import pytest

from cpattn.pool import bench

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")


def test_bench_main_reports_every_backend_and_block_size(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--backends", "dict,lmdb", "--block-sizes", "4,8", "--layers", "2", "--row-width", "16",
                       "--blocks", "3", "--samples", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["block_size"]) for r in rows] == [("dict", 4), ("dict", 8), ("lmdb", 4), ("lmdb", 8)]
    assert all(r["store_best_ms"] > 0 and r["load_best_ms"] > 0 and r["load_spread"] >= 0 for r in rows)
    assert rows[2]["block_bytes"] == 79 + 2 * 4 * 16 * 2 + 4
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("backend") and len(printed.splitlines()) == 5
