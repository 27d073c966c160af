"""The DCP decode-layer variants with fewer collectives, each exact vs the float64 oracle and counted.

- ``dcp_decode(query="local")``: every rank holds the group's query heads
  (replicated hidden state), so no query all-gather; merges "a2a" (own
  heads), "ag" (every head on every rank) and "ag_rs";
- ``dcp_fold_weights``: the merge's rescale folded into the reduction that
  follows (the TP all-reduce of the output projection);
- the engine's ``DCPStep`` variants ("local_ag", "local_a2a", "a2a",
  "ag_rs") give the same greedy tokens and logits as one device;
- the demo program's "local_a2a", "local_fold" and "local_ag" layers equal one device;
- one merge vocabulary (``cpattn.dcp.layer_merges``): the engine, the demo program, the planner and the
  CLIs take its names, and the old spelling "fold" still works with a DeprecationWarning.
"""

import pytest
import torch

from cpattn.comm import simulate
from cpattn.dcp import MERGES, QUERIES, collectives_per_call, dcp_decode, dcp_fold_weights, dcp_partials
from cpattn.dcp.layer_merges import COLLECTIVES, ENGINE_MERGES, LAYER_MERGES, PROGRAM_MERGES
from cpattn.ops import merge_attn_states
from test_dcp_decode import build, check, random_cases


def _variant(group, case, query, merge):
    r, hl = group.rank, case["hl"]
    q = case["q"] if query == "local" else case["q"][:, r * hl : (r + 1) * hl]
    group.stats.reset()
    out, lse = dcp_decode(q, case["caches"][r], case["meta"], group=group, merge=merge, query=query,
                          softmax_scale=case["scale"], return_lse=True, v_head_dim=case["dv"])
    return out, lse, sum(group.stats.calls.values())


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("merge", MERGES)
def test_every_variant_matches_the_oracle_and_its_count(n, query, merge):
    cases = random_cases(n, 100 + n)[:3]
    results = simulate(n, lambda g: [_variant(g, c, query, merge) for c in cases])
    for i, case in enumerate(cases):
        per_rank = [results[r][i] for r in range(n)]
        assert all(p[2] == collectives_per_call(query, merge) for p in per_rank)
        if merge == "ag":  # every rank has every head, the same bits
            for p in per_rank[1:]:
                assert torch.equal(p[0], per_rank[0][0])
            hl = case["hl"]
            per_rank = [(p[0][:, r * hl : (r + 1) * hl], p[1][:, r * hl : (r + 1) * hl]) for r, p in enumerate(per_rank)]
        check(case, per_rank)


def test_local_query_mla_and_bf16():
    n = 2
    for case in (build(7, n, [70, 3, 200], [2, 1, 4], inter=16, bs=16, hl=2, hkv=1, dk=576, dv=512, mla=True,
                       scale=0.07, pad_rows=2),
                 build(8, n, [90, 5], [1, 3], inter=1, bs=16, hl=2, hkv=2, dtype=torch.bfloat16)):
        for merge in ("a2a", "ag"):
            res = simulate(n, lambda g: _variant(g, case, "local", merge))
            hl = case["hl"]
            per_rank = [(p[0][:, r * hl:(r + 1) * hl], p[1][:, r * hl:(r + 1) * hl]) if merge == "ag" else p[:2]
                        for r, p in enumerate(res)]
            check(case, per_rank)


def test_fold_weights_merge_through_a_linear_map():
    n = 3
    case = random_cases(n, 5)[3]
    w_o = torch.randn(case["hl"] * n * case["dv"], 24, dtype=torch.float64)

    def rank(g):
        r = g.rank
        kc, vc = case["caches"][r]
        meta = case["meta"]
        o, lse = dcp_partials(case["q"], kc, vc, meta.block_table, meta.req_indices, meta.kv_lens[r],
                              softmax_scale=case["dv"] ** -0.5)
        w, total = dcp_fold_weights(lse, group=g)
        part = torch.where(w[..., None] == 0, 0.0, o * w[..., None]).double()
        return g.all_reduce(part.flatten(1) @ w_o), total

    res = simulate(n, rank)
    t = case["t"]
    want = case["want"].flatten(1) @ w_o  # [T, 24]: the oracle's heads through the same map
    for got, total in res:
        torch.testing.assert_close(got[:t], want[:t], rtol=1e-5, atol=1e-4)
        assert (got[t:] == 0).all()
        torch.testing.assert_close(total[:t].double(), case["want_lse"][:t], rtol=1e-5, atol=2e-5)


def test_merge_of_nan_partial_stays_nan():
    o = torch.randn(2, 1, 4, 3)
    lse = torch.randn(2, 1, 4)
    lse[1, 0, 2] = float("nan")

    from cpattn.dcp import dcp_merge

    outs = simulate(2, lambda g: dcp_merge(o[g.rank], lse[g.rank], group=g, merge="ag"))
    want, want_lse = merge_attn_states(o, lse)
    for out, l in outs:
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(l.isnan(), want_lse.isnan())


