"""Exact PCP for the linear layers (cpattn.linear) on the simulated mesh vs the float64 sequential recurrence.

One linear layer's token mixer as the models run it -- causal conv (kernel 4) over the mixed q|k|v channels,
then the gated delta rule -- sharded over P in {1, 2, 3} ranks:

- contiguous segments at every split point of a 7-token request (so empty and one-token segments, and
  segments shorter than the conv's halo), next to a second request split elsewhere, from cached states;
  parts spread over several slabs of the chunked form;
- the head-tail layout of the attention layers (the same local tokens as :func:`cpattn.pcp_plan`);
- gates near 0 and 1; a NaN in one token's input reaching exactly the outputs it reaches on one device;
- the all-gather's bytes as counted by the group; 4K and 16K (slow) fp32 tokens without drift beyond fp32 noise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cpattn
from cpattn.linear import ScanLayout, pcp_causal_conv1d, pcp_gated_delta, scan_shard, segment_bounds
from cpattn.ops import gated_delta as gd
from cpattn.ops import gated_delta_ref as ref

pytestmark = pytest.mark.usefixtures("one_thread")

HK, HV, DK, DV, K = 1, 3, 4, 3, 4  # value heads a multiple (3) of the key heads
C = 2 * HK * DK + HV * DV  # conv channels: q | k | v


def inputs(lens, *, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)

    return dict(x=rnd(t, C), weight=rnd(C, K), g=(-2 * torch.rand(t, HV, generator=gen, dtype=torch.float64)).to(dtype),
                beta=torch.rand(t, HV, generator=gen, dtype=torch.float64).to(dtype), conv_state=rnd(b, K - 1, C),
                state=rnd(b, HV, DK, DV))


def split_qkv(y):
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, HV, DV)


def one_device(lens, a):
    """The float64 sequential oracle of the layer: conv, then the recurrence."""
    cu = [0, *itertools.accumulate(lens)]
    y, cs = ref.causal_conv1d(a["x"], a["weight"], None, cu, a["conv_state"])
    q, k, v = split_qkv(y)
    o, s = ref.gated_delta(q, k, v, a["g"], a["beta"], cu, a["state"], scale=DK**-0.5)
    return o, s, cs


def sharded(layout, lens, a, bounds=None):
    """The layer on ``layout.size`` simulated ranks; returns (o in global order, final states, conv states, stats)."""
    cu = [0, *itertools.accumulate(lens)]

    def rank(group):
        idx, parts = scan_shard(cu, layout, group.rank, bounds)
        y, cs = pcp_causal_conv1d(group, layout, a["x"][idx], a["weight"], None, parts, a["conv_state"])
        q, k, v = split_qkv(y)
        o, s = pcp_gated_delta(group, layout, q, k, v, a["g"][idx], a["beta"][idx], parts, a["state"],
                               scale=DK**-0.5, chunk_size=2)
        return idx, o, s, cs, group.stats.as_dict()

    res = cpattn.simulate(layout.size, rank)
    o = torch.full((cu[-1], HV, DV), 7.0, dtype=res[0][1].dtype)
    for idx, part, *_ in res:
        o[idx] = part
    for _, _, s, cs, _ in res[1:]:  # every rank ends with the same states
        torch.testing.assert_close(s, res[0][2], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(cs, res[0][3], rtol=0, atol=0, equal_nan=True)
    return o, res[0][2], res[0][3], [r[4] for r in res]


def err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check(layout, lens, a, bounds=None):
    o, s, cs, _ = sharded(layout, lens, a, bounds)
    ro, rs, rcs = one_device(lens, a)
    what = f"P={layout.size} segments={layout.segments} bounds={bounds}"
    assert err(o, ro) < 1e-12 and err(s, rs) < 1e-12 and err(cs, rcs) < 1e-12, what


def all_bounds(n, segments):
    """Every way to cut n tokens into ``segments`` contiguous (possibly empty) segments."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), segments - 1):
        yield [0, *cuts, n]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_contiguous_every_split_point(size):
    lens = [7, 4]
    a = inputs(lens)
    layout = ScanLayout.contiguous(size)
    for cut in all_bounds(7, size):
        other = segment_bounds(4, size)[::-1]  # the second request split the other way round (reversed sizes)
        other = [4 - x for x in other]
        check(layout, lens, a, [cut, other])


@pytest.mark.parametrize("size", [2, 3])
def test_head_tail_layout_is_the_attention_layout(size):
    lens = [13, 0, 5, 2]
    cu = [0, *itertools.accumulate(lens)]
    layout = ScanLayout.head_tail(size)
    plan = cpattn.pcp_plan(cu, size)
    for r in range(size):
        idx, parts = scan_shard(cu, layout, r)
        assert torch.equal(idx, plan.token_index[r])
        assert torch.equal(parts[0], plan.cu_a[r].to(torch.int32))
        assert torch.equal(parts[1], plan.cu_b[r].to(torch.int32))
    check(layout, lens, inputs(lens, seed=1))


def test_parts_over_several_slabs(monkeypatch):
    """Slabs of one chunk (chunk_size 2 here): a part's summary and outputs cross slab boundaries."""
    from cpattn.ops import gated_delta_chunks

    monkeypatch.setattr(gated_delta_chunks, "SLAB", HV * 2)
    lens = [11, 6]
    a = inputs(lens, seed=9)
    for cut in ([0, 2, 7, 11], [0, 5, 5, 11], [0, 0, 1, 11]):
        check(ScanLayout.contiguous(3), lens, a, [cut, segment_bounds(6, 3)])
    check(ScanLayout.head_tail(2), lens, a)


