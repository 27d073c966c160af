"""The CPU benchmarks run end to end on tiny settings and report what they claim to measure."""

import json

import pytest

from cpattn.bench import comm, graph


@pytest.mark.slow
def test_bench_comm_algorithms_agree(tmp_path, capsys):
    out = tmp_path / "comm.json"
    assert comm.main(["--sizes", "4096,2000000", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["bytes"], r["collective"]) for r in rows} == {
        (b, k) for b in (4096, 2000000) for k in comm.KINDS
    }
    for r in rows:
        assert r["max_abs_diff"] <= 1e-5 and r["native_ms"] > 0 and r["a2a_ms"] > 0, r
        assert r["ratio_low"] <= r["ratio"] <= r["ratio_high"], r  # a ratio comes with its spread
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_graph_replays_every_timed_step(tmp_path):
    out = tmp_path / "graph.json"
    argv = ["--layers", "1", "--batches", "2", "--context", "16", "--reps", "2", "--backend", "aot_eager",
            "--json", str(out)]
    assert graph.main(argv) == 0
    res = json.loads(out.read_text())
    for rank in res["cpu"]:
        (row,) = rank["rows"]
        assert row["batch"] == 2 and row["eager_ms"] > 0 and row["graph_ms"] > 0 and row["comm_ms"] > 0
        assert rank["compiles"] == 1 and rank["stats"]["eager"] == 1  # one prefill, then only replays
        assert rank["stats"]["sizes"] == {"2": rank["stats"]["graph"]}


@pytest.mark.slow
def test_bench_paged_times_every_path_and_names_the_pick():
    import torch

    from cpattn.bench import paged as bench_paged

    rows = bench_paged.run([torch.float32], [bench_paged.HEADS[1]], [8], [256], reps=1)
    (row,) = rows
    assert row["small_ms"] > 0 and row["flash_ms"] > 0 and row["traced_ms"] > 0
    assert (row["eager_pick"], row["graph_pick"]) == ("small", "traced")  # 8 rows x 256 keys x 2 x 32
    assert row["eager_vs_best"] == row["small_ms"] / min(row["small_ms"], row["flash_ms"])  # the picked path's time


def test_ratios_never_divide_by_a_zero_time():
    import math

    from cpattn.bench.common import Samples, ratio, safe_div

    r = ratio(Samples((1.0, 2.0)), Samples((0.0, 1.0)))  # a zero time gives NaN, never ZeroDivisionError
    assert math.isnan(safe_div(1.0, 0.0)) and math.isnan(r.best) and r.low == r.high == 2.0
    assert ratio(Samples((2.0, 4.0, 3.0)), Samples((1.0, 2.0, 1.0))).as_dict() == {
        "best": 2.0, "low": 2.0, "median": 2.0, "high": 3.0}


def test_measure_interleaves_rounds_and_takes_the_slowest_rank():
    import torch

    import cpattn
    from cpattn.bench.common import measure

    order = []

    def rank_fn(group):
        fns = {n: (lambda n=n: order.append((group.rank, n))) for n in "abc"}
        if group.rank == 1:
            fns["a"] = lambda: torch.ones(1 << 16).cumsum(0)  # rank 1 is the slow one for "a"
        return measure(fns, reps=3, group=group, warmup=0)

    s0, s1 = cpattn.simulate(2, rank_fn)
    assert s0["a"].wall == s1["a"].wall  # both ranks see the slowest rank's samples
    assert [n for r, n in order if r == 0] == list("abc" "bca" "cab")  # round i starts with function i


