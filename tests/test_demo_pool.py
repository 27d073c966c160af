"""``cpattn demo --kv-pool``: a cold and a warm request through a real pool (LMDB; Mooncake served by
``cpattn pool serve``), on 2 gloo ranks.

The warm request shares the cold one's first whole blocks: it must load them
from the pool and still give the single-device tokens (the demo checks them
against its own one-device reference); a second demo run on the same
directory finds what the first stored (its cold request is a hit too).
"""

from __future__ import annotations

import json

import pytest

from cpattn.bench import demo

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--prompt-len", "64", "--max-new-tokens", "4", "--graph-mode", "none", "--reps", "1", "--no-progress",
        "--no-eager-row"]


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


def test_demo_warm_request_loads_pooled_blocks_and_a_second_run_finds_them(tmp_path, pool):
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert demo.main([*ARGS, "--kv-pool", pool, "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    first, second = runs
    for r in runs:
        assert r["tokens_match"] and r["checks"]["pool"]["match"]
        assert r["checks"]["pool"]["equal_tokens"] == r["checks"]["pool"]["total_tokens"] == 4
        warm = r["pool"]["warm"]
        assert warm["hit_blocks"] == [3] and warm["blocks_loaded"] == 3 and warm["bytes_loaded"] > 0
    assert first["pool"]["cold"]["hit_blocks"] == [0] and first["pool"]["cold"]["blocks_stored"] == 4
    # the second run's cold request was stored by the first run: a hit (all but the block holding the last token)
    assert second["pool"]["cold"]["hit_blocks"] == [3] and second["pool"]["cold"]["blocks_loaded"] == 3
