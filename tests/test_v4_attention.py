"""One V4 attention layer on one device (:class:`cpattn.v4.step.V4Step`) against the float64 oracle.

The oracle (:func:`ref.v4.v4_attention_ref` (tests/ref/v4.py)) sees each request's
whole sequence at once: entries pooled window by window, every query's
keys listed explicitly (window, visible entries or the indexer's top-k),
the sink as one more logit. The step sees the same tokens in chunks --
prefill chunks bigger than the rings (scratch path) and 1 + k token decode
steps (in place) -- with two requests packed, NaN-poisoned caches and
shuffled blocks. Also: rewinds restore the live state bit for bit.

The helpers here (``make_layer``, ``oracle``, ``run_steps``) also serve the
PCP and DCP tests.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.ops.compressor import gated_pool
from cpattn.v4.attention import Compression, LayerInput
from cpattn.v4.cache import V4Cache, V4Layout
from cpattn.v4.step import V4Step
from ref.v4 import gated_pool_ref, indexer_topk_ref, v4_attention_ref

H, D, HI, DI = 4, 16, 16, 8
WINDOW, CSA, HCA, TOPK = 8, 4, 16, 3


def layout(kind: str, max_rewind: int = 3, block_size: int = 4) -> V4Layout:
    return V4Layout(kinds=(kind,), head_dim=D, window=WINDOW, csa_ratio=CSA, hca_ratio=HCA, index_head_dim=DI,
                    max_rewind=max_rewind, block_size=block_size)


def finish_fn(scale: float):
    """A position-dependent stand-in for the model's RMSNorm + RoPE of an entry."""
    def finish(pooled, positions):
        return pooled * (1.0 + scale * positions.to(pooled.dtype)[:, None])
    return finish


def make_layer(kind: str, length: int, seed: int = 0, dtype=torch.float64) -> dict:
    """Inputs of one request's whole sequence (``length`` tokens) for a layer of ``kind``: per-token
    tensors from ``seed``, the layer's own parameters (sinks, position biases) the same for every seed."""
    g, w = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(12345)

    def r(*shape, s=1.0, gen=g):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s).to(dtype)

    x = {"q": r(length, H, D), "kv": r(length, D), "sinks": r(H, gen=w)}
    if kind != "sliding":
        m, c = (CSA, 2 * D) if kind == "csa" else (HCA, D)
        x.update(ckv=r(length, c), cgate=r(length, c), cbias=r(m, c, s=0.5, gen=w))
    if kind == "csa":
        x.update(iq=r(length, HI, DI), iw=r(length, HI).abs(), ikv=r(length, 2 * DI), igate=r(length, 2 * DI),
                 ibias=r(CSA, 2 * DI, s=0.5, gen=w))
    return x


def layer_input(x: dict, rows: slice | torch.Tensor, kind: str) -> LayerInput:
    """The step's LayerInput for token rows ``rows`` of one request's data."""
    pick = {k: v[rows] for k, v in x.items() if k not in ("sinks", "cbias", "ibias")}
    comp = idx = None
    if kind != "sliding":
        comp = Compression(pick["ckv"], pick["cgate"], x["cbias"], finish_fn(0.01))
    if kind == "csa":
        idx = Compression(pick["ikv"], pick["igate"], x["ibias"], finish_fn(-0.02))
    return LayerInput(pick["q"], pick["kv"], x["sinks"], D**-0.5, compression=comp,
                      index_q=pick.get("iq"), index_weights=pick.get("iw"), index_compression=idx, topk=TOPK)


def packed_input(xs: list[dict], spans: list[tuple[int, int]], kind: str) -> LayerInput:
    """One step's LayerInput: rows ``spans[b]`` of request b, packed in request order."""
    parts = [layer_input(x, slice(a, b), kind) for x, (a, b) in zip(xs, spans)]

    def cat(get):
        vals = [get(p) for p in parts]
        return None if vals[0] is None else torch.cat(vals)

    def comp(get):
        cs = [get(p) for p in parts]
        if cs[0] is None:
            return None
        return Compression(torch.cat([c.kv for c in cs]), torch.cat([c.gate for c in cs]), cs[0].position_bias,
                           cs[0].finish)

    p0 = parts[0]
    return LayerInput(cat(lambda p: p.q), cat(lambda p: p.kv), p0.sinks, p0.scale, comp(lambda p: p.compression),
                      cat(lambda p: p.index_q), cat(lambda p: p.index_weights), comp(lambda p: p.index_compression),
                      TOPK)


def oracle_entries(kv, gate, bias, m, overlap, finish, length):
    """All entries of a sequence, pooled window by window in float64, finished at ``e * m``."""
    n = length // m
    j = torch.arange(m)
    rows = torch.arange(n)[:, None] * m + j
    prev = torch.where(torch.arange(n)[:, None] > 0, rows - m, -1) if overlap else None
    pooled = gated_pool_ref(kv, gate, bias, rows, prev)
    return finish(pooled, torch.arange(n) * m)


