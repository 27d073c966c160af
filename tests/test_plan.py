"""cpattn.plan: profiles with sources, model shapes, exact counts, predictions per layout, the CLI, and a
small calibrated case on this machine (machinery only: no timing is asserted).
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from cpattn.config import ConfigError, EngineConfig
from cpattn.layout.pcp import causal_pairs as library_pairs
from cpattn.layout.pcp import pcp_plan
from cpattn.plan import Layout, Options, get_model, get_profile, layouts, predict, recommend
from cpattn.plan.costs import causal_pairs, collective_time, expected_experts, flash_tile_pairs
from cpattn.plan.profiles import ASCEND_910C, B200, CPU_DEFAULT, H200, Link, Profile
from cpattn.plan.specs import from_hf_config
from cpattn.plan.model import DCP_MERGES
from cpattn.bench.perf.validate import table
from cpattn.plan.bench_model import (concurrent_share, predict_dcp, predict_graph, predict_pcp, profile_gaps,
                                     ring_pairs)
from cpattn.plan.opcount import EchoGroup, count_ops, graph_program_ops


# ----------------------------------------------------------------------------- profiles and shapes
@pytest.mark.parametrize("prof", [H200, B200, ASCEND_910C])
def test_every_published_number_has_a_source(prof):
    for key in ("flops", "mem_bw", "mem_bytes", "links.intra", "links.inter", "efficiency", "launch"):
        assert prof.sources.get(key), (prof.name, key)
    assert prof.flops["bf16"] > 1e14 and prof.mem_bw > 1e12 and prof.devices_per_node >= 8


def test_builtin_models_have_their_published_sizes():
    want = {"deepseek-v3.2": (671, 37), "deepseek-r1": (671, 37), "glm-5": (744, 40),
            "qwen3-235b-a22b": (235, 22), "kimi-k2": (1030, 32)}
    for name, (total, active) in want.items():
        m = get_model(name)
        assert abs(m.total_params() / 1e9 - total) / total < 0.03, name
        act = (m.active_params_per_token() + m.vocab * m.hidden) / 1e9
        assert abs(act - active) / active < 0.08, (name, act)


def test_hf_config_round_trip(tmp_path):
    cfg = {"model_type": "deepseek_v32", "num_hidden_layers": 3, "hidden_size": 64, "vocab_size": 50,
           "num_attention_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 32, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 4, "v_head_dim": 8, "index_topk": 8, "index_n_heads": 2, "index_head_dim": 16,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "intermediate_size": 32,
           "first_k_dense_replace": 1, "n_shared_experts": 1}
    spec = from_hf_config(cfg)
    assert spec.attention == "dsa" and spec.kv_bytes_per_token_layer() == (32 + 4) * 2 + 16 + 4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert get_model(str(tmp_path)).index_topk == 8 == get_model(str(path)).index_topk
    with pytest.raises(ValueError, match="unknown model"):
        get_model("no-such-model")


# ----------------------------------------------------------------------------- exact counts
def test_causal_pairs_count_the_mask():
    for lq, lk in [(1, 1), (3, 3), (2, 7), (5, 5), (4, 9)]:
        mask = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
        assert causal_pairs(lq, lk) == int(mask.sum())
    assert causal_pairs(3, 5, causal=False) == 15


@pytest.mark.parametrize("seq,p", [(64, 2), (96, 2), (128, 4)])
def test_ring_schedule_pairs_equal_the_library_count(seq, p):
    plan = pcp_plan([0, seq], p)
    assert ring_pairs(seq, p) == [library_pairs(plan, r) for r in range(p)]


def _aten_flash_visits(lq, lk, causal):
    """Pairs aten's CPU flash kernel visits, walked tile by tile as its loop does (lq == lk when causal)."""
    q_split = 256 if lq >= 768 else 64 if lq >= 192 else 32
    q_split, kv_split = min(q_split, lq), min(512, lk)
    total = 0
    for m in range(0, lq, q_split):
        rows = min(q_split, lq - m)
        num_keys = min(m + rows, lk) if causal else lk
        n = 0
        while n < num_keys:
            total += rows * min(kv_split, lk - n)
            n += kv_split
    return total


@pytest.mark.parametrize("lq,lk", [(8, 8), (100, 100), (300, 300), (1000, 1000), (2048, 2048), (3000, 3000),
                                   (96, 200), (1024, 4096)])