def test_a_request_shorter_than_the_world_and_all_empty():
    layout = ScanLayout.contiguous(3)
    check(layout, [1, 2], inputs([1, 2], seed=2))
    check(layout, [0, 0], inputs([0, 0], seed=3))


@pytest.mark.parametrize("case", ["decay~1,write~0", "decay~0,write~1"])
def test_gates_near_0_and_1(case):
    lens = [9]
    a = inputs(lens, seed=4)
    if case == "decay~1,write~0":
        a["g"], a["beta"] = a["g"] * 1e-9, a["beta"] * 1e-9
    else:
        a["g"], a["beta"] = a["g"] - 60.0, 1 - a["beta"] * 1e-12
    for cut in ([0, 1, 5, 9], [0, 4, 4, 9]):
        check(ScanLayout.contiguous(3), lens, a, [cut])


@pytest.mark.parametrize("size,bounds", [(2, [0, 5, 9]), (3, [0, 3, 4, 9]), (3, [0, 5, 5, 9])])
@pytest.mark.parametrize("where", ["x", "g", "beta"])
def test_nan_in_one_token_reaches_what_it_reaches_on_one_device(size, bounds, where):
    lens = [9, 4]
    a = inputs(lens, seed=5)
    a[where] = a[where].clone()
    a[where][3, 1] = float("nan")  # token 3 of request 0 (channel 1 of the conv input: a q channel)
    if where == "x":
        a["x"][4, 2 * HK * DK + 1] = float("nan")  # token 4: one v channel, at a split for (3, [0, 3, 4, 9])
    o, s, cs, _ = sharded(ScanLayout.contiguous(size), lens, a, [bounds, segment_bounds(4, size)])
    ro, rs, rcs = one_device(lens, a)
    for ours, theirs in ((o, ro), (s, rs), (cs, rcs)):
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
        fin = ~torch.isnan(theirs)
        assert err(ours[fin], theirs[fin]) < 1e-12
    assert torch.isnan(ro[:9]).any() and not torch.isnan(ro[:3]).any() and not torch.isnan(ro[9:]).any()


def test_bytes_of_the_exchange_are_counted():
    lens = [6, 3]
    _, _, _, stats = sharded(ScanLayout.head_tail(3), lens, inputs(lens, seed=6))
    summary = 2 * 2 * HV * DK * (DK + DV) * 8  # parts * requests * Hv * Dk * (Dk + Dv) * float64
    tail = 2 * 2 * (K - 1) * (C + 1) * 8  # parts * requests * (K-1) rows * (C + flag) * float64
    for st in stats:
        assert st["calls"] == {"all_gather": 2}
        assert st["bytes_sent"]["all_gather"] == 2 * (summary + tail)  # to the P-1 = 2 others


@pytest.mark.parametrize("n", [4096, pytest.param(16384, marks=pytest.mark.slow)])
def test_long_fp32_sequence_does_not_drift(n):
    """n tokens (slow decays: a long memory) in fp32 over 3 head-tail ranks vs the float64 chunked op (itself
    checked to 1e-12 against the recurrence): no worse than one fp32 device (16K: both 1.9e-7 on outputs <= 0.7)."""
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    v = torch.randn(n, 2, 16, generator=gen)
    g, beta = -torch.rand(n, 2, generator=gen) * 0.05, torch.rand(n, 2, generator=gen)
    s0 = torch.zeros(1, 2, 16, 16)
    ro, rs = gd.gated_delta_chunk(q.double(), k.double(), v.double(), g.double(), beta.double(), torch.tensor([0, n]),
                                  s0.double(), scale=0.25)
    one, _ = gd.gated_delta_chunk(q, k, v, g, beta, torch.tensor([0, n]), s0, scale=0.25)
    layout = ScanLayout.head_tail(3)

    def rank(group):
        idx, parts = scan_shard([0, n], layout, group.rank)
        o, s = pcp_gated_delta(group, layout, q[idx], k[idx], v[idx], g[idx], beta[idx], parts, s0, scale=0.25)
        return idx, o, s

    out = torch.empty(n, 2, 16)
    for idx, o, s in cpattn.simulate(3, rank):
        out[idx] = o
    e_pcp, e_one = err(out, ro), err(one, ro)
    assert e_pcp <= max(4 * e_one, 1e-6 * float(ro.abs().max())), (e_pcp, e_one)
    assert err(s, rs) < 1e-5 * float(rs.abs().max())


def test_errors():
    lay = ScanLayout.contiguous(2)
    with pytest.raises(RuntimeError, match=r"ValueError: layout has 2 ranks but the group has 1"):
        cpattn.simulate(1, lambda grp: pcp_causal_conv1d(grp, lay, torch.zeros(0, 2), torch.ones(2, 4), None,
                                                         [torch.tensor([0])], torch.zeros(0, 3, 2)))
    with pytest.raises(ValueError, match=r"must name each of 0..2 exactly once"):
        ScanLayout(((0,), (0,), (2,)))
    with pytest.raises(ValueError, match=r"bounds\[0\] = \[0, 5, 4\] must be 3 non-decreasing offsets from 0 to 4"):
        scan_shard([0, 4], lay, 0, [[0, 5, 4]])
