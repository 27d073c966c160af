"""DeepSeek-V4 ops (gated_pool, window_attention_with_lse, write_rows) against float64 references.

Cache rows nobody may read are NaN; every case runs with a scrambled block
table, padding rows, empty ranges, GQA heads and with and without sinks.
Also: opcheck, torch.compile(fullgraph=True) with the CPU decompositions
traced and with the ops opaque.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.ops import registry
from cpattn.ops.compressor import gated_pool
from cpattn.ops.rows import write_rows
from cpattn.ops.window_attention import window_attention_with_lse
from ref.v4 import gated_pool_ref, window_attention_ref
from test_dcp_ops import _graph_ops

NAN = float("nan")


def pool_case(overlap: bool, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, d, s = 4, 6, 20
    c = 2 * d if overlap else d
    kv, gate = torch.randn(s, c, generator=g, dtype=dtype), torch.randn(s, c, generator=g, dtype=dtype) * 2
    kv[17:], gate[17:] = NAN, NAN  # rows no window reads
    rows = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [12, 9, 16, 3], [-1, -1, -1, -1]])
    prev = torch.tensor([[-1, -1, -1, -1], [0, 1, 2, 3], [8, 13, 10, 11], [-1, -1, -1, -1]]) if overlap else None
    return kv, gate, torch.randn(m, c, generator=g, dtype=dtype), rows, prev


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("overlap", [False, True])
def test_gated_pool_matches_reference(overlap, dtype):
    kv, gate, bias, rows, prev = pool_case(overlap, dtype)
    got = gated_pool(kv, gate, bias, rows, prev)
    want = gated_pool_ref(kv, gate, bias, rows, prev)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert torch.equal(got[3], torch.zeros_like(got[3]))  # a window with no slot pools to 0


def test_gated_pool_propagates_nan_in_a_read_slot():
    kv, gate, bias, rows, prev = pool_case(True)
    kv[5, 7] = NAN  # token 5's Cb channel 1: read by window 1 only
    got = gated_pool(kv, gate, bias, rows, prev)
    assert torch.isnan(got[1, 1]) and torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()


def ring_case(dtype=torch.float32, seed=0, hq=4, hkv=2, d=8):
    """Two requests' rings of 3 blocks x 4 slots (scrambled ids), NaN in every slot no row reads."""
    g = torch.Generator().manual_seed(seed)
    nb, bs = 7, 4
    table = torch.tensor([[5, 0, 3], [2, 6, 1]])
    cache = torch.randn(nb, bs, hkv, d, generator=g, dtype=dtype)
    cache[4] = NAN  # a block nobody owns
    # request 0 holds positions 11..22 (ring 12), request 1 positions 0..6
    req = torch.tensor([0, 0, 0, 1, 1, -1, 1])
    ends = torch.tensor([23, 20, 18, 7, 1, 9, 4])
    starts = ends - torch.tensor([6, 6, 6, 6, 6, 6, 0])  # window 6; the last row sees nothing
    flat = cache.view(-1, hkv, d)
    for b, live in ((0, range(11, 23)), (1, range(0, 7))):
        keep = {int(table[b, (p % 12) // bs]) * bs + p % 4 for p in live}
        for s in set(int(table[b, i]) * bs + o for i in range(3) for o in range(bs)) - keep:
            flat[s] = NAN
    flat[int(table[0, (11 % 12) // bs]) * bs + 11 % 4] = NAN  # position 11: held but outside every window
    q = torch.randn(req.numel(), hq, d, generator=g, dtype=dtype)
    return q, cache, table, req, starts, ends, torch.randn(hq, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_attention_matches_reference(with_sinks, dtype):
    q, cache, table, req, starts, ends, sinks = ring_case(dtype)
    s = sinks if with_sinks else None
    out, lse = window_attention_with_lse(q, cache, cache, table, req, starts, ends, softmax_scale=0.3, sinks=s)
    want_o, want_l = window_attention_ref(q, cache, cache, table, req, starts, ends, 0.3, s)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_l, rtol=tol, atol=tol)
    assert torch.equal(lse[5], torch.full_like(lse[5], float("-inf"))) and not out[5].any()  # padding row
    if with_sinks:  # a live row with no key: only the sink, value 0
        assert torch.equal(lse[6], sinks.to(lse.dtype)) and not out[6].any()
    assert torch.isfinite(out).all()


def test_window_attention_propagates_nan_in_a_visible_key():
    q, cache, table, req, starts, ends, sinks = ring_case()
    bad = cache.clone()
    bad.view(-1, 2, 8)[int(table[1, 0]) * 4 + 2, 0, 3] = NAN  # request 1, position 2, kv head 0
    out, lse = window_attention_with_lse(q, bad, bad, table, req, starts, ends, softmax_scale=0.3, sinks=sinks)
    assert torch.isnan(out[3, :2]).any() and torch.isfinite(out[3, 2:]).all()  # row 3 sees position 2
    assert torch.isfinite(out[[0, 1, 2, 4, 6]]).all()  # rows that do not see it


def test_window_sink_is_a_zero_valued_partial():
    """window_attention(sinks) == merge(window_attention(no sink), (0, sink))."""
    from cpattn.ops.merge import merge_attn_states

    q, cache, table, req, starts, ends, sinks = ring_case()
    o, l = window_attention_with_lse(q, cache, cache, table, req, starts, ends, softmax_scale=0.3)
    os_, ls_ = window_attention_with_lse(q, cache, cache, table, req, starts, ends, softmax_scale=0.3, sinks=sinks)
    sink_l = torch.where(req[:, None] >= 0, sinks[None, :].expand_as(l), float("-inf"))
    mo, ml = merge_attn_states(torch.stack([o, torch.zeros_like(o)]), torch.stack([l, sink_l]))
    torch.testing.assert_close(os_, mo, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ls_, ml, rtol=1e-6, atol=1e-6)


def band_case(seed=0):
    """One request's 40 consecutive rows (a prefill chunk: positions 4..43, window 6) over a ring of 48
    slots in scrambled blocks; slots no row reads are NaN."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 4, 2, 8, 4
    table = torch.randperm(14, generator=g)[:12].view(1, 12)
    cache = torch.full((14, bs, hkv, d), NAN)
    pos = torch.arange(0, 44)
    flat = cache.view(-1, hkv, d)
    flat[table[0, pos // bs] * bs + pos % bs] = torch.randn(44, hkv, d, generator=g)
    ends = torch.arange(5, 45)
    return torch.randn(40, hq, d, generator=g), cache, table, torch.zeros(40, dtype=torch.long), ends - 6, ends


@pytest.mark.parametrize("poison", [False, True])
def test_window_band_path_matches_reference(poison, monkeypatch):
    """Rows of one request spanning less than the ring take the band path (the union gathered once); a NaN
    key in the union sends the chunk to the per-row path, so only the rows that see it become NaN."""
    from cpattn.ops import window_attention as wa

    calls = []
    band = wa.band_rows
    monkeypatch.setattr(wa, "band_rows", lambda *a: calls.append(band(*a)) or calls[-1])
    q, cache, table, req, starts, ends = band_case()
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
    if poison:
        cache.view(-1, 2, 8)[int(table[0, 20 // 4]) * 4 + 20 % 4, 1, 2] = NAN  # position 20, kv head 1
    out, lse = window_attention_with_lse(q, cache, cache, table, req, starts, ends, softmax_scale=0.3, sinks=sinks)
    want_o, want_l = window_attention_ref(q, cache, cache, table, req, starts, ends, 0.3, sinks)
    assert len(calls) == 1 and (calls[0] is None) == poison  # one band chunk; poisoned: per-row instead
    sees = (starts <= 20) & (20 < ends)  # rows whose window holds position 20
    if poison:
        assert torch.isnan(out[sees][:, 2:]).any() and torch.isfinite(out[sees][:, :2]).all()  # heads of kv 1
        assert torch.isfinite(out[~sees]).all()
    torch.testing.assert_close(out.double(), want_o, rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(lse.double(), want_l, rtol=2e-6, atol=2e-6, equal_nan=True)


def test_window_range_longer_than_the_ring_is_refused():
    q, cache, table, req, starts, ends, _ = ring_case()
    with pytest.raises(ValueError, match="ring holds 12"):
        window_attention_with_lse(q, cache, cache, table, req, ends - 13, ends)


def test_write_rows_skips_minus_one():
    cache = torch.full((3, 2, 4), NAN)
    write_rows(cache, torch.arange(12.0).view(3, 4), torch.tensor([5, -1, 0]))
    flat = cache.view(-1, 4)
    assert flat[5].tolist() == [0.0, 1.0, 2.0, 3.0] and flat[0].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert torch.isnan(flat[1:5]).all()


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_opcheck():
    kv, gate, bias, rows, prev = pool_case(True)
    kv, gate = kv.nan_to_num(0.0), gate.nan_to_num(0.0)  # opcheck compares outputs
    torch.library.opcheck(torch.ops.cpattn.gated_pool, (kv, gate, bias, rows, prev))
    torch.library.opcheck(torch.ops.cpattn.gated_pool, (kv[:, :6], gate[:, :6], bias[:, :6], rows, None))
    q, cache, table, req, starts, ends, sinks = ring_case()
    cache = cache.nan_to_num(0.0)
    torch.library.opcheck(torch.ops.cpattn.window_attention_with_lse,
                          (q, cache, cache, table, req, starts, ends, 0.3, sinks))
    torch.library.opcheck(torch.ops.cpattn.write_rows, (cache.clone(), torch.randn(2, 2, 8), torch.tensor([3, -1])))


def _step(q, cache, table, req, starts, ends, sinks, new, slots, kv, gate, bias, rows, prev):
    """A decode-like program: write the new rows, attend the window, pool two windows."""
    write_rows(cache, new, slots)
    o, l = window_attention_with_lse(q, cache, cache, table, req, starts, ends, softmax_scale=0.3, sinks=sinks)
    return o, l, gated_pool(kv, gate, bias, rows, prev)


@pytest.mark.slow
@pytest.mark.parametrize("opaque", [False, True])
def test_compiles_fullgraph(opaque, monkeypatch):
    """aot_eager only: an inductor build of this program costs ~40 s on a cold cache (2 cores)."""
    backend = "aot_eager"
    if opaque:  # as CUDA / NPU graphs and torchair see the ops: calls with fake impls
        monkeypatch.setattr(registry, "_DECOMPOSITIONS", {})
    q, cache, table, req, starts, ends, sinks = ring_case()
    kv, gate, bias, rows, prev = pool_case(True)
    new = torch.randn(2, 2, 8)
    slots = torch.tensor([int(table[1, 1]) * 4 + 3, -1])  # request 1, position 7 (a row no window reads)
    args = (q, cache, table, req, starts, ends, sinks, new, slots, kv, gate, bias, rows, prev)
    want = _step(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    torch._dynamo.reset()
    c2 = cache.clone()
    got = torch.compile(_step, backend=backend, fullgraph=True, dynamic=False)(q, c2, *args[2:])
    assert torch.equal(c2.view(-1, 2, 8)[slots[0]], new[0])  # the write happened inside the graph
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    ops = _graph_ops(_step, q, cache.clone(), *args[2:])
    assert ops == ([] if not opaque else ["cpattn.write_rows.default", "cpattn.window_attention_with_lse.default",
                                          "cpattn.gated_pool.default"])
