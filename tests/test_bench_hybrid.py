"""``cpattn bench hybrid``: every row present, finite times, the byte counts equal a hand count from the config,
tokens checked equal across layouts; its usage errors are one line, exit 2, before any rank starts."""

from __future__ import annotations

import json
import math

import pytest

from cpattn.bench import hybrid


def _hand(cfg, tokens: int, itemsize: int) -> dict[str, int]:
    """Per layer, what one of 2 PCP ranks sends, counted here from the config (not hybrid.hand_bytes)."""
    # the scan: 2 head-tail parts per rank, each a [Hv, Dk, Dk + Dv] float32 summary, all-gathered to 1 peer
    state = 2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * (
        cfg.linear_key_head_dim + cfg.linear_value_head_dim) * 4
    # the conv halo: per part the last K - 1 inputs of q | k | v plus a valid-flag column, in the model's dtype
    channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * \
        cfg.linear_value_head_dim
    halo = 2 * (cfg.linear_conv_kernel_dim - 1) * (channels + 1) * itemsize
    # the ring: this rank's tokens' K and V rows, sent once to the other rank
    kv = tokens // 2 * cfg.num_key_value_heads * 2 * cfg.head_dim * itemsize
    return {"state exchange (summaries)": state, "conv halos": halo, "attention KV (ring)": kv}


@pytest.mark.slow
def test_quick_json_run_has_every_row_finite_times_and_hand_counted_bytes(capsys):
    rc = hybrid.main(["--quick", "--json", "-"])
    out = capsys.readouterr()
    assert rc == 0
    data = json.loads(out.out)  # pure JSON on stdout; the text report went to stderr
    assert "Prefill TTFT" in out.err and "Decode TPOT" in out.err
    cfg = hybrid.bench_config()
    assert (data["config"]["prefill"], data["config"]["context"]) == (2048, 4096)
    dtypes = ["float32", "bfloat16"]
    for part in ("prefill", "scan", "decode"):
        assert [r["dtype"] for r in data[part]] == dtypes, part
    for r in data["prefill"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("one_s", "pcp_s"))
        assert math.isfinite(r["ratio"]["median"]) and r["ratio"]["low"] <= r["ratio"]["median"] <= r["ratio"]["high"]
        assert sorted(name for _, name in r["order"]) == ["one", "one", "pcp", "pcp"]
    f32 = data["prefill"][0]
    assert f32["token_equal"] is True and f32["logits_rel"] <= 1e-4  # fp32: PCP's first logits = one rank's
    for r in data["scan"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("plain_full_ms", "plain_half_ms", "scan_ms"))
    for r in data["decode"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("one_ms", "dcp_ms"))
        assert r["kv_bytes_rank"] < r["kv_bytes_one"] and r["state_bytes"] > 0  # KV sharded, states replicated
    assert data["decode"][0]["token_equal"] is True
    n_lin, n_full = cfg.layer_types.count("linear_attention"), cfg.layer_types.count("full_attention")
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        rows = {r["what"]: r for r in data["bytes"] if r["dtype"] == dtype}
        n = data["config"]["prefill_by_dtype"][dtype]
        assert n == 2048 and [r["tokens"] for r in data["prefill"] if r["dtype"] == dtype] == [n]
        hand = _hand(cfg, n, itemsize)
        for what, per in hand.items():
            layers = n_full if what.startswith("attention") else n_lin
            assert rows[what]["bytes_per_layer"] == per and rows[what]["bytes"] == per * layers, (dtype, what)
        total = rows["prefill total (by collective)"]
        sent = total["by_collective"]
        assert sent["ring"] == hand["attention KV (ring)"] * n_full
        assert sent["all_gather"] == (hand["state exchange (summaries)"] + hand["conv halos"]) * n_lin
        assert total["bytes"] == sum(sent.values())


@pytest.mark.parametrize("argv,flag", [(["--dtypes", "float16"], "--dtypes"),
                                       (["--prefill-tokens", "6"], "--prefill-tokens"),
                                       (["--ranks", "1"], "--ranks")])
def test_usage_errors_are_one_line_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        hybrid.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"argument {flag}: saw" in err[0], err


def test_hand_bytes_match_the_tests_own_count():
    cfg = hybrid.bench_config()
    got = hybrid.hand_bytes(cfg, 16384, 2, 2)
    want = _hand(cfg, 16384, 2)
    assert (got["state"], got["halo"], got["kv"]) == tuple(want.values())
