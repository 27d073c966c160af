"""Fuzz every public op with malformed index arguments; run by tests/test_fuzz_ops.py in a subprocess.

For each op, hypothesis (derandomized: the same examples on every run)
draws shapes and index arguments -- cu_seqlens, block tables, request
indices, key lengths, slot mappings, top-k indices, key ranges -- that are
valid or broken in every way (negative, decreasing, past the tensors they
index, floats). Each call must either raise ValueError or return what a
plain float64 oracle written here computes. Anything else (another
exception, a wrong result) is recorded as a failure; a crash (SIGFPE,
SIGSEGV) kills this process, which the parent test reports.

Prints one JSON line: {op: {"ok": results checked, "value_error": n, "failure": str or null}}.
Usage: python tests/fuzz_ops_worker.py [examples_per_op]
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

import ref as oracle  # noqa: E402
from cpattn import ops, pcp_plan, pcp_shard, pcp_unshard  # noqa: E402
from cpattn.ops import paged  # noqa: E402

NEG = float("-inf")
COUNTS: dict[str, Counter] = {}


def outcome(op: str, call):
    """Run call(); ValueError counts as a named rejection, anything else propagates. Returns the result or None."""
    try:
        res = call()
    except ValueError:
        COUNTS[op]["value_error"] += 1
        return None
    COUNTS[op]["ok"] += 1
    return res


def close(got, want):
    """Same -inf / NaN pattern, other entries within float32 kernel tolerance."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got == NEG, want == NEG)
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all()
    torch.testing.assert_close(got[fin], want[fin], atol=2e-5, rtol=2e-5)


def ints(lo, hi, n_lo=0, n_hi=5):
    return st.lists(st.integers(lo, hi), min_size=n_lo, max_size=n_hi)


def either(data, lo, hi, bad_lo, bad_hi, n):
    """n ints, all in lo..hi (valid) or drawn from the wider bad_lo..bad_hi (often invalid)."""
    return data.draw(st.one_of(ints(lo, hi, n, n), ints(bad_lo, bad_hi, n, n)))


def distinct_valid(values):
    """Repeated non-negative entries become -1: the ops want distinct slots / rows (not checked)."""
    seen, out = set(), []
    for v in values:
        out.append(-1 if v >= 0 and v in seen else v)
        seen.add(v)
    return out


def index_tensor(data, values, float_ok=True):
    """A tensor of the drawn values: int64, int32, or (sometimes) float, which must be refused."""
    kind = data.draw(st.sampled_from(["int64", "int32", "int64", "int32", "float"] if float_ok else ["int64"]))
    dtype = {"int64": torch.int64, "int32": torch.int32, "float": torch.float32}[kind]
    return torch.tensor(values, dtype=dtype)


def cu_list(data, total, b):
    """A valid cumulative list ending at <= total, or garbage."""
    if data.draw(st.booleans()):
        cuts = sorted(data.draw(ints(0, total, b, b)))
        return [0, *cuts]
    return data.draw(ints(-3, total + 3, 1, b + 2))


SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- attention_with_lse
def attention_oracle(q, k, v, cq, ck, causal):
    tq, tk = q.shape[0], k.shape[0]
    q_req, q_pos = torch.full((tq,), -1), torch.zeros(tq, dtype=torch.long)
    k_req, k_pos = torch.full((tk,), -2), torch.zeros(tk, dtype=torch.long)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        q_req[cq[b] : cq[b + 1]] = b
        q_pos[cq[b] : cq[b + 1]] = torch.arange(lq) + lk - lq
        k_req[ck[b] : ck[b + 1]] = b
        k_pos[ck[b] : ck[b + 1]] = torch.arange(lk)
    return oracle.attention(q, k, v, q_req, k_req, q_pos, k_pos, causal=causal)


