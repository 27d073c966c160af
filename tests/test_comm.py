"""Group collectives on the simulated mesh and on real gloo processes: same results, same byte counts."""

import functools

import pytest
import torch

import cpattn
from cpattn.comm import CollectiveMismatch, CommTimeout
from cpattn.comm.launch import SpawnError, spawn

from gloo_cases import collectives, collectives_and_algorithms, hang_rank1, inputs


def expected(n):
    out = []
    for r in range(n):
        x = lambda j: torch.arange(3.0) + 10 * j  # noqa: E731
        gathered = torch.cat([x(j) for j in range(n)])
        rs = sum(torch.arange(2.0 * n) * (j + 1) for j in range(n))[2 * r : 2 * r + 2]
        a2a = torch.tensor([float(r) + 100 * j for j in range(n)])
        out.append(dict(all_gather=gathered, all_gather_dim1=gathered[None], reduce_scatter=rs,
                        all_to_all=a2a, all_reduce=sum(x(j) for j in range(n)), ring=x((r - 1) % n)))
    return out


def check(results, n):
    for r, (got, want) in enumerate(zip(results, expected(n))):
        for key, val in want.items():
            assert torch.equal(got[key], val), (r, key, got[key], val)
        st = got["stats"]
        assert st["bytes_sent"]["all_gather"] == 12 * (n - 1) * 2  # two all_gathers of 12 bytes
        assert st["bytes_sent"]["ring"] == (12 if n > 1 else 12)
        assert st["calls"]["all_to_all"] == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_simulated_collectives(n):
    check(cpattn.simulate(n, collectives), n)


@functools.cache
def gloo_run(n):
    """One gloo spawn of n ranks, shared by both tests below (each rank runs the collectives, then the
    algorithms): a spawn's start (n processes importing torch) costs more than everything they check."""
    return spawn(n, collectives_and_algorithms)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])  # 3: the spawn the algorithms test needs anyway
def test_gloo_collectives_match(n):
    check([r["collectives"] for r in gloo_run(n)], n)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])  # (its oracle's chunks assume n <= 3: the "odd" input is 3 wide)
def test_gloo_algorithms_match_a_float64_oracle(n):
    """native and a2a collectives against sums computed here in float64; a2a gives every rank the same bits."""
    results = [r["algorithms"] for r in gloo_run(n)]
    xs = [inputs(r, n) for r in range(n)]
    for r, res in enumerate(results):
        assert res["auto"] == "a2a"  # gloo picks the all_to_all algorithms
        for algo in ("native", "a2a"):
            for name in xs[0]:
                parts = [x[name].double() for x in xs]
                total = sum(parts)
                want = {
                    "all_gather": torch.cat(parts, dim=1),
                    "reduce_scatter": total.chunk(n, dim=1)[r],
                    "all_reduce": total,
                    "all_to_all": torch.cat([p.chunk(n, dim=1)[r] for p in parts], dim=1),
                }
                tol = 1e-2 if name == "bf16" else 1e-5
                for kind, got in res[(algo, name)].items():
                    if got is None:
                        continue
                    assert got.dtype == xs[0][name].dtype and got.shape == want[kind].shape, (algo, name, kind)
                    torch.testing.assert_close(got.double(), want[kind], rtol=tol, atol=tol)
        # the byte counters are logical: the same for both algorithms
        assert res[("native", "stats")] == res[("a2a", "stats")]
    for name in xs[0]:
        assert all(torch.equal(res[("a2a", name)]["all_reduce"], results[0][("a2a", name)]["all_reduce"])
                   for res in results)


def test_dist_group_rejects_unknown_algorithms():
    from cpattn.comm.dist import DistGroup

    with pytest.raises(ValueError, match="algorithm must be one of"):
        DistGroup(algorithm="ring")


def test_inputs_are_not_modified_and_outputs_are_new():
    def f(g):
        x = torch.ones(4)
        y = g.all_reduce(x)
        y.add_(1)
        return x
    assert all(torch.equal(x, torch.ones(4)) for x in cpattn.simulate(3, f))


def test_mismatched_collectives_fail_clearly():
    def f(g):
        return g.all_gather(torch.ones(2)) if g.rank == 0 else g.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="same collectives"):
        cpattn.simulate(2, f)


def test_mismatched_shapes_fail_clearly():
    def f(g):
        return g.all_gather(torch.ones(2 + g.rank))
    with pytest.raises(RuntimeError, match="equal shapes"):
        cpattn.simulate(2, f)


def test_missing_peer_times_out():
    def f(g):
        if g.rank == 0:
            g.all_reduce(torch.ones(1))
    with pytest.raises(RuntimeError, match="waited"):
        cpattn.simulate(2, f, timeout_s=0.5)


def test_error_on_one_rank_is_reraised_not_hung():
    def f(g):
        if g.rank == 1:
            raise ValueError("boom")
        return g.all_reduce(torch.ones(1))
    with pytest.raises(RuntimeError, match="rank 1 .*boom"):
        cpattn.simulate(3, f, timeout_s=30)


@pytest.mark.slow
def test_gloo_dead_peer_is_an_error_not_a_hang():
    with pytest.raises(SpawnError, match=r"rank [01] .*Timed out"):  # rank 0 in its all-reduce, or rank 1 in the
        spawn(2, hang_rank1, timeout_s=5)  # launcher's closing barrier: whichever times out first is named


def test_reduce_scatter_needs_divisible_dim():
    with pytest.raises(RuntimeError, match="divisible"):
        cpattn.simulate(2, lambda g: g.reduce_scatter(torch.ones(3)))


def test_exceptions_types_exported():
    assert issubclass(CommTimeout, TimeoutError) and issubclass(CollectiveMismatch, RuntimeError)
