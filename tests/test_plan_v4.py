"""The planner's DeepSeek-V4 entry: shapes read through the family's own from_hf, costs counted per layer kind,
and the vLLM DeepSeek-V4 PCP2 anchor (vLLM #43809)."""

import json
import random

import pytest

from cpattn.models.deepseek_v4_config import DeepseekV4Config
from cpattn.plan.families import DEEPSEEK_V4_FLASH, spec_from_v4
from cpattn.plan.specs import get_model


def test_v4_flash_is_a_builtin_read_through_the_family_from_hf():
    spec = get_model("deepseek-v4-flash")
    cfg = DeepseekV4Config.from_hf(DEEPSEEK_V4_FLASH)
    assert spec.attention == "v4" and spec.layer_kinds == cfg.layer_types and spec.window == cfg.sliding_window
    assert (spec.layers, spec.hidden, spec.heads, spec.head_dim) == (43, 4096, 64, 512)
    assert spec.layer_kinds[:2] == ("sliding", "sliding") and spec.layer_kinds[2:4] == ("csa", "hca")
    assert round(spec.total_params() / 1e9) == 284  # the release: 284B total
    assert round(spec.active_params_per_token() / 1e9) == 13  # and 13B activated
    assert get_model("DeepSeek-V4-Flash", weights="bf16").weights == "bf16"


def test_v4_parameter_count_equals_the_family_tensors():
    import torch

    import cpattn.engine  # noqa: F401 (the V4 family imported in the engine's order)
    from cpattn.models.deepseek_v4 import init_params

    cfg = DeepseekV4Config.tiny()
    params = init_params(cfg, dtype=torch.float32)
    skip = ("position_bias", "tid2eid", "hc_head.")  # small per-position / lookup tensors the planner leaves out
    counted = sum(t.numel() for k, t in params.items() if t.dim() >= 2 and not any(s in k for s in skip))
    assert spec_from_v4(cfg, name="tiny").total_params() == counted


def test_v4_kv_bytes_per_token_follow_the_layer_kinds():
    spec = get_model("deepseek-v4-flash")  # fp8 KV
    by_hand = sum({"sliding": 0.0, "csa": (512 + 128 + 4) / 4, "hca": 512 / 128}[k] for k in spec.layer_kinds)
    assert spec.layers * spec.kv_bytes_per_token_layer() == pytest.approx(by_hand)
    assert by_hand < 0.05 * get_model("deepseek-v3.2").layers * get_model("deepseek-v3.2").kv_bytes_per_token_layer()


def test_v4_compressed_pairs_match_a_brute_force_count():
    from cpattn.plan.v4costs import compressed_pairs, window_pairs

    rng = random.Random(0)
    for _ in range(200):
        start, ratio, topk = rng.randrange(0, 300), rng.choice([1, 3, 4, 128]), rng.choice([None, 1, 5, 40])
        end = start + rng.randrange(0, 300)
        want = sum(q // ratio if topk is None else min(q // ratio, topk) for q in range(start + 1, end + 1))
        assert compressed_pairs(start, end, ratio, topk) == want
        w = rng.randrange(1, 50)
        assert window_pairs(end - start, start, w) == sum(min(q, w) for q in range(start + 1, end + 1))


def test_v4_prefill_attention_flops_count_every_kind():
    from cpattn.plan.v4costs import prefill_attention_flops

    spec = get_model("deepseek-v4-flash")
    n, d, h = 4096, spec.head_dim, spec.heads
    want = {}
    for kind in ("sliding", "csa", "hca"):
        pairs = sum(min(q, spec.window) for q in range(1, n + 1))
        idx = 0
        if kind == "csa":
            pairs += sum(min(q // 4, spec.index_topk) for q in range(1, n + 1))
            idx = 2 * sum(q // 4 for q in range(1, n + 1)) * spec.index_heads * spec.index_dim
        if kind == "hca":
            pairs += sum(q // 128 for q in range(1, n + 1))
        want[kind] = 2 * pairs * h * (d + d) + idx  # QK^T and PV, every head
    for i, kind in enumerate(spec.layer_kinds[:4]):
        assert prefill_attention_flops(spec, i, n, 0) == pytest.approx(want[kind])


def test_a_deepseek_v4_config_json_is_read_by_the_family(tmp_path):
    cfg = {**DEEPSEEK_V4_FLASH, "num_hidden_layers": 5, "compress_ratios": [0, 4, 128, 4, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = get_model(str(tmp_path))
    assert spec.attention == "v4" and spec.layer_kinds == ("sliding", "csa", "hca", "csa", "hca")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "o_groups": 7}))
    with pytest.raises(ValueError, match="o_groups"):  # the family's own check, one line naming the field
        get_model(str(tmp_path))


def test_cli_refuses_a_bad_v4_config_in_one_line(tmp_path, capsys):
    from cpattn.plan.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V4_FLASH, "hidden_size": -1}))
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--devices", "8"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "hidden_size" in err


def test_v4_prices_per_layer_and_pcp_splits_the_attention():
    from cpattn.plan.model import Layout, Options, predict
    from cpattn.plan.profiles import B200

    spec, opts = get_model("deepseek-v4-flash"), Options(compute_dtype="fp8", pcp_method="allgather")
    tp8 = predict(spec, B200, Layout(8), context=131072, batch=1, opts=opts)
    pcp = predict(spec, B200, Layout(4, 2), context=131072, batch=1, opts=opts)
    assert tp8.fits and pcp.fits and 0 < pcp.ttft_s < tp8.ttft_s
    assert pcp.parts["prefill"]["pcp_comm"] > 0 == tp8.parts["prefill"]["pcp_comm"]
    assert tp8.tpot_s > 0 and tp8.kv_bytes_per_token == pytest.approx(spec.layers * spec.kv_bytes_per_token_layer())


def test_v4_anchor_reports_absolute_factors_and_reductions():
    from cpattn.bench.perf.anchors import V4_PUBLISHED, v4_anchor

    rows = v4_anchor()
    assert [(r["context"], r["published_base_s"], r["published_pcp_s"]) for r in rows] == V4_PUBLISHED
    assert (V4_PUBLISHED[0][1:], V4_PUBLISHED[-1][1:]) == ((11.17, 8.73), (126.68, 95.59))  # as published
    for r in rows:
        assert r["abs_base"] == pytest.approx(r["ttft_tp8_s"] / r["published_base_s"])
        assert r["abs_pcp"] == pytest.approx(r["ttft_tp4_pcp2_s"] / r["published_pcp_s"])
        assert r["published_reduction"] == pytest.approx(1 - r["published_pcp_s"] / r["published_base_s"])
        assert r["error"] == pytest.approx(r["ttft_reduction"] - r["published_reduction"])