def fuzz_attention(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        tq, tk, b = data.draw(st.integers(0, 9)), data.draw(st.integers(0, 9)), data.draw(st.integers(0, 3))
        hkv, g = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
        causal = data.draw(st.booleans())
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        q = torch.randn(tq, hkv * g, 8, generator=gen, dtype=dtype)
        k, v = torch.randn(tk, hkv, 8, generator=gen, dtype=dtype), torch.randn(tk, hkv, 8, generator=gen, dtype=dtype)
        if data.draw(st.booleans()):  # well formed (the result is checked)
            cq, ck = [0, *sorted(data.draw(ints(0, tq, b, b)))], [0, *sorted(data.draw(ints(0, tk, b, b)))]
            cu_q, cu_k = torch.tensor(cq), torch.tensor(ck, dtype=torch.int32)
        else:
            cq, ck = cu_list(data, tq, b), cu_list(data, tk, b)
            cu_q, cu_k = index_tensor(data, cq), index_tensor(data, ck)
        res = outcome("attention_with_lse",
                      lambda: ops.attention_with_lse(q, k, v, cu_q, cu_k, causal=causal))
        if res is not None:
            want_out, want_lse = attention_oracle(q, k, v, cq, ck, causal)
            close(res[0], want_out)
            close(res[1], want_lse)

    run()


# ----------------------------------------------------------------------------- paged attention
def paged_oracle(q, kc, vc, table, req, lens):
    t, hq, _ = q.shape
    bs = kc.shape[1]
    out = torch.zeros(t, hq, vc.shape[-1], dtype=torch.float64)
    lse = torch.full((t, hq), NEG, dtype=torch.float64)
    for i in range(t):
        if req[i] < 0 or lens[i] == 0:
            continue
        keys = [(table[req[i]][j // bs], j % bs) for j in range(lens[i])]
        kk = torch.stack([kc[blk, off] for blk, off in keys])  # [L, Hkv, D]
        vv = torch.stack([vc[blk, off] for blk, off in keys])
        z = torch.zeros(len(keys), dtype=torch.long)
        o, l = oracle.attention(q[i : i + 1], kk, vv, z[:1], z, causal=False)
        out[i], lse[i] = o[0], l[0]
    return out, lse


def fuzz_paged(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        nb, bs, w = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([2, 4])), data.draw(st.integers(1, 3))
        b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 4))
        hkv, g = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        kc, vc = torch.randn(nb, bs, hkv, 8, generator=gen), torch.randn(nb, bs, hkv, 8, generator=gen)
        q = torch.randn(t, hkv * g, 8, generator=gen)
        table = [either(data, 0, nb - 1, -2, nb + 1, w) for _ in range(b)]
        req = either(data, -1, b - 1, -2, b + 1, t)
        lens = either(data, 0, w * bs, -2, w * bs + 2, t)
        bt, rq, kl = index_tensor(data, table), index_tensor(data, req), index_tensor(data, lens)
        paged.SMALL_ELEMS = data.draw(st.sampled_from([0, 1 << 20]))  # the flash loop or the batched path
        res = outcome("paged_attention_with_lse", lambda: ops.paged_attention_with_lse(q, kc, vc, bt, rq, kl))
        if res is not None:
            want_out, want_lse = paged_oracle(q, kc, vc, table, req, lens)
            close(res[0], want_out)
            close(res[1], want_lse)

    run()
    paged.SMALL_ELEMS = 1 << 20


# ----------------------------------------------------------------------------- write_kv / write_kv_mla
def fuzz_write_kv(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        nb, bs, t = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([2, 4])), data.draw(st.integers(0, 5))
        mla = data.draw(st.booleans())
        lo, hi = data.draw(st.sampled_from([(-1, nb * bs - 1), (-3, nb * bs + 2)]))  # valid slots, or anything
        slots = distinct_valid(data.draw(ints(lo, hi, t, t)))
        sm = index_tensor(data, slots)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        if mla:
            cache = torch.full((nb, bs, 1, 12), float("nan"))
            c, pe = torch.randn(t, 8, generator=gen), torch.randn(t, 4, generator=gen)
            res = outcome("write_kv_mla", lambda: ops.write_kv_mla(cache, c, pe, sm) or "written")
            want = torch.full_like(cache, float("nan")).view(-1, 1, 12)
            rows = torch.cat([c, pe], dim=-1)[:, None]
            got = cache.view(-1, 1, 12)
        else:
            cache = torch.full((nb, bs, 2, 8), float("nan"))
            vcache = cache.clone()
            k, v = torch.randn(t, 2, 8, generator=gen), torch.randn(t, 2, 8, generator=gen)
            res = outcome("write_kv", lambda: ops.write_kv(cache, vcache, k, v, sm) or "written")
            want = torch.full_like(cache, float("nan")).view(-1, 2, 8)
            rows = k
            got = cache.view(-1, 2, 8)
        if res is not None:
            for i, s in enumerate(slots):
                if s >= 0:
                    want[s] = rows[i]
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])

    run()