def oracle(kind: str, x: dict, length: int) -> torch.Tensor:
    """The float64 V4 attention of one request's first ``length`` tokens: [length, H, D]."""
    x = {k: v.double() for k, v in x.items()}
    q, kv = x["q"][:length], x["kv"][:length]
    if kind == "sliding":
        return v4_attention_ref(q, kv, x["sinks"], D**-0.5, WINDOW)
    m = CSA if kind == "csa" else HCA
    ent = oracle_entries(x["ckv"], x["cgate"], x["cbias"], m, kind == "csa", finish_fn(0.01), length)
    sel = None
    if kind == "csa":
        keys = oracle_entries(x["ikv"], x["igate"], x["ibias"], m, True, finish_fn(-0.02), length)
        sel = indexer_topk_ref(x["iq"], x["iw"] * (HI**-0.5 * DI**-0.5), keys, TOPK)
    return v4_attention_ref(q, kv, x["sinks"], D**-0.5, WINDOW, ent, m, sel)


def run_steps(cache: V4Cache, xs: list[dict], chunks: list[list[int]], kind: str, group=None):
    """Feed each request's tokens in steps (``chunks[s][b]`` new tokens of request b in step s);
    returns (per-request outputs concatenated over steps, final cache)."""
    outs = [[] for _ in xs]
    done = [0] * len(xs)
    for step_lens in chunks:
        step = V4Step(cache, step_lens, group)
        spans = [(a, a + n) for a, n in zip(done, step_lens)]
        out = step.attend(0, packed_input(xs, spans, kind))
        at = 0
        for b, n in enumerate(step_lens):
            outs[b].append(out[at : at + n])
            at += n
        done = [a + n for a, n in zip(done, step_lens)]
        cache = step.finish()
    return [torch.cat(o) for o in outs], cache


# prefill 20 / 5 tokens (bigger than the rings: scratch path), a chunk of 9 / 30, then 1 + k = 4 token steps
CHUNKS = [[20, 5], [9, 30], [4, 1], [4, 4], [1, 4]]
LENGTHS = [sum(c[b] for c in CHUNKS) for b in range(2)]


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_matches_oracle(kind, dtype):
    xs = [make_layer(kind, n, seed=b, dtype=dtype) for b, n in enumerate(LENGTHS)]
    cache = V4Cache.empty(layout(kind), batch=2, max_len=64, dtype=dtype, seed=1)
    outs, cache = run_steps(cache, xs, CHUNKS, kind)
    assert cache.seq_lens == tuple(LENGTHS)
    for b in range(2):
        want = oracle(kind, xs[b], LENGTHS[b])
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(outs[b].double(), want, rtol=tol, atol=tol)


def test_step_beyond_max_len_is_refused():
    cache = V4Cache.empty(layout("hca"), batch=1, max_len=16)
    with pytest.raises(ValueError, match="max_len=16"):
        V4Step(cache, [17])


def test_csa_selection_is_active():
    """Top-3 of up to 9 entries: the oracle with every entry differs, so the CSA test checks the selection."""
    x = make_layer("csa", 38)
    m = CSA
    ent = oracle_entries(x["ckv"], x["cgate"], x["cbias"], m, True, finish_fn(0.01), 38)
    dense = v4_attention_ref(x["q"], x["kv"], x["sinks"], D**-0.5, WINDOW, ent, m)
    assert (dense - oracle("csa", x, 38)).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_rewind_restores_live_state_and_outputs(kind):
    """Append k = 3 tokens, rewind 3: every readable row bit-identical (entry caches whole); the
    next steps then give bit-identical outputs to a cache that never saw the draft."""
    xs = [make_layer(kind, 44, seed=b) for b in range(2)]
    drafts = [make_layer(kind, 3, seed=10 + b) for b in range(2)]

    def bits(c):
        return {k: (v.view(torch.int64) if v.is_floating_point() else v) for k, v in c.live_state().items()}

    a = V4Cache.empty(layout(kind), batch=2, max_len=64, dtype=torch.float64, seed=2)
    _, a = run_steps(a, xs, [[30, 31]], kind)
    before = bits(a)
    step = V4Step(a, [3, 3])
    step.attend(0, packed_input(drafts, [(0, 3), (0, 3)], kind))
    a = step.finish().rewind([3, 3])
    after = bits(a)
    assert all(torch.equal(before[k], after[k]) for k in before)
    b = V4Cache.empty(layout(kind), batch=2, max_len=64, dtype=torch.float64, seed=2)
    _, b = run_steps(b, xs, [[30, 31]], kind)
    for rows in ([30, 31], [33, 34], [37, 38]):
        spans = [(r, r + 3) for r in rows]
        sa, sb = V4Step(a, [3, 3]), V4Step(b, [3, 3])
        oa, ob = sa.attend(0, packed_input(xs, spans, kind)), sb.attend(0, packed_input(xs, spans, kind))
        assert torch.equal(oa, ob)
        a, b = sa.finish(), sb.finish()


def test_gated_pool_matches_oracle_entries():
    x = make_layer("csa", 24)
    rows = torch.arange(6)[:, None] * 4 + torch.arange(4)
    prev = torch.where(torch.arange(6)[:, None] > 0, rows - 4, -1)
    torch.testing.assert_close(gated_pool(x["ckv"], x["cgate"], x["cbias"], rows, prev),
                               gated_pool_ref(x["ckv"], x["cgate"], x["cbias"], rows, prev), rtol=1e-12, atol=1e-12)
