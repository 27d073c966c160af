"""``cpattn bench v4`` on tiny sizes: its exact KV-bytes table, its timed parts on a simulated mesh (no process
start-up), and its usage errors. No timing is asserted: only that every row reports a ratio with its spread."""

from __future__ import annotations

import pytest

import cpattn
from cpattn.bench import v4 as bench
from cpattn.v4.kv_bytes import kv_bytes_table

pytestmark = pytest.mark.usefixtures("one_thread")


def test_kv_rows_are_the_exact_table_and_shard_the_entries():
    rows = bench.kv_rows((65536, 1048576), 2)
    for row, want in zip(rows, kv_bytes_table((65536, 1048576))):
        assert {k: row[k] for k in want} == want
        parts = row["v4_parts_bytes"]
        assert sum(parts.values()) == row["v4"]
        sharded = parts["csa_entries"] + parts["csa_index_keys"] + parts["hca_entries"]
        assert row["v4_per_rank_dcp2"] == sharded // 2 + parts["window"] + parts["compressor_state"]  # rings stay
        assert row["v32_per_rank_dcp2"] * 2 == row["v32"]
    assert "identical" in bench.sources()["checked"]


@pytest.mark.slow
def test_timed_parts_report_ratios_with_spreads():
    cfg = {"decode": {"context": 200, "batch": 2, "dtypes": ["float32"], "reps": 1},
           "prefill": {"tokens": 128, "heads": 2, "index_heads": 2, "topk": 8, "dtype": "float32", "reps": 1}}
    res = cpattn.simulate(2, bench.timed_rank, cfg)
    dec = bench.decode_rows([r["decode"] for r in res], 200, 2, ["float32"], 2)
    pre = bench.prefill_rows([r["prefill"] for r in res], cfg["prefill"], 2)
    assert [r["kind"] for r in dec] == ["csa", "hca"] and [r["kind"] for r in pre] == ["sliding", "csa", "hca"]
    for r in dec + pre:
        s = r["speedup"]
        assert s["low"] <= s["median"] <= s["high"], r
    assert all(r["bytes_sent_per_rank"] > 0 for r in dec)  # the candidate exchange and the merge
    assert set(pre[1]["bytes_sent_per_rank"]) == {"all_gather", "ring"}  # CSA: halos and the entry gather


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--pcp", "1"])
    assert e.value.code == 2 and "at least 2" in capsys.readouterr().err
