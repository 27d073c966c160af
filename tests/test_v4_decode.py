"""The planned V4 decode step (:mod:`cpattn.v4.decode`) against the float64 oracle, on one device and DCP ranks.

Two requests are prefilled with :class:`~cpattn.v4.step.V4Step` (scratch
rings), then decoded with the static step: 1 + k = 4 tokens per request per
step, the plan built on the host. Every layer kind, one device and DCP N =
2 (I 1) / 3 (I 2) on the simulated mesh, float64: the outputs equal the
oracle. Padding rows (the runner's pad values) write nothing -- every cache
tensor is bit-identical to a run without them -- and return zeros.
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.comm.sim import SimMesh
from cpattn.graphs import Field
from cpattn.v4.cache import V4Cache
from cpattn.v4.decode import V4DecodeStep, cache_state, decode_plan, plan_fields
from test_v4_attention import layout, make_layer, oracle, packed_input, run_steps

pytestmark = pytest.mark.usefixtures("one_thread")
PREFILL = [[20, 5], [9, 30]]
DECODE = 3  # steps of 4 tokens per request after the prefill


def pad_plan(plan: dict, fields: dict[str, Field], extra: int) -> dict:
    """The plan with ``extra`` padding rows, as a captured batch holds them."""
    out = {}
    for name, f in fields.items():
        pad = torch.full((extra, *f.shape), f.pad, dtype=f.dtype)
        out[name] = torch.cat([plan[name], pad])
    return out


def decode_rank(group, kind, xs, interleave_size, padding=0):
    lay = layout(kind)
    cache = V4Cache.empty(lay, batch=2, max_len=64, dtype=torch.float64, dcp_rank=group.rank, dcp_size=group.size,
                          interleave_size=interleave_size, seed=3 + group.rank)
    outs, cache = run_steps(cache, xs, PREFILL, kind, group if group.size > 1 else None)
    state, fields = cache_state(cache), plan_fields(lay, dcp_size=group.size)
    done = list(cache.seq_lens)
    for _ in range(DECODE):
        plan = decode_plan(cache, [0, 1], done, 4)
        inp = packed_input(xs, [(a, a + 4) for a in done], kind)
        if padding:
            plan = pad_plan(plan, fields, padding)
            inp = packed_input(xs + xs[:1], [(a, a + 4) for a in done] + [(0, padding)], kind)
        out = V4DecodeStep(lay, state, plan, group, interleave_size=interleave_size).attend(0, inp)
        for b in range(2):
            outs[b] = torch.cat([outs[b], out[4 * b : 4 * b + 4]])
        if padding:
            assert torch.equal(out[8:], torch.zeros_like(out[8:])), "padding rows see nothing"
        done = [a + 4 for a in done]
    return outs, state


@pytest.mark.parametrize("n,interleave_size", [(1, 1), (2, 1), (3, 2)])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_planned_decode_matches_oracle(kind, n, interleave_size):
    lengths = [a + b + 4 * DECODE for a, b in zip(*PREFILL)]
    xs = [make_layer(kind, L, seed=b) for b, L in enumerate(lengths)]
    for r, (outs, _) in enumerate(cpattn.simulate(n, decode_rank, kind, xs, interleave_size)):
        for b in range(2):
            torch.testing.assert_close(outs[b], oracle(kind, xs[b], lengths[b]), rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"rank {r}, request {b}: {m}")


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_padding_rows_write_nothing(kind):
    """Padding rows (request -1, slots -1, no visible entry) beside real ones: every cache tensor ends
    bit-identical to the run without padding, and the padding rows' outputs are 0."""
    lengths = [a + b + 4 * DECODE for a, b in zip(*PREFILL)]
    xs = [make_layer(kind, L, seed=b) for b, L in enumerate(lengths)]
    g = SimMesh(1).groups()[0]
    plain, s0 = decode_rank(g, kind, xs, 1)
    padded, s1 = decode_rank(g, kind, xs, 1, padding=5)
    for b in range(2):
        assert torch.equal(plain[b], padded[b])
    for name in ("window", "raw", "index_raw", "entries", "index_keys"):
        for a, c in zip(s0[name], s1[name]):
            if a is not None:
                assert torch.equal(a.nan_to_num(7.0), c.nan_to_num(7.0)), name


def test_plan_refuses_steps_longer_than_the_rewind():
    cache = V4Cache.empty(layout("csa", max_rewind=2), batch=1, max_len=64)
    with pytest.raises(ValueError, match="max_rewind"):
        decode_plan(cache, [0], [8], 4)
