"""dcp_decode / DCPContext against the float64 dense oracle (tests/ref/dense.py).

Each case builds the whole sequences' K/V, deals them to N NaN-poisoned
paged caches through the DCP slot mapping, runs the sharded step on the
simulated mesh (N = 1..8) or real gloo processes (N = 2, 4; one spawn each),
and compares the heads put back together with dense causal attention over
the full sequences.
"""

import random

import pytest
import torch

import ref as oracle
from cpattn.comm import simulate
from cpattn.comm.launch import spawn
from cpattn.comm.sim import SimMesh
from cpattn.dcp import DCPContext, dcp_decode, dcp_plan, plan_tensors
from cpattn.layout.dcp import dcp_local_lens, dcp_slot_mapping
from cpattn.layout.pcp import pcp_plan, pcp_shard, pcp_unshard
from cpattn.ops.rows import write_kv, write_kv_mla
from cpattn.pcp import pcp_prefill

NAN = float("nan")


def build(seed, n, seq_lens, query_lens, *, inter, bs, hl, hkv, dk=32, dv=32, mla=False,
          dtype=torch.float32, pad_rows=0, scale=None):
    """One DCP case: per-rank caches, the plan, the full-head query and the float64 oracle."""
    gen = torch.Generator().manual_seed(seed)
    hq = n * hl
    b = len(seq_lens)
    ks = [torch.randn(s, hkv, dk, generator=gen).to(dtype) for s in seq_lens]  # per request [S, Hkv, Dk]
    vs = [k[..., :dv] if mla else torch.randn(s, hkv, dv, generator=gen).to(dtype) for k, s in zip(ks, seq_lens)]
    t = sum(query_lens)
    q = torch.randn(t + pad_rows, hq, dk, generator=gen).to(dtype)
    q[t:] = NAN  # padding rows: never read into a real row
    local = dcp_local_lens(torch.tensor(seq_lens), n, inter).max(1).values
    mb = max(1, -(-int(local.max()) // bs)) + 1  # one spare column pointing at a never-written block
    nb = b * mb + 2
    table = torch.randperm(nb, generator=gen)[: b * mb].view(b, mb)
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    req = torch.cat([torch.full((s,), i) for i, s in enumerate(seq_lens)])
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    caches = []
    for r in range(n):
        kc = torch.full((nb, bs, hkv, dk), NAN, dtype=dtype)
        vc = None if mla else torch.full((nb, bs, hkv, dv), NAN, dtype=dtype)
        slots = dcp_slot_mapping(pos, req, table, dcp_rank=r, dcp_size=n, interleave_size=inter, block_size=bs)
        if mla:  # one latent cache: [kv_c | k_pe]
            write_kv_mla(kc, k_all[:, 0, :dv], k_all[:, 0, dv:], slots)
        else:
            write_kv(kc, vc, k_all, v_all, slots)
        caches.append(kc if mla else (kc, vc))
    meta = dcp_plan(seq_lens, query_lens, table, dcp_size=n, interleave_size=inter, block_size=bs,
                    num_tokens=t + pad_rows)
    q_req = torch.cat([torch.full((ql,), i) for i, ql in enumerate(query_lens)] + [torch.full((pad_rows,), -1)])
    q_pos = torch.cat([torch.arange(s - ql, s) for s, ql in zip(seq_lens, query_lens)] + [torch.zeros(pad_rows, dtype=torch.long)])
    qd = torch.nan_to_num(q.double(), 0.0)
    want, want_lse = oracle.attention(qd, k_all.double(), v_all.double(), q_req, req, q_pos, pos, scale=scale)
    plain = None
    if dtype != torch.float32:
        plain = oracle.plain_error(qd[:t], k_all.double(), v_all.double(), q_req[:t], req, q_pos[:t], pos, dtype,
                                   scale=scale)
    return dict(n=n, q=q, caches=caches, meta=meta, hl=hl, dv=dv, scale=scale, want=want, want_lse=want_lse,
                plain=plain, t=t)


def run_case(group, case, merge):
    """This rank's part of a case: its heads of q, its cache shard -> (out, lse)."""
    r, hl = group.rank, case["hl"]
    q = case["q"][:, r * hl : (r + 1) * hl]
    return dcp_decode(q, case["caches"][r], case["meta"], group=group, merge=merge,
                      softmax_scale=case["scale"], return_lse=True, v_head_dim=case["dv"])


def run_cases(group, cases):
    """Every case with both merges; [(out_ag_rs, lse_ag_rs, out_a2a, lse_a2a)]."""
    return [(*run_case(group, c, "ag_rs"), *run_case(group, c, "a2a")) for c in cases]


def check(case, per_rank):
    """Stitch the ranks' heads together and compare with the oracle."""
    out = torch.cat([p[0] for p in per_rank], dim=1)  # [T, Hq, Dv]
    lse = torch.cat([p[1] for p in per_rank], dim=1)
    want, want_lse, t = case["want"], case["want_lse"], case["t"]
    assert torch.isfinite(out).all()
    assert (out[t:] == 0).all() and (lse[t:] == float("-inf")).all()  # padding rows
    if case["plain"] is None:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-5)
    else:
        err = (out.double() - want).abs().max().item()
        assert err <= 2 * case["plain"] + 1e-6, (err, case["plain"])
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-4)  # fp32 LSE of bf16 inputs