# ----------------------------------------------------------------------------- the engine's DCP step
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_engine_step_variants_equal_one_device(n):
    from cpattn.engine.decode import decode
    from cpattn.engine.family import get_family
    from cpattn.engine.paged_cache import PagedShard, STEP_MERGES
    from cpattn.models import qwen3

    fam = get_family("qwen3")
    cfg = qwen3.Qwen3Config.tiny(num_attention_heads=8, num_key_value_heads=2)
    # float64: 9 greedy steps compared token for token need no near-tie allowance (DESIGN.md §5)
    params = fam.init_params(cfg, seed=3, std=0.2, dtype=torch.float64)
    prompts = [[], []]  # an empty cache: every step writes its token's KV, then attends all earlier ones

    def run(group, merge):
        shard = PagedShard.empty(fam.kv_layouts(cfg), capacity=[20, 20], dcp_size=group.size, block_size=4,
                                 interleave_size=2, dtype=torch.float64)
        out = decode(group, fam, params, cfg, shard, prompts, torch.tensor([11, 12]), 9, merge=merge)
        return out.tokens, out.logits

    want = simulate(1, lambda g: run(g, "ag_rs"))[0]
    assert want[1].isfinite().all()
    for merge in STEP_MERGES:
        got = simulate(n, lambda g: run(g, merge))
        for tokens, logits in got:
            assert torch.equal(tokens, want[0]), merge
            assert logits.dtype == torch.float64
            torch.testing.assert_close(logits, want[1], rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- the demo program (TP = DCP)
@pytest.mark.parametrize("merge", ["local_a2a", "local_fold", "local_ag"])
def test_demo_program_variants_equal_one_device(merge):
    from cpattn.graphs import demo_program as dp

    cfg = dp.ProgramConfig(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, block_size=8,
                           max_blocks=4, num_blocks=16, merge=merge)
    params = dp.init_params(cfg, seed=1)
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(2))
    batch = {"x": x, "seq_lens": torch.tensor([6, 3]), "block_table": torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),
             "cu_seqlens_q": torch.tensor([0, 6, 9], dtype=torch.int32)}

    def rank(g, c):
        state = dp.init_state(c, params, g.rank, g.size)
        g.stats.reset()
        out = dp.decode_step(state, batch, cfg=c, group=g)
        return out, sum(g.stats.calls.values())

    one = dp.ProgramConfig(**{**cfg.__dict__, "merge": "ag_rs"})
    want = simulate(1, lambda g: rank(g, one))[0][0]
    for out, calls in simulate(2, lambda g: rank(g, cfg)):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert calls == COLLECTIVES[merge] * cfg.num_layers  # per layer, the TP all-reduce included


# ----------------------------------------------------------------------------- one merge vocabulary
def test_one_merge_vocabulary_every_layer_name_is_one_dcp_wiring():
    from cpattn.engine.options import CHOICES
    from cpattn.engine.paged_cache import STEP_MERGES
    from cpattn.graphs import demo_program as dp
    from cpattn.plan.model import DCP_MERGES

    assert CHOICES["dcp_merge"] is ENGINE_MERGES and tuple(STEP_MERGES) == ENGINE_MERGES
    assert dp.MERGES is PROGRAM_MERGES and DCP_MERGES is PROGRAM_MERGES and set(ENGINE_MERGES) < set(PROGRAM_MERGES)
    for name, (query, merge) in LAYER_MERGES.items():
        assert query in QUERIES and (merge in MERGES or merge == "fold"), name
        assert name.startswith("local_") == (query == "local"), name  # the name spells its query
        if name in ENGINE_MERGES:  # the engine's count: the DCP call's collectives + the output gather (not local_ag)
            assert COLLECTIVES[name] == collectives_per_call(query, merge) + (name != "local_ag"), name


def test_old_fold_spelling_warns_and_the_engine_refuses_local_fold():
    from cpattn.engine.options import Algorithms
    from cpattn.graphs import demo_program as dp
    from cpattn.plan.model import Options

    with pytest.warns(DeprecationWarning, match="use 'local_fold'"):
        assert dp.ProgramConfig(merge="fold").merge == "local_fold"
    with pytest.warns(DeprecationWarning, match="use 'local_fold'"):
        assert Options(dcp_merge="fold").dcp_merge == "local_fold"
    with pytest.raises(ValueError, match="needs a TP output projection"):
        Algorithms(dcp_merge="local_fold")
    with pytest.raises(ValueError, match="must be one of"):
        dp.ProgramConfig(merge="ag")  # dcp_decode's merge, not a layer name


def test_cli_merge_flags_take_the_vocabulary_and_the_old_name(capsys):
    from cpattn.bench import graph
    from cpattn.plan import cli as plan_cli

    assert graph._parser().parse_args(["--merge", "fold"]).merge == "local_fold"
    assert "now called 'local_fold'" in capsys.readouterr().err
    assert graph._parser().parse_args(["--merge", "local_ag"]).merge == "local_ag"
    assert plan_cli._plan_parser().parse_args(["--devices", "8", "--dcp-merge", "fold"]).dcp_merge == "local_fold"
    with pytest.raises(SystemExit):
        graph._parser().parse_args(["--merge", "ag"])
