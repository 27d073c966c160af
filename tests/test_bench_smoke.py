"""The CPU benchmarks run end to end on tiny settings and report what they claim to measure."""

import json

from cpattn.bench import comm, graph


def test_bench_comm_algorithms_agree(tmp_path, capsys):
    out = tmp_path / "comm.json"
    assert comm.main(["--sizes", "4096,2000000", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["bytes"], r["collective"]) for r in rows} == {
        (b, k) for b in (4096, 2000000) for k in comm.KINDS
    }
    for r in rows:
        assert r["max_abs_diff"] <= 1e-5 and r["native_ms"] > 0 and r["a2a_ms"] > 0, r
    assert "ratio" in capsys.readouterr().out


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


def test_bench_paged_times_every_path_and_names_the_pick():
    import torch

    from cpattn.bench import paged as bench_paged

    rows = bench_paged.run([torch.float32], [bench_paged.HEADS[1]], [8], [256], reps=1)
    (row,) = rows
    assert row["small_ms"] > 0 and row["flash_ms"] > 0 and row["traced_ms"] > 0
    assert (row["eager_pick"], row["graph_pick"]) == ("small", "traced")  # 8 rows x 256 keys x 2 x 32
    assert row["eager_vs_best"] == row["small_ms"] / min(row["small_ms"], row["flash_ms"])  # the picked path's time
