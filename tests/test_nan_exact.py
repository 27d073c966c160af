"""NaN in the data reaches exactly the rows (and heads, and dims) it reaches on one device, in every layout.

One NaN is put in one key or one value (one kv head, one dim). The expected
set is written from visibility alone: the rows of that request that see the
key, the query heads reading that kv head, and (for a value) that one dim;
for a key every dim of the row. One device must give exactly that set, every
CP layout must give the very same set, and every other element must equal
the float64 oracle of the clean data (a row that cannot see the key cannot
depend on it). Memory no row may read stays NaN-poisoned throughout.
"""

import pytest
import torch

import cpattn
import ref as oracle
from cpattn import attention_with_lse
from cpattn.dcp import dcp_decode, dcp_plan
from cpattn.layout.dcp import dcp_slot_mapping
from cpattn.ops import paged
from cpattn.ops.rows import write_kv
from test_dsa_cp import DV, SCALE, case, cp_rank, dcp_rank
from test_pcp import make, reference, run_sim

NAN = float("nan")
DIM = 3  # the poisoned dim


def expected(q_req, q_pos, bad_req, bad_pos, kv_head, hq, hkv, dv, what):
    """[T, Hq, Dv] bool: the elements a NaN in key/value (bad_req, bad_pos, kv_head, DIM) reaches."""
    rows = (q_req == bad_req) & (q_pos >= bad_pos)  # [T]
    heads = torch.arange(hq) // (hq // hkv) == kv_head  # [Hq]
    dims = torch.ones(dv, dtype=torch.bool) if what == "k" else torch.arange(dv) == DIM
    return rows[:, None, None] & heads[None, :, None] & dims[None, None, :]


def check(out, want_nan, clean, lse=None, what="k"):
    """NaN exactly at want_nan; every other element equal to the clean float64 oracle."""
    assert torch.equal(out.isnan(), want_nan), (int(out.isnan().sum()), int(want_nan.sum()))
    torch.testing.assert_close(out.double()[~want_nan], clean[~want_nan], atol=2e-6, rtol=1e-5)
    if lse is not None:  # a NaN score makes the LSE NaN; a NaN value does not touch it
        assert torch.equal(lse.isnan(), want_nan.any(-1) if what == "k" else torch.zeros_like(lse, dtype=torch.bool))


# ----------------------------------------------------------------------------- PCP prefill
@pytest.mark.parametrize("what", ["k", "v"])
@pytest.mark.parametrize("lens, bad", [([300], 200), ([37, 50, 9], 37 + 21), ([5, 6], 5)])
def test_pcp_nan_rows_match_one_device(what, lens, bad, one_thread):
    q, k, v, cu, _ = make(lens)
    clean, _ = reference(q, k, v, cu, None, None)
    (k if what == "k" else v)[bad, 0, DIM] = NAN
    req, pos = oracle.req_pos(cu.tolist())
    want = expected(req, pos, int(req[bad]), int(pos[bad]), 0, q.shape[1], k.shape[1], v.shape[-1], what)
    one, one_lse = attention_with_lse(q, k, v, cu, cu, causal=True)
    check(one, want, clean, one_lse, what)
    if lens == [300]:
        assert int(one.isnan().any(-1).any(-1).sum()) == 100  # rows 200..299, as the causal mask says
    for p in (2, 4):
        for method in ("ring", "allgather"):
            out, lse = run_sim(p, q, k, v, cu, method, return_lse=True)
            check(out, want, clean, lse, what)