# ----------------------------------------------------------------------------- DSA ops
def fuzz_indexer(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        t, s = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 6))
        vis = either(data, 0, s, -2, s + 2, t)
        start = data.draw(st.one_of(st.just([data.draw(st.integers(0, s - v)) if v <= s else 0 for v in vis]),
                                    ints(-2, s + 2, t, t)))
        need = max(vis, default=0)
        max_keys = data.draw(st.one_of(st.none(), st.integers(max(need, 0), s + 2), st.integers(-1, s + 2),
                                       st.just(2.5)))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        q, w, k = torch.randn(t, 2, 8, generator=gen), torch.rand(t, 2, generator=gen), torch.randn(s, 8, generator=gen)
        ks, vs = index_tensor(data, start), index_tensor(data, vis)
        res = outcome("indexer_scores", lambda: ops.indexer_scores(q, w, k, ks, vs, max_keys))
        if res is not None:
            m = max(vis, default=0) if max_keys is None else max_keys
            want = torch.full((t, m), NEG, dtype=torch.float64)
            for i in range(t):
                for j in range(vis[i]):
                    kk = k[start[i] + j].double()
                    want[i, j] = sum(w[i, h].double() * torch.relu(q[i, h].double() @ kk) for h in range(2))
            close(res, want)

    run()


def fuzz_topk(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        t, s = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6))
        kk = data.draw(st.one_of(st.integers(1, 7), st.integers(-1, 0), st.just(1.5)))
        vals = st.sampled_from([NEG, float("nan"), -1.0, 0.0, 0.5, 2.0])
        scores = torch.tensor([data.draw(st.lists(vals, min_size=s, max_size=s)) for _ in range(t)]).view(t, s)
        res = outcome("topk_indices", lambda: ops.topk_indices(scores, kk))
        if res is not None:
            for i in range(t):
                live = [(-float(scores[i, j]), j) for j in range(s)
                        if not math.isnan(scores[i, j]) and scores[i, j] > NEG]
                want = [j for _, j in sorted(live)][:kk]
                assert res[i].tolist() == want + [-1] * (kk - len(want)), (res[i].tolist(), want)

    run()


def fuzz_sparse(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        t, s, kk = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6)), data.draw(st.integers(1, 4))
        lo, hi = data.draw(st.sampled_from([(-1, s - 1), (-3, s + 2)]))  # valid rows, or anything
        idx = [distinct_valid(data.draw(ints(lo, hi, kk, kk))) for _ in range(t)]
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        q, cache = torch.randn(t, 2, 12, generator=gen), torch.randn(s, 12, generator=gen)
        it = index_tensor(data, idx) if t else torch.zeros(0, kk, dtype=torch.long)
        res = outcome("sparse_mla_attention_with_lse",
                      lambda: ops.sparse_mla_attention_with_lse(q, cache, it, softmax_scale=0.3, v_head_dim=8))
        if res is not None:
            want_out = torch.zeros(t, 2, 8, dtype=torch.float64)
            want_lse = torch.full((t, 2), NEG, dtype=torch.float64)
            for i in range(t):
                rows = [r for r in idx[i] if r >= 0]
                if rows:
                    kv = cache[rows].double()  # [K, 12]
                    z = torch.zeros(len(rows), dtype=torch.long)
                    o, l = oracle.attention(q[i : i + 1], kv[:, None], kv[:, None, :8], z[:1], z, scale=0.3,
                                            causal=False)
                    want_out[i], want_lse[i] = o[0], l[0]
            close(res[0], want_out)
            close(res[1], want_lse)

    run()