def check_merges_agree(per_rank):
    for p in per_rank:
        torch.testing.assert_close(p[0], p[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p[1], p[3], rtol=1e-5, atol=1e-5)


def random_cases(n, seed):
    """A few varied cases for world size n (kept small: 2 cores, many tests)."""
    rnd = random.Random(seed)
    cases = []
    for i, (inter, bs) in enumerate([(1, 16), (2, 16), (16, 16), (128, 128)]):
        seq = [0, 1, max(1, n * inter - 1), rnd.randint(2, 400)]
        ql = [0, 1, min(rnd.randint(1, 4), seq[2]), rnd.randint(1, 4)]
        if i == 1:  # a chunked-prefill request in the batch (mixed batch)
            seq.append(rnd.randint(30, 120))
            ql.append(rnd.randint(10, 30))
        if i == 3 and n in (2, 5):  # one long sequence now and then
            seq[3], ql[3] = rnd.randint(1500, 2100), 2
        hkv = 2 if n % 2 == 0 else 1
        cases.append(build(seed * 10 + i, n, seq, ql, inter=inter, bs=bs, hl=2 if i % 2 else 1, hkv=hkv,
                           pad_rows=i % 2 * 3))
    return cases


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_dcp_decode_sim_matches_oracle(n):
    cases = random_cases(n, n)
    results = simulate(n, run_cases, cases)
    for i, case in enumerate(cases):
        per_rank = [results[r][i] for r in range(n)]
        check(case, per_rank)
        check_merges_agree(per_rank)


@pytest.mark.parametrize("n, inter, bs", [(2, 1, 16), (3, 16, 16), (4, 2, 128)])
def test_dcp_decode_mla(n, inter, bs):
    case = build(40 + n, n, [70, 3, 200], [2, 1, 4], inter=inter, bs=bs, hl=2, hkv=1, dk=576, dv=512, mla=True,
                 scale=0.0721, pad_rows=1)
    results = simulate(n, run_cases, [case])
    check(case, [results[r][0] for r in range(n)])
    check_merges_agree([results[r][0] for r in range(n)])


@pytest.mark.parametrize("mla", [False, True])
def test_dcp_decode_bf16_within_twice_plain_torch(mla):
    dims = dict(dk=576, dv=512, hkv=1, scale=0.0721) if mla else dict(hkv=2)
    case = build(5, 4, [300, 17, 90], [1, 3, 2], inter=2, bs=16, hl=2, dtype=torch.bfloat16, mla=mla, **dims)
    results = simulate(4, run_cases, [case])
    per_rank = [results[r][0] for r in range(4)]
    assert per_rank[0][0].dtype == torch.bfloat16 and per_rank[0][1].dtype == torch.float32
    check(case, per_rank)
    check(case, [(p[2], p[3]) for p in per_rank])


def test_plan_tensors_and_padding():
    table = torch.arange(6).view(2, 3)
    meta = dcp_plan([9, 4], [2, 0], table, dcp_size=2, interleave_size=2, block_size=2, num_tokens=4)
    assert meta.req_indices.tolist() == [0, 0, -1, -1]
    assert meta.positions.tolist() == [7, 8, -1, -1]
    assert meta.kv_lens.tolist() == [[4, 5, 0, 0], [4, 4, 0, 0]]
    assert meta.slot_mapping.tolist() == [[-1, 2 * 2 + 0, -1, -1], [1 * 2 + 1, -1, -1, -1]]


@pytest.mark.slow
def test_plan_tensors_trace_into_one_graph():
    """The plan's tensors come from tensor ops alone: they trace into one graph (aot_eager, fullgraph)."""
    table = torch.arange(6).view(2, 3)
    meta = dcp_plan([9, 4], [2, 0], table, dcp_size=2, interleave_size=2, block_size=2, num_tokens=4)
    f = torch.compile(lambda s, q, bt: plan_tensors(s, q, bt, num_tokens=4, dcp_size=2, interleave_size=2,
                                                    block_size=2), backend="aot_eager", fullgraph=True)
    got = f(torch.tensor([9, 4]), torch.tensor([2, 0]), table)
    assert all(torch.equal(got[k], getattr(meta, k)) for k in got)


def test_errors_are_named():
    table = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="query_lens <= seq_lens"):
        dcp_plan([2], [3], table, dcp_size=2, interleave_size=1, block_size=4)
    with pytest.raises(ValueError, match="widen the block table"):
        dcp_plan([40], [1], table, dcp_size=2, interleave_size=1, block_size=4)
    with pytest.raises(ValueError, match="multiple of interleave_size"):
        dcp_plan([4], [1], table, dcp_size=2, interleave_size=3, block_size=4)
    meta = dcp_plan([4], [1], table, dcp_size=2, interleave_size=1, block_size=4)
    kc = torch.zeros(2, 4, 3, 8)
    with pytest.raises(RuntimeError, match="dcp_size=2"):
        simulate(1, lambda g: dcp_decode(torch.zeros(1, 2, 8), (kc, kc), meta, group=g))
    with pytest.raises(RuntimeError, match="same kv heads"):
        simulate(2, lambda g: dcp_decode(torch.zeros(1, 2, 8), (kc, kc), meta, group=g))
    with pytest.raises(RuntimeError, match="merge must be one of"):
        simulate(2, lambda g: dcp_decode(torch.zeros(1, 3, 8), (kc, kc), meta, group=g, merge="ring"))
    with pytest.raises(RuntimeError, match="T=1"):
        simulate(2, lambda g: dcp_decode(torch.zeros(2, 3, 8), (kc, kc), meta, group=g))