def test_flash_tile_pairs_walk_the_kernel_tiles(lq, lk):
    """The diagonal is the kernel's causal square; a longer key range adds an unmasked prefix."""
    want = _aten_flash_visits(lq, lq, True) + lq * (lk - lq)
    assert flash_tile_pairs(lq, lk) == want >= causal_pairs(lq, lk)
    assert flash_tile_pairs(lq, lk, causal=False) == _aten_flash_visits(lq, lk, False) == lq * lk
    waste = [flash_tile_pairs(n, n) / causal_pairs(n, n) for n in (1024, 2048, 4096, 8192)]
    assert waste == sorted(waste, reverse=True) and waste[-1] < 1.07


def test_efficiency_curves_and_one_size_profiles_agree():
    """A one-size profile (no curves) is the curve model with a flat curve at its rate per computed pair."""
    from cpattn.plan.bench_model import LEGACY_ATTN_TOKENS, _attn

    n = LEGACY_ATTN_TOKENS
    legacy = dataclasses.replace(CPU_DEFAULT, curves={})
    flat = {k: [[1024.0, CPU_DEFAULT.efficiency[k] * flash_tile_pairs(n, n) / causal_pairs(n, n)]] * 2
            for k in ("attention_causal", "attention_causal_hm")}
    flat["attention"] = [[1024.0, CPU_DEFAULT.efficiency["attention"]]]
    curved = dataclasses.replace(CPU_DEFAULT, curves=flat)
    for lq, lk, causal in [(8192, 8192, True), (4096, 4096, True), (2048, 4096, False)]:
        a = _attn(legacy, lq, lk, causal, 16, 16, 128, head_major=True)
        b = _attn(curved, lq, lk, causal, 16, 16, 128, head_major=True)
        assert math.isclose(a, b)
    rising = dataclasses.replace(CPU_DEFAULT, curves={"attention_causal": [[1024, 0.5], [4096, 1.0]]})
    assert rising.efficiency_at("attention_causal", 2048) == pytest.approx(0.75)
    assert rising.efficiency_at("attention_causal", 16384) == 1.0


def test_old_profile_json_loads_and_names_its_gaps(tmp_path):
    """A profile saved before the CPU-time shares, transfer costs and curves still validates."""
    from cpattn.plan.profiles import load_profile

    old = CPU_DEFAULT.as_dict()
    old.pop("curves")
    for link in old["links"].values():
        for key in ("cpu_alpha", "cpu_beta", "cold", "cold_gap"):
            link.pop(key)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    prof = load_profile(str(path))
    assert prof.curves == {} and prof.links["ring"].cpu_beta == 0
    gaps = profile_gaps(prof)
    assert any("ring exchange CPU time" in g for g in gaps) and any("concurrent_decode:" in g for g in gaps)
    assert any(g.startswith("update (the in-place LSE merge)") for g in gaps)
    assert concurrent_share(prof, "decode", "cpu") == prof.efficiency["concurrent_bandwidth"]
    cpu = predict_pcp(prof, seq=4096, heads=8, kv_heads=8, head_dim=128, clock="cpu")
    assert cpu["ranks"][0]["transfer"] > 0  # stands in with the transfer's wall time


def test_cpu_clock_prices_the_share_and_the_transfer():
    ring = dataclasses.replace(CPU_DEFAULT.links["ring"], cpu_alpha=0.0, cpu_beta=1e9)
    base = dataclasses.replace(CPU_DEFAULT, links={**CPU_DEFAULT.links, "ring": ring},
                               efficiency={**CPU_DEFAULT.efficiency, "concurrent_compute_cpu": 1.0,
                                           "concurrent_bandwidth_cpu": 1.0})
    r = predict_pcp(base, seq=4096, heads=8, kv_heads=8, head_dim=128, clock="cpu")
    assert math.isclose(r["ring_s"], max(sum(p.values()) for p in r["ranks"]))
    bytes0 = 4096 // 2 * 4 * 8 * 2 * 128  # rank 0 receives all of rank 1's K/V
    assert math.isclose(r["ranks"][0]["transfer"], bytes0 / 1e9)
    slower = dataclasses.replace(base, efficiency={**base.efficiency, "concurrent_compute_cpu": 0.8})
    assert predict_pcp(slower, seq=4096, heads=8, kv_heads=8, head_dim=128, clock="cpu")["ratio"] > r["ratio"]
    dcp = predict_dcp(dataclasses.replace(base, efficiency={**base.efficiency, "concurrent_decode_cpu": 0.8}),
                      context=8192, clock="cpu")
    assert dcp["ratio"]["local_a2a"] == pytest.approx(0.5 / 0.8) and dcp["share"] == 0.8
    # a calibrated CPU cost of the all-to-all: local_a2a's merge sends 33,024 bytes per rank (what `bench dcp`
    # counts: batch 4 x 32 heads x (128 + 1) x 4 B, half of it to the peer), one message step
    a2a = dataclasses.replace(CPU_DEFAULT.links["a2a"], cpu_alpha=1e-4, cpu_beta=1e9)
    costed = predict_dcp(dataclasses.replace(base, links={**base.links, "a2a": a2a}), context=8192, clock="cpu")
    assert costed["comm_s"]["local_a2a"] == pytest.approx(1e-4 + 33024 / 1e9)
    assert costed["share"] == 1.0 and costed["ratio"]["local_a2a"] > 0.5  # half the KV, plus the merge's cost
    with pytest.raises(ValueError, match="clock"):
        predict_dcp(base, context=8192, clock="gpu")