# ----------------------------------------------------------------------------- merge, plan
def fuzz_merge(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        parts, t = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
        vals = st.sampled_from([NEG, float("nan"), -300.0, -1.0, 0.0, 3.0])
        lses = torch.tensor([data.draw(st.lists(vals, min_size=t, max_size=t)) for _ in range(parts)]).view(parts, t, 1)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        outs = torch.randn(parts, t, 1, 4, generator=gen)
        outs = torch.where((lses == NEG)[..., None], float("nan"), outs)  # empty partials hold garbage
        if data.draw(st.sampled_from([False, False, False, True])):  # mismatched shapes
            lses = lses[:, :-1]
        res = outcome("merge_attn_states", lambda: ops.merge_attn_states(outs, lses))
        if res is not None:
            ld = lses.double()
            empty = ld == NEG
            want_lse = torch.where(empty.all(0), NEG, torch.logsumexp(ld, 0))  # NaN in -> NaN out
            w = torch.where(empty, 0.0, torch.exp(ld - want_lse))
            want_out = (w[..., None] * torch.where(empty[..., None], 0.0, outs.double())).sum(0)
            close(res[1], want_lse)
            close(res[0], want_out)

    run()


def fuzz_pcp_plan(n):
    @settings(max_examples=n, **SETTINGS)
    @given(st.data())
    def run(data):
        cu = data.draw(st.one_of(ints(-2, 12, 0, 4), st.lists(st.sampled_from([0, 1.5, 3, 4.0]), max_size=3)))
        if data.draw(st.sampled_from([True, True, False])) and all(isinstance(c, int) for c in cu):
            cu = [0, *sorted(c for c in cu if c >= 0)]
        p = data.draw(st.sampled_from([1, 2, 3, 1, 2, 3, 0, -1]))
        rank = data.draw(st.sampled_from([*range(max(p, 1)), *range(max(p, 1)), -1, 4]))

        def call():
            plan = pcp_plan(cu, p)
            x = torch.arange(cu[-1])
            return plan, x, pcp_shard(x, plan, rank), [pcp_shard(x, plan, r) for r in range(p)]

        res = outcome("pcp_plan/pcp_shard", call)
        if res is not None:
            plan, x, mine, parts = res
            assert torch.equal(pcp_unshard(parts, plan), x) and torch.equal(mine, parts[rank])

    run()


FUZZERS = {
    "attention_with_lse": fuzz_attention, "paged_attention_with_lse": fuzz_paged, "write_kv": fuzz_write_kv,
    "indexer_scores": fuzz_indexer, "topk_indices": fuzz_topk, "sparse_mla_attention_with_lse": fuzz_sparse,
    "merge_attn_states": fuzz_merge, "pcp_plan/pcp_shard": fuzz_pcp_plan,
}


def main() -> int:
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    report = {}
    for name in [*FUZZERS, "write_kv_mla"]:
        COUNTS[name] = Counter()
    failures = {}
    for name, fuzz in FUZZERS.items():
        try:
            fuzz(n)
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            failures[name] = f"{type(e).__name__}: {e}"[:2000]
    for name, c in COUNTS.items():
        report[name] = {"ok": c["ok"], "value_error": c["value_error"], "failure": failures.get(name)}
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
