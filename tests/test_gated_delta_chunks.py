"""The chunked form's pieces (cpattn.ops.gated_delta_chunks) against the float64 recurrence, across slab boundaries.

- ``transition`` (the product of the chunks' transitions, a tree of batched products) against the product of
  the per-token maps ``A_t = exp(g_t) (I - beta_t k_t k_t^T)`` written out here; ``final_state`` from zero
  against the recurrence's final state -- a segment's PCP summary;
- the op with slabs of 1, 2 and 3 chunks (so slab boundaries inside a request, a short last slab, odd chunk
  counts for the tree), and a NaN in one token of a later slab: only that slab takes the masked product, the
  NaN reaches what the recurrence reaches.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.ops import gated_delta as gd
from cpattn.ops import gated_delta_chunks as chunks
from cpattn.ops import gated_delta_ref as ref

pytestmark = pytest.mark.usefixtures("one_thread")

H, DK, DV, C = 3, 5, 4, 4


def heads_first(n, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(H, n, DK, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(H, n, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(H, n, generator=gen, dtype=torch.float64)
    beta = torch.rand(H, n, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("slab_chunks", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 5, 23])
def test_transition_and_zero_start_state_are_the_segment_summary(monkeypatch, slab_chunks, n):
    monkeypatch.setattr(chunks, "SLAB", slab_chunks * H * C)
    q, k, v, g, beta = heads_first(n, seed=n)
    sl = chunks.slabs(q, k, v, g, beta, C)
    assert len(sl) == -(-n // (slab_chunks * C))
    want = torch.eye(DK, dtype=torch.float64).repeat(H, 1, 1)
    for t in range(n):  # M = A_n ... A_1, the recurrence's map of the start state
        kt = k[:, t, :, None]
        a = torch.exp(g[:, t, None, None]) * (torch.eye(DK, dtype=torch.float64) - beta[:, t, None, None] * kt
                                               * kt.transpose(-1, -2))
        want = a @ want
    assert float((chunks.transition(sl) - want).abs().max()) < 1e-12
    # U: the recurrence from zero (ref takes [T, H, D] tokens; no L2 norm, scale 1: the prepared q, k)
    tok = [x.transpose(0, 1) for x in (q, k, v, g, beta)]
    _, rs = ref.gated_delta(*tok, [0, n], torch.zeros(1, H, DK, DV, dtype=torch.float64), scale=1.0,
                            use_qk_l2norm=False)
    assert float((chunks.final_state(sl, torch.zeros(H, DK, DV, dtype=torch.float64)) - rs[0]).abs().max()) < 1e-12


@pytest.mark.parametrize("slab_chunks", [1, 2, 3])
def test_op_across_slabs_with_a_nan_in_a_later_slab(monkeypatch, slab_chunks):
    monkeypatch.setattr(chunks, "SLAB", slab_chunks * 6 * C)  # the op's 6 value heads
    gen = torch.Generator().manual_seed(3)
    lens = [30, 9]
    t = sum(lens)
    q, k = torch.randn(t, 2, DK, generator=gen, dtype=torch.float64), torch.randn(t, 2, DK, generator=gen,
                                                                                    dtype=torch.float64)
    v = torch.randn(t, 6, DV, generator=gen, dtype=torch.float64)
    g, beta = -torch.rand(t, 6, generator=gen, dtype=torch.float64), torch.rand(t, 6, generator=gen,
                                                                                dtype=torch.float64)
    cu, s0 = torch.tensor([0, 30, 39]), torch.randn(2, 6, DK, DV, generator=gen, dtype=torch.float64)
    o, s = gd.gated_delta_chunk(q, k, v, g, beta, cu, s0, scale=0.4, chunk_size=C)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=0.4)
    assert float((o - ro).abs().max()) < 1e-12 and float((s - rs).abs().max()) < 1e-12
    v = v.clone()
    v[21, 1, 2] = float("nan")  # request 0, chunk 5 (token 1 of it): a later slab for every slab size here
    o, s = gd.gated_delta_chunk(q, k, v, g, beta, cu, s0, scale=0.4, chunk_size=C)
    ro, rs = ref.gated_delta(q, k, v, g, beta, cu, s0, scale=0.4)
    assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.equal(torch.isnan(s), torch.isnan(rs))
    assert torch.isnan(ro[21:30, 1, 2]).all() and not torch.isnan(ro[:21]).any() and not torch.isnan(ro[30:]).any()
    fin = torch.isfinite(ro)
    assert float((o[fin] - ro[fin]).abs().max()) < 1e-12


def test_transition_needs_a_slab():
    with pytest.raises(ValueError, match="at least one slab"):
        chunks.transition([])