def test_echo_group_counts_one_ranks_ops_only():
    g = EchoGroup(2)
    x = torch.randn(4, 3)
    assert count_ops(lambda: g.all_gather(x))["ops"] == 0  # the collective's own work is priced apart
    two = graph_program_ops(layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, context=32, batch=2, dcp=2)
    one = graph_program_ops(layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, context=32, batch=2, dcp=1)
    assert two["ops"] > one["ops"]  # the merge of the partials
    assert one["collectives"] == []
    # the traced collectives per layer: kinds, and bytes from the shapes (b=2 requests, h=4 heads, d=8, hidden 32)
    b, h, d, x = 2, 4, 8, 32
    want = {"ag_rs": [("all_gather", b * h // 2 * d * 4), ("all_gather", b * h * 4), ("reduce_scatter", b * h * d * 4),
                      ("all_reduce", b * x * 4)],
            "a2a": [("all_gather", b * h // 2 * d * 4), ("all_to_all", b * h * (d + 1) * 4), ("all_reduce", b * x * 4)],
            "local_a2a": [("all_to_all", b * h * (d + 1) * 4), ("all_reduce", b * x * 4)],
            "local_fold": [("all_gather", b * h * 4), ("all_reduce", b * x * 4)],
            "local_ag": [("all_gather", b * h * (d + 1) * 4)]}  # every head on every rank: no TP reduction
    for merge, per_layer in want.items():
        got = graph_program_ops(layers=2, hidden=x, heads=h, kv_heads=1, head_dim=d, context=32, batch=b, merge=merge)
        assert got["collectives"] == per_layer * 2, merge
    link = Link(1e-4, 1e9, cold=2e-4, cold_gap=1e-4)
    prof = dataclasses.replace(CPU_DEFAULT, links={**CPU_DEFAULT.links, "a2a": link})
    g = predict_graph(prof, layers=1, batches=(2,), hidden=32, heads=4, kv_heads=1, head_dim=8, context=32)[2]
    assert g["cold_s"] == pytest.approx(4 * 2e-4)  # 4 collectives, each reached from > 100 us of host work


def test_collective_costs():
    link = Link(1e-5, 1e9)
    assert collective_time("all_gather", 1e6, 1, link) == 0.0
    ring = collective_time("all_reduce", 1e6, 4, link, "ring")
    assert math.isclose(ring, 6e-5 + 1.5e-3)
    assert collective_time("all_gather", 1e6, 4, link, "a2a") < collective_time("all_gather", 1e6, 4, link, "ring")
    assert expected_experts(8, 0) == 0 and 7.9 < expected_experts(8, 1000) <= 8


# ----------------------------------------------------------------------------- predictions
def test_layouts_are_exactly_what_engine_config_accepts():
    spec = get_model("qwen3-235b-a22b")
    got = set(layouts(spec, 8))
    for tp in (1, 2, 4, 8):
        for dcp in (1, 2, 4, 8):
            try:
                EngineConfig.create(tp_size=tp, pcp_size=8 // tp, dcp_size=dcp, attention="gqa",
                                    num_attention_heads=64, num_kv_heads=4)
                ok = True
            except ConfigError:
                ok = False
            assert (Layout(tp, 8 // tp, dcp) in got) == ok, (tp, dcp)
    assert Layout(8, 1, 4) not in got  # tp // num_kv_heads = 2 caps DCP at 2


def test_dcp_shards_kv_and_raises_concurrency():
    spec, prof = get_model("deepseek-v3.2"), get_profile("h200")
    preds = {d: predict(spec, prof, Layout(8, 1, d), context=65536, batch=2) for d in (1, 2, 4, 8)}
    for d in (2, 4, 8):
        assert math.isclose(preds[d].kv_bytes_per_token * d, preds[1].kv_bytes_per_token)
        assert preds[d].max_requests >= 2 * preds[1].max_requests - 1
    assert preds[8].parts["decode"]["cp_comm"] > 0 == preds[1].parts["decode"]["cp_comm"]
    best, why = recommend(list(preds.values()))
    assert best is not None and str(best.layout) in why


def test_pcp_splits_prefill_and_the_merge_variants_order():
    spec, prof = get_model("glm-5"), get_profile("ascend-910c")
    one = predict(spec, prof, Layout(16, 1, 1), context=32768, batch=1)
    two = predict(spec, prof, Layout(16, 2, 1), context=32768, batch=1)
    assert 0.4 < two.ttft_s / one.ttft_s < 0.9
    costs = {m: predict(spec, prof, Layout(16, 1, 16), context=32768, batch=8,
                        opts=Options(dcp_merge=m)).parts["decode"]["cp_comm"] for m in DCP_MERGES}
    assert costs["local_a2a"] < costs["a2a"] < costs["ag_rs"]
    assert 0 < costs["local_fold"] < costs["local_a2a"]  # T x H LSEs, not [O | L]
    # local_ag: every rank gathers every rank's whole [O | L] (an all-to-all moves 1/N of it): fewer collectives,
    # more bytes (at 16 ranks and batch 8 the bytes win)
    assert costs["local_ag"] > costs["local_a2a"] > 0


def test_data_parallel_replicas_share_the_experts():
    """dp=2: one prompt's attention runs on one TP replica (as with dp=1) while the routed experts of both
    replicas serve its tokens; each replica holds its own requests' KV."""
    spec, prof = get_model("deepseek-r1", weights="w8a8"), ASCEND_910C
    one, two = (predict(spec, prof, Layout(8, dp=dp), context=32768, batch=1) for dp in (1, 2))
    assert two.layout.devices == 16 and str(two.layout) == "tp=8 pcp=1 dcp=1 dp=2"
    assert math.isclose(two.parts["prefill"]["attention"], one.parts["prefill"]["attention"])
    assert two.parts["prefill"]["gemm"] < one.parts["prefill"]["gemm"]
    assert two.weights_bytes < one.weights_bytes and two.max_requests >= 2 * one.max_requests
    # two prompts on two replicas: the same attention time as one prompt on one
    pair = predict(spec, prof, Layout(8, dp=2), context=32768, batch=2)
    assert math.isclose(pair.parts["prefill"]["attention"], one.parts["prefill"]["attention"])
    assert math.isclose(pair.parts["decode"]["attention"], one.parts["decode"]["attention"])


def test_decode_flops_per_device_count_pcp_copies_and_dp_shares():
    """Compute-bound decode (bandwidth made free): every PCP rank decodes the same tokens, so the per-device
    GEMM work of pcp=2 equals pcp=1's; two DP replicas with twice the batch equal one replica with one."""
    spec = get_model("qwen3-235b-a22b")
    prof = dataclasses.replace(H200, mem_bw=1e30)
    gemm = {lay: predict(spec, prof, lay, context=4096, batch=b).parts["decode"]["gemm"]
            for lay, b in ((Layout(8), 64), (Layout(8, 2), 64), (Layout(8, dp=2), 128))}
    assert math.isclose(gemm[Layout(8, 2)], gemm[Layout(8)]) and math.isclose(gemm[Layout(8, dp=2)], gemm[Layout(8)])
    dense_only = 2.0 * 64 * spec.layers * spec.attn_params() / 8 / (prof.flops["bf16"] * prof.efficiency["gemm"])
    assert gemm[Layout(8)] > 1.5 * dense_only  # the routed experts' FLOPs are counted, not only the dense part


def test_pcp_anchor_uses_the_published_configurations():
    from cpattn.bench.perf.anchors import PCP_PUBLISHED, pcp_anchor

    want = {(get_model(m).name, c): 1 - p / b for m, (_, cells) in PCP_PUBLISHED.items() for c, b, p in cells}
    rows = pcp_anchor()
    assert [(r["model"], r["context"]) for r in rows] == list(want)
    for r in rows:
        assert math.isclose(r["published_reduction"], want[r["model"], r["context"]])
        assert 0 < r["fitted_reduction"] < r["ttft_reduction"] < 0.5  # fitting weighs the per-token work up
        assert r["scales"][0] > 1 and r["scales"][1] > 0


def test_pcp_terms_is_deprecated_and_unused_by_the_library(capsys):
    import warnings

    from cpattn.bench.perf.anchors import pcp_terms, ttft_terms
    from cpattn.bench.perf.cli import main

    for call in (lambda: pcp_terms(), lambda: ttft_terms([32768, 65536, 131072], [6.0, 17.0, 57.0])):
        with pytest.warns(DeprecationWarning, match="absolute anchors: cpattn.bench.perf.anchors.pcp_anchor"):
            call()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the anchors command no longer calls it
        assert main(["anchors", "--json", "-"]) == 0
    assert "pcp_terms" not in json.loads(capsys.readouterr().out)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pcp_terms_solve_each_column_exactly():  # the deprecated alias still answers as before, for one release
    from cpattn.bench.perf.anchors import pcp_anchor, pcp_terms, ttft_terms

    # R1's published columns solved by hand (elimination on c = 1, 2, 4 x 32K)
    assert np.allclose(ttft_terms([32768, 65536, 131072], [9.3, 22.8, 73.2]), [3.6, 1.8, 3.9])
    assert np.allclose(ttft_terms([32768, 65536, 131072], [7.9, 15.9, 46.0]), [4.6, 0.95, 2.35])
    with pytest.raises(ValueError, match="three distinct"):
        ttft_terms([32768, 32768, 65536], [1.0, 1.0, 2.0])
    rows = pcp_anchor()
    terms = pcp_terms(rows)
    assert [(t["model"], t["source"]) for t in terms] == [(m, s) for m in dict.fromkeys(r["model"] for r in rows)
                                                         for s in ("published", "predicted")]
    rng = np.random.default_rng(0)
    for t in terms:
        mine = [r for r in rows if r["model"] == t["model"]]
        base, pcp = (("published_base_s", "published_pcp_s") if t["source"] == "published"
                     else ("ttft_base_s", "ttft_pcp2_s"))
        x = np.array([r["context"] for r in mine]) / 32768
        # the baseline's terms give back its cells; the ratios give back the PCP column's terms
        rebuilt = t["constant_32k_s"] + t["per_token_32k_s"] * x + t["attention_32k_s"] * x * x
        assert np.allclose(rebuilt, [r[base] for r in mine])
        pcp_terms_ = ttft_terms(x * 32768, [r[pcp] for r in mine])
        assert np.allclose(pcp_terms_, [t["pcp_constant_s"], t["per_token_ratio"] * t["per_token_32k_s"],
                                        t["attention_ratio"] * t["attention_32k_s"]])
        for key, (lo, hi) in t["range"].items():
            assert lo <= t[key] <= hi and (t["source"] == "published" or lo == hi)
        if t["source"] == "predicted":
            assert abs(t["attention_ratio"] - 0.5) < 1e-3  # load-balanced causal attention halves under PCP = 2
            continue
        for _ in range(20):  # any rounding of the published cells (one decimal) stays inside the printed ranges
            d = rng.uniform(-0.05, 0.05, (2, 3))
            f, u, a = ttft_terms(x * 32768, [r[base] for r in mine] + d[0])
            fp, up, ap = ttft_terms(x * 32768, [r[pcp] for r in mine] + d[1])
            for key, v in (("constant_32k_s", f), ("pcp_constant_s", fp), ("per_token_ratio", up / u),
                           ("attention_ratio", ap / a)):
                assert t["range"][key][0] - 1e-12 <= v <= t["range"][key][1] + 1e-12
    qwen = {t["source"]: t for t in terms if t["model"] == "Qwen3-235B-A22B"}
    assert qwen["published"]["range"]["pcp_constant_s"][1] < 0  # no non-negative cost structure fits it
    # a baseline without attention (1, 2, 4 s: purely per-token): the attention ratio has no range, said as NaN
    linear = [{**r, "published_base_s": r["context"] / 32768} for r in rows if r["model"] == "DeepSeek-R1"]
    flat = pcp_terms(linear)[0]
    assert all(map(math.isnan, flat["range"]["attention_ratio"]))  # its rounding corners reach 0 and below


def test_nothing_fits_is_said():
    spec, prof = get_model("kimi-k2"), get_profile("h200")
    preds = [predict(spec, prof, lay, context=131072, batch=64) for lay in layouts(spec, 8)]
    best, why = recommend(preds)
    assert best is None and "no layout" in why


# ----------------------------------------------------------------------------- the CLI
def _run(argv, capsys):
    from cpattn.cli import main  # the command line: `cpattn plan ARGV` (calibrate | validate | anchors included)

    code = main(["plan", *argv])
    return code, capsys.readouterr()


def test_cli_json_is_pure_and_has_every_layout(capsys):
    code, out = _run(["--model", "qwen3-235b-a22b", "--context", "32768", "--batch", "2", "--devices", "8",
                      "--json", "-"], capsys)
    assert code == 0
    data = json.loads(out.out)
    assert len(data["predictions"]) == len(layouts(get_model("qwen3-235b-a22b"), 8))
    assert data["recommendation"] and data["assumptions"]


@pytest.mark.parametrize("argv,flag", [(["--model", "nope"], "unknown model"), (["--devices", "0"], "--devices"),
                                       (["--profile", "tpu"], "unknown profile"), (["--weights", "fp3"], "--weights")])
def test_cli_usage_errors_are_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _run(argv, capsys)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and flag in err and len(err.splitlines()) == 1


def test_cli_anchors_print_assumptions(capsys):
    code, out = _run(["anchors"], capsys)
    assert code == 0 and "assumptions" in out.out and "Kimi-K2" in out.out


# ----------------------------------------------------------------------------- a small calibrated case
def _dcp_small(group, ctx, reps):
    from cpattn.bench.common import measure
    from cpattn.comm.sim import SimMesh
    from cpattn.dcp import dcp_decode, dcp_plan

    torch.manual_seed(group.rank)
    b, hq, hkv, d, bs = 2, 32, 8, 128, 128

    def shard(n):
        nb = b * ctx // (n * bs)
        kc = torch.randn(nb, bs, hkv, d).bfloat16()
        table = torch.arange(nb).view(b, -1)
        return kc, kc.clone(), dcp_plan([ctx] * b, [1] * b, table, dcp_size=n, interleave_size=bs, block_size=bs)

    mine, full = shard(group.size), shard(1) if group.rank == 0 else None
    q = torch.randn(b, hq, d).bfloat16()
    solo = SimMesh(1).groups()[0]
    runs = {"one": (lambda: dcp_decode(q, full[:2], full[2], group=solo, merge="a2a", query="local"))
            if group.rank == 0 else (lambda: None),
            "dcp": lambda: dcp_decode(q, mine[:2], mine[2], group=group, merge="a2a", query="local")}
    s = measure(runs, reps, group=group, warmup=1)
    return s["dcp"].median / s["one"].median


@pytest.mark.slow
def test_small_calibrated_case_predicts_and_measures(tmp_path):
    from cpattn.comm.launch import spawn
    from cpattn.bench.perf.calibrate import calibrate, summary
    from cpattn.plan.profiles import load_profile, save_profile

    prof = calibrate(quick=True)
    save_profile(prof, tmp_path / "cpu.json")
    prof = load_profile(str(tmp_path / "cpu.json"))
    assert isinstance(prof, Profile) and profile_gaps(prof) == []
    text = summary(prof)
    assert "gloo all-to-all" in text and "process CPU time" in text and "paged decode" in text
    assert prof.links["a2a"].alpha >= 0 and prof.flops["fp32"] > 0 and prof.links["ring"].cpu_beta > 0
    assert all(len(prof.curves[k]) == 2 for k in ("attention_causal", "attention_causal_hm", "attention"))
    assert 0 < concurrent_share(prof, "decode", "cpu") <= 1 and 0 < concurrent_share(prof, "compute", "cpu") <= 1
    ctx = 2048
    predicted = predict_dcp(prof, context=ctx, batch=2)["ratio"]["local_a2a"]
    measured = spawn(2, _dcp_small, ctx, 3, threads=1, timeout_s=300)[0]
    rows = table([("dcp local a2a, 2K", predicted, measured)])
    assert math.isfinite(predicted) and predicted > 0 and measured > 0 and rows[0]["error"] is not None
    pcp = predict_pcp(prof, seq=2048, heads=8, kv_heads=2, head_dim=128)
    assert 0 < pcp["ratio"] < 2 and len(pcp["ranks"]) == 2
    graph = predict_graph(prof, layers=1, batches=(2,), hidden=64, heads=4, kv_heads=1, head_dim=16, context=32)
    assert graph[2]["ops"]["ops"] > graph[2]["ops"]["kernels"] > 0 and graph[2]["speedup"] > 1