# ----------------------------------------------------------------------------- DCP decode
def dcp_case(n, seq_lens, query_lens, bad, what, *, inter=1, bs=4, hl=2, hkv=2, d=16, seed=0):
    """Caches of n DCP ranks (NaN-poisoned where unwritten) holding the sequences, one NaN planted at bad."""
    g = torch.Generator().manual_seed(seed)
    hq = n * hl
    ks = [torch.randn(s, hkv, d, generator=g) for s in seq_lens]
    vs = [torch.randn(s, hkv, d, generator=g) for s in seq_lens]
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=g)
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    req = torch.cat([torch.full((s,), i) for i, s in enumerate(seq_lens)])
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    q_req = torch.cat([torch.full((ql,), i) for i, ql in enumerate(query_lens)])
    q_pos = torch.cat([torch.arange(s - ql, s) for s, ql in zip(seq_lens, query_lens)])
    clean, _ = oracle.attention(q, k_all, v_all, q_req, req, q_pos, pos)
    row = sum(seq_lens[: bad[0]]) + bad[1]
    (k_all if what == "k" else v_all)[row, 0, DIM] = NAN
    mb = -(-max(seq_lens) // bs) + 1
    table = torch.randperm(len(seq_lens) * mb + 2, generator=g)[: len(seq_lens) * mb].view(len(seq_lens), mb)
    caches = []
    for r in range(n):
        kc = torch.full((table.numel() + 2, bs, hkv, d), NAN)
        vc = torch.full_like(kc, NAN)
        write_kv(kc, vc, k_all, v_all, dcp_slot_mapping(pos, req, table, dcp_rank=r, dcp_size=n,
                                                         interleave_size=inter, block_size=bs))
        caches.append((kc, vc))
    meta = dcp_plan(seq_lens, query_lens, table, dcp_size=n, interleave_size=inter, block_size=bs)
    want = expected(q_req, q_pos, bad[0], bad[1], 0, hq, hkv, d, what)
    return q, caches, meta, clean, want


def dcp_rank_fn(group, q, caches, meta, merge):
    hl = q.shape[1] // group.size
    return dcp_decode(q[:, group.rank * hl : (group.rank + 1) * hl], caches[group.rank], meta, group=group,
                      merge=merge, return_lse=True)


@pytest.mark.parametrize("what", ["k", "v"])
@pytest.mark.parametrize("path", ["small", "flash"])
def test_dcp_decode_nan_rows_match_one_device(what, path, monkeypatch, one_thread):
    if path == "flash":  # the chunked flash kernel, with its masked chunks
        monkeypatch.setattr(paged, "SMALL_ELEMS", 0)
    # request 0: 3 query rows at 17, 18, 19 and a NaN at 18 (row 17 must not see it); others untouched
    seq_lens, query_lens, bad = [20, 9, 13], [3, 1, 2], (0, 18)
    hl = 2
    for n in (2, 3):
        q, caches1, meta1, clean, want = dcp_case(1, seq_lens, query_lens, bad, what, hl=n * hl)
        one, one_lse = cpattn.simulate(1, dcp_rank_fn, q, caches1, meta1, "ag_rs")[0]
        check(one, want, clean, one_lse, what)
        q, caches, meta, clean, want = dcp_case(n, seq_lens, query_lens, bad, what, hl=hl)
        for merge in ("ag_rs", "a2a"):
            parts = cpattn.simulate(n, dcp_rank_fn, q, caches, meta, merge)
            out, lse = torch.cat([o for o, _ in parts], dim=1), torch.cat([l for _, l in parts], dim=1)
            check(out, want, clean, lse, what)
            assert torch.equal(out.isnan(), one.isnan())


# ----------------------------------------------------------------------------- DSA
def dsa_nan_case(lens, ctx, bad_req, bad_pos, seed):
    """A DSA case with the latent of (bad_req, bad_pos) set to NaN; expected NaN rows from the selection.

    bad_pos None picks the best key of the request's first query (a key some query surely selects).
    """
    c = case(lens, ctx, h=4, topk=4, seed=seed)
    cu_k = c["cu_k"].tolist()
    if bad_pos is None:
        bad_pos = int(c["want_idx"][sum(lens[:bad_req]), 0])
    c["full_latent"][cu_k[bad_req] + bad_pos] = NAN
    if bad_pos < c["ctx"][bad_req]:  # a cached token: in the replicated cache
        c["cache"][0][c["starts"][bad_req] + bad_pos] = NAN
    else:  # a new token: in the packed new-token latents
        row = sum(lens[:bad_req]) + bad_pos - c["ctx"][bad_req]
        c["new_latent"][row] = NAN
    qreq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rows = ((c["want_idx"] == bad_pos) & (qreq == bad_req)[:, None]).any(1)  # queries that selected it
    assert rows.any() and not rows.all()  # the case must be able to fail both ways
    c["want_nan"] = rows[:, None, None].expand(-1, *c["want"].shape[1:])
    return c


@pytest.mark.parametrize("lens, ctx, bad", [
    ([13, 7], None, (0, 5)),  # prefill, a new token's latent
    ([1, 1, 1], [20, 3, 9], (0, None)),  # decode, a cached token's latent
    ([4, 1], [6, 9], (1, None)),
])
def test_dsa_nan_rows_match_one_device(lens, ctx, bad, one_thread):
    c = dsa_nan_case(lens, ctx, *bad, seed=3)
    from cpattn import pcp_unshard
    from cpattn.dsa import dsa_attention, dsa_cp_plan

    one, one_lse = dsa_attention(c["q"], c["full_latent"], c["q_idx"], c["w_idx"], c["full_k"], c["cu_q"], c["cu_k"],
                                 topk=c["topk"], softmax_scale=SCALE, v_head_dim=DV, return_lse=True)
    check(one, c["want_nan"], c["want"], one_lse)
    for n in (2, 3):
        for split in ("contiguous", "balanced"):
            per_rank = cpattn.simulate(n, cp_rank, [c], split, "token")
            plan = dsa_cp_plan(c["cu_q"], n, context_lens=c["ctx"], cache_starts=c["starts"], split=split)
            out = pcp_unshard([r[0][0] for r in per_rank], plan)
            lse = pcp_unshard([r[0][1] for r in per_rank], plan)
            check(out, c["want_nan"], c["want"], lse)
        for interleave_size in (1, 2):
            res = cpattn.simulate(n, dcp_rank, [c], interleave_size, "replicated")
            out, lse, ids = res[0][0]
            assert torch.equal(ids, c["want_idx"])
            check(out, c["want_nan"], c["want"], lse)
