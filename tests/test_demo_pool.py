"""``cpattn demo --kv-pool``: requests through a real pool (LMDB; Mooncake served by ``cpattn pool serve``),
on 2 gloo ranks, timed honestly.

Each request is its own :func:`cpattn.engine.run_rank` (a fresh engine over the
same pool, which fetches at admission what the earlier ones stored). After a
warm-up pair (the pool's store and load paths run once before any timing),
every round times a fresh cold request (new tokens on every run: it finds
nothing) and then a warm one sharing its first whole blocks: each warm request
must load exactly the whole spans of them (``block_size * 2`` tokens on 2 DCP
ranks, the prompt's last token left to compute), and their bytes, every request must give the
single-device tokens, and the speed-up is the median [low-high] of the
per-round cold / warm ratios. A second demo run on the same directory finds
the warm-up prompt the first stored, yet its cold requests stay cold. A pool
that is asked for and serves nothing (no store answers) reports no speed-up,
says why, and fails the run (exit 1).
"""

from __future__ import annotations

import json
import socket

import pytest

from cpattn.bench import demo

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

ARGS = ["--prompt-len", "64", "--max-new-tokens", "4", "--graph-mode", "none", "--reps", "1", "--no-progress",
        "--no-eager-row"]
SHAREABLE = 2  # a 64-token prompt keeps 7/8 = 56 tokens -> 3 whole 16-token blocks shared (the 4th holds the tail),
#               of which the step loop fetches whole 32-token spans (2 DCP ranks) below the last token: 1 span, 2 blocks


@pytest.fixture(params=["lmdb", "mooncake"])
def pool(request, tmp_path):
    if request.param == "lmdb":
        yield f"lmdb:{tmp_path / 'pool'}"
        return
    from test_pool_mooncake import REASON, Served

    if REASON is not None:
        pytest.skip(f"Mooncake Store unavailable: {REASON}")
    served = Served(memory="64MiB", lease_ms=300)
    try:
        yield served.spec
    finally:
        served.stop()


def test_demo_pool_rounds_are_cold_then_warm_and_a_second_run_finds_the_warm_up(tmp_path, pool, capsys):
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert demo.main([*ARGS, "--kv-pool", pool, "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    printed = capsys.readouterr().out
    for r in runs:
        p = r["pool"]
        assert r["tokens_match"] and r["checks"]["pool"]["match"] and p["status"] == "ok"
        assert r["checks"]["pool"]["equal_tokens"] == r["checks"]["pool"]["total_tokens"] == 2 * 3 * 4
        assert p["rounds"] == 3 and len(p["cold"]) == len(p["warm"]) == 3 and len(p["warm-up"]) == 2
        assert p["shareable_blocks"] == SHAREABLE
        assert p["cold_found_blocks"] == [0, 0, 0]  # fresh tokens every round and every run: really cold
        assert all(c["blocks_stored"] == 4 for c in p["cold"])
        assert p["served_blocks"] == [SHAREABLE] * 3
        c = r["config"]  # a block: every layer's K and V rows of 16 tokens, float32
        block_bytes = c["num_hidden_layers"] * 16 * 2 * c["num_key_value_heads"] * c["head_dim"] * 4
        assert [w["bytes_loaded"] for w in p["warm"]] == [SHAREABLE * block_bytes] * 3  # each rank loads every block
        cold_prompts = [c["prompt_len"] for c in p["cold"]]
        assert cold_prompts == [64, 64, 64]
        sp = p["speedup"]
        assert sp is not None and sp["low"] <= sp["median"] <= sp["high"]
        assert p["warm-up"][1]["blocks_loaded"] == SHAREABLE  # the warm-up's second request ran the load path
    # the warm-up prompt is the same on every run: the second run's first warm-up request is already pooled
    assert runs[0]["pool"]["warm_up_found_blocks"] == 0 and runs[1]["pool"]["warm_up_found_blocks"] == SHAREABLE
    assert "cold / warm TTFT" in printed and "median [low-high] of the per-round ratios, 3 rounds" in printed
    assert "served nothing" not in printed


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_demo_pool_that_serves_nothing_fails_and_reports_no_speedup(tmp_path, capsys):
    out = tmp_path / "run.json"
    spec = f"mooncake:127.0.0.1:{_closed_port()}"
    code = demo.main([*ARGS, "--pool-rounds", "1", "--kv-pool", spec, "--json", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert code == 1 and r["ok"] is False
    assert r["tokens_match"] is True  # no pool is still the right tokens: the failure is the pool's alone
    p = r["pool"]
    assert p["status"] == "served nothing" and p["served_blocks"] == [0] and p["speedup"] is None
    assert p["unavailable"], p
    line = next(x for x in printed.splitlines() if x.startswith(f"KV pool {spec}:"))
    assert "the pool served nothing" in line and "no speed-up" in line and "faster" not in line, line
    assert p["unavailable"] in line  # why: the store's own reason
    assert f"KV pool check FAILED: --kv-pool {spec} was asked for and served no block" in printed