@pytest.mark.slow
def test_bench_dcp_tiny_run_reports_ratios_with_spread_and_constant_merge_bytes(tmp_path, capsys):
    from cpattn.bench import dcp

    out = tmp_path / "dcp.json"
    argv = ["--contexts", "256,512", "--batch", "1", "--reps", "2", "--dtype", "fp32", "--block-size", "16",
            "--cp-kv-cache-interleave-size", "16", "--model-context", "64", "--no-model-graph", "--json", str(out)]
    assert dcp.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = [r for r in rows if "ratio" in r]
    assert timed and all(r["ratio"]["low"] <= r["ratio"]["median"] <= r["ratio"]["high"] for r in timed)
    merges = {r["context"]: r["merge"] for r in rows if r["metric"] == "bytes_sent_ag_rs"}
    assert merges[256] == merges[512] > 0
    printed = capsys.readouterr().out
    assert "independent of context length" in printed
    steps = {r["variant"]: r for r in rows if r["metric"] == "model_step"}  # the demo model's step per variant
    assert [steps[v]["collectives_per_layer"] for v in ("ag_rs", "a2a", "local_a2a", "local_ag")] == [4, 3, 2, 1]


@pytest.mark.slow
def test_bench_dsa_cp_prefill_tiny_run_has_spreads_and_exact_work():
    from cpattn.bench import dsa

    rows = dsa.cp_prefill(n_tok=64, heads=2, h_i=2, topk=16, reps=2, tp=2, timeout_s=60)
    assert [(r["ranks"], r["split"]) for r in rows] == [(1, "-"), (2, "contiguous"), (2, "balanced")]
    for r in rows:
        assert r["speedup_low"] <= r["speedup"] <= r["speedup_high"] and r["time_s"] > 0, r
    assert rows[2]["indexer_imbalance"] == 1.0 and rows[1]["indexer_imbalance"] > 1.0  # head-tail balances


@pytest.mark.slow
def test_bench_pool_ttft_on_lmdb(tmp_path):
    """The pool benchmark's engine part on LMDB at tiny sizes: the warm request finds 7/8 of its prompt."""
    from cpattn.bench import pool

    rows = {r["ranks"]: r for r in pool.ttft_rows({"lmdb": f"lmdb:{tmp_path}"}, 256, hidden=64, layers=1, reps=1,
                                                    timeout_s=120)}
    assert set(rows) == {1, 2}
    for r in rows.values():
        assert r["shared"] == 224 and r["hit_blocks"] == 224 // pool.BLOCK
        assert r["stored_bytes_per_rank"] > 0 and r["cold_ms"] > 0 and r["warm_ms"] > 0


@pytest.mark.slow
def test_bench_mlapo_times_both_paths_with_equal_logits(tmp_path):
    from cpattn.bench import mlapo

    out = tmp_path / "mlapo.json"
    assert mlapo.main(["--quick", "--layers", "1", "--reps", "1", "--dcp-sizes", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dcp"], r["mode"]) for r in rows] == [(1, "eager"), (1, "graph")]
    for r in rows:  # fusing changes no rounding: the fused step's logits are the unfused step's
        assert r["bitwise_equal_logits"] and r["fused_ms"]["best"] > 0 and r["unfused_ms"]["best"] > 0
        x = r["fused_over_unfused"]
        assert x["low"] <= x["median"] <= x["high"]


@pytest.mark.slow
def test_bench_pcp_compares_with_pytorchs_ring_on_both_clocks(tmp_path):
    from cpattn.bench import pcp

    out = tmp_path / "pcp.json"
    argv = ["--seq-lens", "256", "--heads", "2", "--kv-heads", "2", "--head-dim", "16", "--reps", "1",
            "--model-prompt-len", "0", "--no-breakdown", "--no-progress", "--json", str(out)]
    assert pcp.bench_main(argv) == 0
    res = json.loads(out.read_text())
    peer = res["ring_vs_torch_ring"]
    assert peer["peer"].startswith("torch-ring") and peer["cpu"]["peer"].startswith("torch-ring")
    assert peer["low"] <= peer["median"] <= peer["high"] and peer["cpu"]["low"] <= peer["cpu"]["high"]
    assert res["targets_apply"] is False  # the targets are for 8K tokens, MHA 16 x 128, fp32
    assert res["max_abs_err_vs_single_rank"] <= 1e-5 * max(1.0, res["output_max_abs"])