# ---------------------------------------------------------------- DCP-sharded cached context in pcp_prefill
def build_prefill(seed, n, ctx_lens, new_lens, *, inter, bs, hq=4, hkv=2, d=16):
    """Cached context dealt over n DCP ranks + new tokens, and the full causal oracle."""
    gen = torch.Generator().manual_seed(seed)
    seq = [c + m for c, m in zip(ctx_lens, new_lens)]
    k = [torch.randn(s, hkv, d, generator=gen) for s in seq]
    v = [torch.randn(s, hkv, d, generator=gen) for s in seq]
    q_new = torch.cat([torch.randn(m, hq, d, generator=gen) for m in new_lens])
    k_new = torch.cat([x[c:] for x, c in zip(k, ctx_lens)])
    v_new = torch.cat([x[c:] for x, c in zip(v, ctx_lens)])
    local = dcp_local_lens(torch.tensor(ctx_lens), n, inter).max(1).values
    mb = max(1, -(-int(local.max()) // bs)) + 1
    table = torch.randperm(len(seq) * mb + 1, generator=gen)[: len(seq) * mb].view(len(seq), mb)
    pos = torch.cat([torch.arange(c) for c in ctx_lens])
    req = torch.cat([torch.full((c,), i) for i, c in enumerate(ctx_lens)])
    k_ctx = torch.cat([x[:c] for x, c in zip(k, ctx_lens)])
    v_ctx = torch.cat([x[:c] for x, c in zip(v, ctx_lens)])
    caches = []
    for r in range(n):
        kc = torch.full((len(seq) * mb + 1, bs, hkv, d), NAN)
        vc = kc.clone()
        write_kv(kc, vc, k_ctx, v_ctx, dcp_slot_mapping(pos, req, table, dcp_rank=r, dcp_size=n,
                                                          interleave_size=inter, block_size=bs))
        caches.append((kc, vc))
    q_req = torch.cat([torch.full((m,), i) for i, m in enumerate(new_lens)])
    q_pos = torch.cat([torch.arange(c, c + m) for c, m in zip(ctx_lens, new_lens)])
    k_req = torch.cat([torch.full((s,), i) for i, s in enumerate(seq)])
    k_pos = torch.cat([torch.arange(s) for s in seq])
    want, _ = oracle.attention(q_new, torch.cat(k), torch.cat(v), q_req, k_req, q_pos, k_pos)
    cu = [0]
    for m in new_lens:
        cu.append(cu[-1] + m)
    return dict(q=q_new, k=k_new, v=v_new, caches=caches, table=table, ctx=torch.tensor(ctx_lens), cu=cu,
                inter=inter, want=want, hq=hq, n=n)


def prefill_tokens_rank(group, case, method):
    """PCP over the same group that DCP-shards the context: each rank its own tokens, all heads."""
    plan = pcp_plan(case["cu"], group.size, context_lens=case["ctx"].tolist())
    s = lambda x: pcp_shard(x, plan, group.rank)  # noqa: E731
    kc, vc = case["caches"][group.rank]
    ctx = DCPContext(kc, vc, case["table"], case["ctx"], interleave_size=case["inter"])
    return pcp_prefill(s(case["q"]), s(case["k"]), s(case["v"]), plan, group=group, method=method, context=ctx)


def prefill_heads_rank(group, case, merge):
    """PCP = 1, DCP over TP ranks: every rank all tokens, its own heads."""
    plan = pcp_plan(case["cu"], 1, context_lens=case["ctx"].tolist())
    hl = case["hq"] // group.size
    kc, vc = case["caches"][group.rank]
    ctx = DCPContext(kc, vc, case["table"], case["ctx"], interleave_size=case["inter"], group=group,
                     shard="heads", merge=merge)
    heads = range(group.rank * hl, (group.rank + 1) * hl)
    kv = sorted({h // (case["hq"] // case["k"].shape[1]) for h in heads})  # the kv heads this TP rank holds
    one = SimMesh(1).groups()[0]
    s = lambda x: pcp_shard(x, plan, 0)  # noqa: E731 - P = 1 still orders tokens [A | B]
    out = pcp_prefill(s(case["q"][:, heads.start : heads.stop]), s(case["k"][:, kv]), s(case["v"][:, kv]), plan,
                      group=one, context=ctx)
    return pcp_unshard([out], plan)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pcp_prefill_with_dcp_context_tokens(n):
    case = build_prefill(n, n, [0, 37, 5, 130], [9, 14, 1, 23], inter=2, bs=16)
    for method in ("ring", "allgather"):
        parts = simulate(n, prefill_tokens_rank, case, method)
        plan = pcp_plan(case["cu"], n, context_lens=case["ctx"].tolist())
        out = pcp_unshard(parts, plan)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), case["want"], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("n, merge", [(2, "ag_rs"), (4, "a2a")])
def test_pcp_prefill_with_dcp_context_heads(n, merge):
    case = build_prefill(10 + n, n, [50, 0, 3], [6, 4, 2], inter=16, bs=16)
    parts = simulate(n, prefill_heads_rank, case, merge)
    out = torch.cat(parts, dim=1)
    torch.testing.assert_close(out.double(), case["want"], rtol=1e-5, atol=2e-5)


# ---------------------------------------------------------------- real gloo processes (one spawn)
def gloo_rank(group, cases, prefill):
    """All decode cases (both merges), a prefill with DCP context, and dcp_decode compiled fullgraph."""
    res = run_cases(group, cases)
    pre = prefill_tokens_rank(group, prefill, "ring")
    case = cases[0]
    r, hl = group.rank, case["hl"]
    step = torch.compile(
        lambda q: dcp_decode(q, case["caches"][r], case["meta"], group=group, merge="a2a",
                             softmax_scale=case["scale"], v_head_dim=case["dv"]),
        backend="aot_eager", fullgraph=True,
    )
    compiled = step(case["q"][:, r * hl : (r + 1) * hl])
    return res, pre, compiled


@pytest.mark.slow
def test_dcp_decode_gloo():
    """Two gloo ranks (4 gloo ranks of DCP run in test_dcp_variants and test_pcp_dcp; 4 simulated ranks above)."""
    n = 2
    cases = random_cases(n, 100 + n)[:3]
    cases.append(build(77, n, [60, 5], [2, 1], inter=1, bs=16, hl=2, hkv=1, dk=576, dv=512, mla=True,
                       scale=0.0721))
    prefill = build_prefill(200 + n, n, [33, 0, 70], [7, 5, 12], inter=1, bs=16)
    results = spawn(n, gloo_rank, cases, prefill, timeout_s=240)
    for i, case in enumerate(cases):
        per_rank = [results[r][0][i] for r in range(n)]
        check(case, per_rank)
        check_merges_agree(per_rank)
    plan = pcp_plan(prefill["cu"], n, context_lens=prefill["ctx"].tolist())
    out = pcp_unshard([results[r][1] for r in range(n)], plan)
    torch.testing.assert_close(out.double(), prefill["want"], rtol=1e-5, atol=2e-5)
    compiled = torch.cat([results[r][2] for r in range(n)], dim=1)
    eager = torch.cat([results[r][0][0][2] for r in range(n)], dim=1)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
