"""merge_attn_states / merge_into: exact against a float64 logsumexp, overflow-safe, empty partials, NaN."""

import pytest
import torch

from cpattn.ops import attention_with_lse, merge_attn_states

from ref import attention as oracle


def test_merging_key_splits_equals_full_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 4, 16, generator=g), torch.randn(30, 2, 16, generator=g), torch.randn(30, 2, 16, generator=g)
    cuts = [0, 7, 8, 21, 30]  # uneven key sets, one of a single key
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        o, l = attention_with_lse(q, k[a:b], v[a:b], torch.tensor([0, 6]), torch.tensor([0, b - a]), causal=False)
        outs.append(o)
        lses.append(l)
    out, lse = merge_attn_states(outs, lses)
    zeros6, zeros30 = torch.zeros(6, dtype=torch.long), torch.zeros(30, dtype=torch.long)
    ref_out, ref_lse = oracle(q, k, v, zeros6, zeros30, causal=False)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("gap", [0.0, 30.0, 300.0, 3000.0])
def test_large_lse_gaps_are_exact(gap):
    o = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    l = torch.randn(2, 5, 3, dtype=torch.float64)
    l[1] += gap
    out, lse = merge_attn_states(o.float(), l.float())
    want_lse = torch.logsumexp(l, 0)
    w = torch.exp(l - want_lse)  # float64 weights
    want_out = (w[..., None] * o).sum(0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)


