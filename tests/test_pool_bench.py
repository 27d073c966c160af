"""Smoke test of the pool's per-block micro-benchmark (no timing asserted): it round-trips and reports every pair."""

import tempfile

import pytest

from cpattn.bench import pool_blocks as bench

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")


def test_run_bench_reports_every_backend_and_block_size():
    with tempfile.TemporaryDirectory() as tmp, bench.bench_stores(["dict", "lmdb"], tmp) as (pools, specs):
        rows = bench.run_bench(pools, block_sizes=(4, 8), num_layers=2, row_width=16, blocks=3, samples=2)
        assert set(specs) == {"lmdb"}
    assert [(r["backend"], r["block_size"]) for r in rows] == [("dict", 4), ("dict", 8), ("lmdb", 4), ("lmdb", 8)]
    assert all(r["store_best_ms"] > 0 and r["load_best_ms"] > 0 and r["load_spread"] >= 0 for r in rows)
    assert rows[2]["block_bytes"] == 79 + 2 * 4 * 16 * 2 + 4  # header + bf16 [layers, block, width] + crc
    lines = bench.table(rows).splitlines()
    assert lines[0].split()[:3] == ["backend", "block", "MiB/blk"] and len(lines) == 6  # header, rule, 4 rows


def test_old_module_path_warns_and_is_the_new_module():
    import importlib
    import sys

    sys.modules.pop("cpattn.pool.bench", None)
    with pytest.warns(DeprecationWarning, match="cpattn.pool.bench moved to cpattn.bench.pool_blocks"):
        old = importlib.import_module("cpattn.pool.bench")
    assert old.run_bench is bench.run_bench and old.bench_stores is bench.bench_stores
    assert old._dict_pool is bench._dict_pool  # private names read through
