"""Paged-cache ops: write_kv, write_kv_mla, paged_attention_with_lse.

The attention oracle is written here plainly in float64: for each query row,
collect its request's visible keys by walking the block table one local index
at a time, then a dense softmax. Caches are poisoned with NaN everywhere no
token was written.
"""

import pytest
import torch

from devices import needs_cuda
from ref import PagedCase, paged_attention, paged_cache, plain_error

from cpattn.graphs.check import agree
from cpattn.ops import paged
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.rows import write_kv, write_kv_mla
from cpattn.ops.paged_ref import paged_attention_ref, write_kv_ref


CASES = [
    PagedCase((37, 5, 0), ((0, 30), (0, 31), (0, 37), (1, 5), (2, 0), (-1, 0)), 16, 4, 2, 32, 32,
              note="decode and spec rows, an empty request, a padding row"),
    PagedCase((130, 1), ((0, 128), (0, 129), (0, 129), (0, 130), (1, 1)), 128, 8, 8, 64, 64,
              note="MHA, rows across a block edge"),
    PagedCase((70,), tuple((0, 70 - 40 + i // 2) for i in range(40)), 16, 2, 1, 16, 16, note="a prefill chunk of 40 rows"),
    PagedCase((20, 9), ((0, 20), (1, 0), (1, 9), (0, 3)), 16, 6, 3, 16, 24, note="Dv > Dk, request runs interleaved"),
]


def case_args(case):
    """CASES[case] as float32 op arguments (q, k_cache, v_cache, block_table, req_indices, kv_lens)."""
    return CASES[case].args(torch.float32, seed=case)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c.id for c in CASES])
@pytest.mark.parametrize("small_elems, chunk_elems", [
    (1 << 40, 1 << 18),  # the batched small-batch path
    (0, 1 << 18),  # the per-request flash path, one chunk per request
    (0, 512),  # ... many chunks per request
])
def test_paged_attention_matches_oracle_fp32(case, small_elems, chunk_elems, monkeypatch):
    monkeypatch.setattr(paged, "SMALL_ELEMS", small_elems)
    monkeypatch.setattr(paged, "SMALL_ROW_ELEMS", small_elems)
    monkeypatch.setattr(paged, "CHUNK_ELEMS", chunk_elems)
    q, k_cache, v_cache, table, req, lens = case_args(case)
    want_o, want_l = paged_attention(q, k_cache, v_cache, table, req, lens, 0.3)
    for fn in (paged_attention_with_lse, None):
        if fn is None:  # the plain reference, in float64
            o, l = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, req, lens, 0.3)
        else:
            o, l = fn(q, k_cache, v_cache, table, req, lens, softmax_scale=0.3)
            assert o.dtype == torch.float32 and l.dtype == torch.float32
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(l.double(), want_l, rtol=1e-5, atol=2e-5)
        empty = (req < 0) | (lens == 0)
        assert (l[empty] == float("-inf")).all() and (o[empty] == 0).all()


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("small_elems", [1 << 40, 0])  # batched path, per-request flash path
def test_paged_attention_bf16_within_twice_plain_torch(mla, small_elems, monkeypatch):
    monkeypatch.setattr(paged, "SMALL_ELEMS", small_elems)
    monkeypatch.setattr(paged, "SMALL_ROW_ELEMS", small_elems)
    gen = torch.Generator().manual_seed(7)
    dk, dv, hkv, hq = (576, 512, 1, 8) if mla else (64, 64, 2, 8)
    kv_lens = [300, 77]
    k_cache, v_cache, table = paged_cache(gen, kv_lens, 16, hkv, dk, dv, torch.bfloat16, mla=mla)
    rows = [(0, 298), (0, 299), (0, 300), (1, 77)]
    q = torch.randn(len(rows), hq, dk, generator=gen).bfloat16()
    req = torch.tensor([r for r, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    scale = 0.1 if mla else None
    o, l = paged_attention_with_lse(q, k_cache, v_cache, table, req, lens, softmax_scale=scale)
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32
    s = scale or dk**-0.5
    want, want_l = paged_attention(q, k_cache, v_cache, table, req, lens, s)
    err = (o.double() - want).abs().max().item()
    # plain torch in bf16 on the same keys: pack each row's visible keys as its own request
    ks, vs, q_req, k_req, q_pos, k_pos = [], [], [], [], [], []
    for i, (b, n) in enumerate(rows):
        for j in range(n):
            blk, off = int(table[b, j // 16]), j % 16
            ks.append(k_cache[blk, off].double())
            vs.append(v_cache[blk, off].double())
            k_req.append(i)
            k_pos.append(j)
        q_req.append(i)
        q_pos.append(n)
    plain = plain_error(q.double(), torch.stack(ks), torch.stack(vs), torch.tensor(q_req), torch.tensor(k_req),
                        torch.tensor(q_pos), torch.tensor(k_pos), torch.bfloat16, scale=s)
    assert err <= 2 * plain + 1e-6, (err, plain)
    torch.testing.assert_close(l.double(), want_l, rtol=1e-5, atol=2e-4)  # fp32 LSE of bf16 inputs


@needs_cuda
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c.id for c in CASES])
def test_cuda_paged_attention_and_write_kv_match_the_oracle(case):
    q, k_cache, v_cache, table, req, lens = case_args(case)
    want_o, want_l = paged_attention(q, k_cache, v_cache, table, req, lens, 0.3)
    dev = [x.cuda() for x in (q, k_cache, v_cache, table, req, lens)]
    o, l = paged_attention_with_lse(*dev, softmax_scale=0.3)
    torch.testing.assert_close(o.double().cpu(), want_o, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(l.double().cpu(), want_l, rtol=1e-5, atol=2e-5)
    k, v = torch.randn(3, *k_cache.shape[2:]), torch.randn(3, *v_cache.shape[2:])
    slots = torch.tensor([4, -1, 1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(want_k, want_v, k, v, slots)
    got_k, got_v = k_cache.cuda(), v_cache.cuda()
    write_kv(got_k, got_v, k.cuda(), v.cuda(), slots.cuda())
    assert torch.equal(got_k.cpu().nan_to_num(9.0), want_k.nan_to_num(9.0))
    assert torch.equal(got_v.cpu().nan_to_num(9.0), want_v.nan_to_num(9.0))


def _traced(fn, backend="aot_eager"):
    """fn compiled as a captured step would be: its CPU decompositions are traced, not called."""
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, len(CASES)))],
                         ids=[c.id for c in CASES])
def test_traced_decomposition_matches_oracle(case, backend):
    q, k_cache, v_cache, table, req, lens = case_args(case)
    want_o, want_l = paged_attention(q, k_cache, v_cache, table, req, lens, 0.3)
    o, l = _traced(paged_attention_with_lse, backend)(q, k_cache, v_cache, table, req, lens, softmax_scale=0.3)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(l.double(), want_l, rtol=1e-5, atol=2e-5)
    eager = paged_attention_with_lse(q, k_cache, v_cache, table, req, lens, softmax_scale=0.3)
    # captured vs eager: check_static's bound (inductor sums a row's keys in its own order: a few ulps);
    # both are within 2e-6 of float64 here, the compiled one no further than the eager one
    assert agree(o, eager[0]) and agree(l, eager[1])
    assert (o.double() - want_o).abs().max() <= (eager[0].double() - want_o).abs().max() + 1e-6


@pytest.mark.parametrize("backend", [None, pytest.param("aot_eager", marks=pytest.mark.slow),
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_unused_table_entries_may_hold_any_id(backend):
    """Columns past a row's visible keys are never read into a result, whatever id (or -1) they hold."""
    gen = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(6, 4, 1, 16, generator=gen), torch.randn(6, 4, 1, 16, generator=gen)
    q = torch.randn(3, 2, 16, generator=gen)
    req, lens = torch.tensor([0, 1, 1]), torch.tensor([7, 3, 12])
    fn = paged_attention_with_lse if backend is None else _traced(paged_attention_with_lse, backend)
    good = fn(q, kc, vc, torch.tensor([[0, 1, -1, -1], [2, 3, 4, -1]]), req, lens)
    odd = fn(q, kc, vc, torch.tensor([[0, 1, 6, 10**6], [2, 3, 4, 10**6]]), req, lens)
    assert torch.equal(good[0], odd[0]) and torch.equal(good[1], odd[1])
    want_o, want_l = paged_attention(q, kc, vc, torch.tensor([[0, 1, 0, 0], [2, 3, 4, 0]]), req, lens, 16**-0.5)
    torch.testing.assert_close(good[0].double(), want_o, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(good[1].double(), want_l, rtol=1e-5, atol=2e-5)


def _graph_ops(fn, *args):
    """The cpattn ops left as calls in fn's traced graph."""
    found = []

    def backend(gm, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "cpattn" in str(n.target))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return found


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_small_cpu_steps_trace_the_decompositions_and_large_ones_keep_the_op(monkeypatch):
    q, kc, vc, table, req, lens = _op_args()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)

    def step(q, kc, vc, k, v, slots):
        write_kv(kc, vc, k, v, slots)
        return paged_attention_with_lse(q, kc, vc, table, req, lens)

    args = (q, kc.clone(), vc.clone(), k, v, torch.tensor([5, -1, 30]))
    assert _graph_ops(step, *args) == []  # everything inlined: inductor can fuse it
    assert set(paged.registry.decompositions()) >= {"paged_attention_with_lse", "write_kv", "write_kv_mla"}
    monkeypatch.setattr(paged, "SMALL_ELEMS", 0)  # too big for the static path: the chunked kernel, opaque
    assert _graph_ops(step, *args) == ["cpattn.paged_attention_with_lse.default"]
    monkeypatch.setattr(paged, "SMALL_ELEMS", 1 << 40)
    f64 = [a.double() if a.is_floating_point() else a for a in args]
    assert _graph_ops(step, *f64) == ["cpattn.paged_attention_with_lse.default"]  # float64: the reference op


def test_eager_kernel_picks_its_path_by_the_visible_length(monkeypatch):
    """A wide block table with short rows still takes the batched path; long rows take the flash loop."""
    calls = []
    small = paged._paged_small
    monkeypatch.setattr(paged, "_paged_small", lambda *a, **k: calls.append(k["n_blk"]) or small(*a, **k))
    gen = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(600, 16, 2, 32, generator=gen), torch.randn(600, 16, 2, 32, generator=gen)
    table = torch.arange(600).view(2, 300)  # 4800 addressable keys per row
    q = torch.randn(2, 8, 32, generator=gen)
    for lens, want in (([40, 17], [3]), ([4000, 17], [])):  # 3 blocks x 2 x 32 per row: small; 4000 keys: not
        calls.clear()
        out = paged_attention_with_lse(q, kc, vc, table, torch.tensor([0, 1]), torch.tensor(lens))
        assert calls == want
        ref = paged_attention(q, kc, vc, table, torch.tensor([0, 1]), torch.tensor(lens), 32**-0.5)
        torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-5, atol=2e-5)


def test_mla_shared_view_gathers_once_and_matches_padded_values():
    gen = torch.Generator().manual_seed(3)
    latent, _, table = paged_cache(gen, [50], 16, 1, 576, 512, torch.float32, mla=True)
    q = torch.randn(2, 4, 576, generator=gen)
    req, lens = torch.tensor([0, 0]), torch.tensor([49, 50])
    shared = paged_attention_with_lse(q, latent, latent[..., :512], table, req, lens, softmax_scale=0.07)
    copied = paged_attention_with_lse(q, latent, latent[..., :512].contiguous(), table, req, lens, softmax_scale=0.07)
    torch.testing.assert_close(shared[0], copied[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1], copied[1], rtol=1e-5, atol=1e-5)
    assert shared[0].shape == (2, 4, 512)


def test_write_kv_matches_reference_and_skips_minus_one():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 4, generator=gen)
    slots = torch.tensor([-1, 5, 17, -1, 0, 30])
    got_k, got_v = torch.full((4, 8, 2, 8), float("nan")), torch.full((4, 8, 2, 4), float("nan"))
    ref_k, ref_v = got_k.clone(), got_v.clone()
    write_kv(got_k, got_v, k, v, slots)
    write_kv_ref(ref_k, ref_v, k, v, slots)
    assert torch.equal(got_k.nan_to_num(9.0), ref_k.nan_to_num(9.0))
    assert torch.equal(got_v.nan_to_num(9.0), ref_v.nan_to_num(9.0))
    assert int(got_k.isnan().any(-1).any(-1).sum()) == 32 - 4  # exactly four slots written
    # all slots -1: nothing changes (NaN stays NaN, including slot 0)
    before = got_k.clone()
    write_kv(got_k, got_v, k, v, torch.full((6,), -1))
    assert torch.equal(got_k.nan_to_num(9.0), before.nan_to_num(9.0))
    write_kv(got_k, got_v, k[:0], v[:0], slots[:0])  # zero tokens


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("slots", [[-1, 5, 17, -1, 0, 30],  # skipped and written slots
                                   pytest.param([-1] * 6, marks=pytest.mark.slow),  # nothing written
                                   pytest.param([3, 2, 1, 0, 31, 30], marks=pytest.mark.slow)])  # reversed order
def test_write_kv_traced_decomposition_matches_the_kernel(slots):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 4, generator=gen)
    slots = torch.tensor(slots)
    got_k, got_v = torch.full((4, 8, 2, 8), float("nan")), torch.full((4, 8, 2, 4), float("nan"))
    want_k, want_v = got_k.clone(), got_v.clone()
    _traced(write_kv)(got_k, got_v, k, v, slots)
    write_kv_ref(want_k, want_v, k, v, slots)
    assert torch.equal(got_k.nan_to_num(9.0), want_k.nan_to_num(9.0))
    assert torch.equal(got_v.nan_to_num(9.0), want_v.nan_to_num(9.0))
    cache, want = torch.full((3, 4, 1, 576), float("nan")), torch.full((3, 4, 1, 576), float("nan"))
    c, pe = torch.randn(6, 512, generator=gen), torch.randn(6, 64, generator=gen)
    _traced(write_kv_mla)(cache, c, pe, slots.clamp(max=11))
    for i, s in enumerate(slots.clamp(max=11).tolist()):
        if s >= 0:
            want[s // 4, s % 4, 0] = torch.cat([c[i], pe[i]])
    assert torch.equal(cache.nan_to_num(9.0), want.nan_to_num(9.0))


def test_write_kv_casts_to_cache_dtype_and_mla_variant():
    kc, vc = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    write_kv(kc, vc, torch.full((1, 1, 8), 1.5), torch.full((1, 1, 8), 2.5), torch.tensor([7]))
    assert kc[1, 3].float().eq(1.5).all() and vc[1, 3].float().eq(2.5).all()
    cache = torch.full((3, 4, 1, 576), float("nan"))
    c, pe = torch.randn(3, 512), torch.randn(3, 64)
    write_kv_mla(cache, c, pe, torch.tensor([9, -1, 2]))
    assert torch.equal(cache[2, 1, 0], torch.cat([c[0], pe[0]]))
    assert torch.equal(cache[0, 2, 0], torch.cat([c[2], pe[2]]))
    assert int((~cache.isnan().all(-1)).sum()) == 2


@pytest.mark.parametrize("bad, match", [
    (lambda a: {**a, "q": a["q"][0]}, "q must be"),
    (lambda a: {**a, "req_indices": a["req_indices"][:1]}, "req_indices must be"),
    (lambda a: {**a, "kv_lens": a["kv_lens"].float()}, "kv_lens must be"),
    (lambda a: {**a, "q": a["q"][..., :8]}, "head_dim"),
    (lambda a: {**a, "k_cache": a["k_cache"].double()}, "dtype"),
    (lambda a: {**a, "block_table": a["block_table"][0]}, "block_table"),
])
def test_bad_arguments_are_named(bad, match):
    a = dict(q=torch.randn(2, 4, 16), k_cache=torch.randn(3, 4, 2, 16), v_cache=torch.randn(3, 4, 2, 16),
             block_table=torch.tensor([[0, 1]]), req_indices=torch.tensor([0, 0]), kv_lens=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=match):
        paged_attention_with_lse(**bad(a))
    with pytest.raises(ValueError, match="widen the block table"):
        paged_attention_with_lse(**{**a, "kv_lens": torch.tensor([3, 9])})
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(a["k_cache"], a["v_cache"], torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([0.0, 1.0]))


def _op_args():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = paged_cache(gen, [20, 3], 8, 2, 16, 16, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # opcheck compares outputs
    q = torch.randn(3, 4, 16, generator=gen)
    return q, k_cache, v_cache, table, torch.tensor([0, 0, 1]), torch.tensor([19, 20, 3], dtype=torch.int32)


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_opcheck():
    q, kc, vc, table, req, lens = _op_args()
    torch.library.opcheck(torch.ops.cpattn.paged_attention_with_lse, (q, kc, vc, table, req, lens, 0.25))
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    torch.library.opcheck(torch.ops.cpattn.write_kv, (kc.clone(), vc.clone(), k, v, torch.tensor([3, -1, 40])))
    torch.library.opcheck(torch.ops.cpattn.write_kv_mla,
                          (torch.zeros(4, 8, 1, 24), torch.randn(3, 16), torch.randn(3, 8), torch.tensor([3, -1, 9])))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opaque", [False, True])
def test_write_then_attend_compiles_fullgraph(backend, opaque, monkeypatch):
    """Both ways a compiled CPU step can meet the ops: traced decompositions, or (as CUDA / NPU graphs
    and torchair see them) opaque ops with fake impls and in-place functionalization."""
    if opaque:
        monkeypatch.setattr(paged.registry, "_DECOMPOSITIONS", {})
    torch._dynamo.reset()
    q, kc, vc, table, req, lens = _op_args()
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    slots = torch.tensor([int(table[1, 0]) * 8 + 3, -1])  # request 1, local index 3

    def step(q, kc, vc, k, v, slots, table, req, lens):
        write_kv(kc, vc, k, v, slots)
        return paged_attention_with_lse(q, kc, vc, table, req, lens + (req == 1).int(), softmax_scale=0.25)

    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = step(q, kc1, vc1, k, v, slots, table, req, lens)
    got = torch.compile(step, backend=backend, fullgraph=True)(q, kc2, vc2, k, v, slots, table, req, lens)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)  # the write happened inside the graph
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    ops = _graph_ops(step, q, kc.clone(), vc.clone(), k, v, slots, table, req, lens)
    assert ops == (["cpattn.write_kv.default", "cpattn.paged_attention_with_lse.default"] if opaque else [])


def test_minus_one_block_inside_visible_keys_is_named():
    kc, vc = torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2, 16)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="-1 block inside"):
        paged_attention_with_lse(q, kc, vc, torch.tensor([[2, -1]]), torch.tensor([0]), torch.tensor([6]))
    # a -1 block past the visible keys is fine (unused table tail)
    out, _ = paged_attention_with_lse(q, kc, vc, torch.tensor([[2, -1]]), torch.tensor([0]), torch.tensor([4]))
    assert torch.isfinite(out).all()