def test_all_empty_gives_zero_and_minus_inf():
    o = torch.full((3, 2, 2, 4), float("nan"))  # empty partials may hold garbage
    l = torch.full((3, 2, 2), float("-inf"))
    out, lse = merge_attn_states(o, l)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_only_minus_inf_is_empty_and_nan_propagates():
    """-inf marks an empty partial (its garbage output ignored); a NaN or +inf LSE is data: that row is NaN."""
    o = torch.randn(3, 4, 2, 8)
    l = torch.randn(3, 4, 2)
    o_bad, l_bad = o.clone(), l.clone()
    l_bad[0, 3] = float("-inf")  # empty partial with garbage output
    o_bad[0, 3] = float("nan")
    l_bad[1, 0] = float("nan")  # NaN from the data
    l_bad[2, 1, 0] = float("inf")
    out, lse = merge_attn_states(o_bad, l_bad)
    nan_rows = torch.zeros(4, 2, dtype=torch.bool)
    nan_rows[0] = True
    nan_rows[1, 0] = True
    assert torch.equal(out.isnan().any(-1), nan_rows) and torch.equal(lse.isnan(), nan_rows)
    keep = torch.ones(3, 4, 2, dtype=torch.bool)
    keep[0, 3] = False
    l_ref = torch.where(keep, l, float("-inf")).double()
    want_lse = torch.logsumexp(l_ref, 0)
    want_out = (torch.exp(l_ref - want_lse)[..., None] * torch.where(keep[..., None], o, 0).double()).sum(0)
    torch.testing.assert_close(lse.double()[~nan_rows], want_lse[~nan_rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double()[~nan_rows], want_out[~nan_rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("merge", ["n_way", "into"])
def test_underflowed_weight_does_not_hide_nan(merge):
    """A partial whose weight underflows to 0 still carries its NaN (0 * NaN = NaN, as on one device)."""
    from cpattn.ops.merge import merge_into

    o = torch.randn(2, 3, 1, 4)
    l = torch.tensor([[0.0, 0.0, 0.0], [-500.0, -500.0, float("-inf")]])[..., None]  # exp(-500) == 0 in fp32
    o[1, 0, 0, 2] = float("nan")  # finite lse, NaN output
    o[1, 2] = float("nan")  # empty partial: ignored
    if merge == "n_way":
        out, lse = merge_attn_states(o, l)
    else:
        out, lse = o[0].clone(), l[0].clone()
        merge_into(out, lse, o[1], l[1])
    assert out[0, 0, 2].isnan() and out[0, 0].isnan().sum() == 1 and not lse.isnan().any()
    torch.testing.assert_close(out[1:], o[0, 1:])  # the other rows are exact
    assert torch.isfinite(out[1:]).all()


def test_all_empty_with_garbage_merge_into():
    from cpattn.ops.merge import merge_into

    acc, acc_lse = torch.zeros(2, 1, 4), torch.full((2, 1), float("-inf"))
    merge_into(acc, acc_lse, torch.full((2, 1, 4), float("nan")), torch.full((2, 1), float("-inf")))
    assert (acc == 0).all() and (acc_lse == float("-inf")).all()


def test_bf16_partials_keep_dtype_and_merge_in_fp32():
    o = torch.randn(4, 3, 2, 8).bfloat16()
    l = torch.randn(4, 3, 2)
    out, lse = merge_attn_states(o, l)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = (torch.softmax(l.double(), 0)[..., None] * o.double()).sum(0)
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_bad_shapes():
    with pytest.raises(ValueError, match="outs"):
        merge_attn_states(torch.randn(2, 3, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="N >= 1"):
        merge_attn_states(torch.randn(0, 3, 4, 2), torch.randn(0, 3, 4))


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_opcheck_and_compile(backend):
    from cpattn.ops.merge import merge_into

    o, l = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2)
    torch.library.opcheck(torch.ops.cpattn.merge_attn_states, (o, l))

    def f(o, l):
        out, lse = merge_attn_states(o[:2], l[:2])
        acc, acc_lse = out.clone(), lse.clone()
        merge_into(acc, acc_lse, o[2], l[2])
        return acc, acc_lse

    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(o, l)
    torch.testing.assert_close(got, merge_attn_states(o, l))


@pytest.mark.parametrize("gap", [0.0, 500.0])
def test_merge_into_equals_float64_logsumexp(gap):
    from cpattn.ops.merge import merge_into

    o = torch.randn(3, 6, 2, 8, dtype=torch.float64)
    l = torch.randn(3, 6, 2, dtype=torch.float64)
    l[2] -= gap
    l[:, 0] = float("-inf")  # a row empty in every partial
    o[:, 0] = float("nan")  # ... whose outputs are garbage
    l[1, 1] = float("nan")  # NaN is data: row 1 becomes NaN
    acc, acc_lse = torch.zeros(6, 2, 8), torch.full((6, 2), float("-inf"))
    for i in range(3):
        merge_into(acc, acc_lse, o[i].float(), l[i].float())
    want_lse = torch.logsumexp(l, 0)
    want = (torch.exp(l - want_lse)[..., None] * o).sum(0)
    assert (acc[0] == 0).all() and (acc_lse[0] == float("-inf")).all()
    assert acc[1].isnan().all() and acc_lse[1].isnan().all()
    assert torch.isfinite(acc[2:]).all() and torch.isfinite(acc_lse[2:]).all()
    torch.testing.assert_close(acc_lse[2:].double(), want_lse[2:], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(acc[2:].double(), want[2:], atol=1e-5, rtol=1e-5)


def test_merge_into_traced_body_equals_cpu_kernel():
    """The sync-free body torch.compile traces (and other devices run) and the eager CPU kernel, which skips
    zeroing empty partials when it sees none: the same bits, with and without empty rows holding garbage."""
    from cpattn.ops import merge, registry

    body = registry._DECOMPOSITIONS["merge_into"][0]
    for empty in (False, True):
        o, l = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3)
        if empty:
            l[1, 2], o[1, 2] = float("-inf"), float("nan")
        a1, l1, a2, l2 = o[0].clone(), l[0].clone(), o[0].clone(), l[0].clone()
        body(a1, l1, o[1], l[1])
        merge._merge_into_cpu(a2, l2, o[1], l[1])
        assert torch.equal(a1, a2) and torch.equal(l1, l2) and not a1.isnan().any()


def test_merge_into_checks_and_opcheck():
    from cpattn.ops.merge import merge_into

    with pytest.raises(ValueError, match="float32 or float64"):
        merge_into(torch.zeros(2, 1, 3).bfloat16(), torch.zeros(2, 1).bfloat16(), torch.zeros(2, 1, 3), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="equal shapes"):
        merge_into(torch.zeros(2, 1, 3), torch.zeros(2, 1), torch.zeros(3, 1, 3), torch.zeros(3, 1))
    args = (torch.randn(4, 2, 3), torch.randn(4, 2), torch.randn(4, 2, 3), torch.randn(4, 2))
    torch.library.opcheck(torch.ops.cpattn.merge_into, args)
