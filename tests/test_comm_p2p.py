"""Point to point (``Group.send`` / ``Group.recv``) and sub-groups (``Group.split``) on the simulated mesh and gloo."""

from __future__ import annotations

import pytest
import torch

from cpattn.comm.launch import spawn
from cpattn.comm.sim import simulate


def _p2p_program(g):
    """Rank 0 sends two messages to every other rank; each sends its rank back; then a sub-group of the
    odd ranks all-reduces and pairs inside it exchange. Returns what this rank saw."""
    out = {}
    if g.rank == 0:
        for d in range(1, g.size):
            g.send(torch.full((2, 3), float(d)), d)
            g.send(torch.arange(d, dtype=torch.int64), d)
        out["back"] = [g.recv((1,), torch.float64, s).item() for s in range(1, g.size)]
    else:
        out["first"] = g.recv((2, 3), torch.float32, 0)
        out["second"] = g.recv((g.rank,), torch.int64, 0).tolist()
        g.send(torch.tensor([10.0 * g.rank], dtype=torch.float64), 0)
    odd = g.split([r for r in range(g.size) if r % 2])
    out["odd"] = None if odd is None else (odd.rank, odd.size, odd.all_reduce(torch.tensor([float(g.rank)])).item())
    if odd is not None and odd.size > 1:
        peer = 1 - odd.rank if odd.rank < 2 else None
        if peer is not None:
            if odd.rank == 0:
                odd.send(torch.tensor([7]), peer)
            else:
                out["pair"] = odd.recv((1,), torch.int64, peer).item()
    out["stats"] = (g.stats.calls.get("p2p", 0), g.stats.bytes_sent.get("p2p", 0), g.stats.bytes_recv.get("p2p", 0))
    g.all_reduce(torch.zeros(1))  # everyone done before any sub-group is torn down
    return out


def _check(results, n):
    r0 = results[0]
    assert r0["back"] == [10.0 * d for d in range(1, n)]
    # rank 0: 2 sends to each peer (24 + 8d bytes), one 8-byte recv from each
    assert r0["stats"] == (3 * (n - 1), sum(24 + 8 * d for d in range(1, n)), 8 * (n - 1))
    odd = [r for r in range(n) if r % 2]
    for r in range(1, n):
        got = results[r]
        assert torch.equal(got["first"], torch.full((2, 3), float(r)))
        assert got["second"] == list(range(r))
        assert got["stats"][1] >= 8 and got["stats"][2] >= 24 + 8 * r
    for r in range(n):
        if r in odd:
            assert results[r]["odd"] == (odd.index(r), len(odd), float(sum(odd)))
        else:
            assert results[r]["odd"] is None
    if len(odd) > 1:
        assert results[odd[1]]["pair"] == 7


@pytest.mark.parametrize("n", [2, 4])
def test_sim_send_recv_split(n):
    _check(simulate(n, _p2p_program), n)


def test_sim_messages_keep_order_and_skip_collectives():
    """p2p messages do not mix with collectives: a receiver may run a collective before taking its message."""
    def rank(g):
        if g.rank == 0:
            g.send(torch.tensor([1]), 1)
            g.send(torch.tensor([2]), 1)
            total = g.all_reduce(torch.ones(1)).item()
            return total
        total = g.all_reduce(torch.ones(1)).item()
        return total, g.recv((1,), torch.int64, 0).item(), g.recv((1,), torch.int64, 0).item()

    assert simulate(2, rank) == [2.0, (2.0, 1, 2)]


def test_sim_recv_shape_mismatch_is_named():
    def rank(g):
        if g.rank == 0:
            g.send(torch.zeros(3), 1)
        else:
            g.recv((4,), torch.float32, 0)

    with pytest.raises(RuntimeError, match=r"recv: rank 1 expected \(4,\) torch.float32 from rank 0 but it sent \(3,\)"):
        simulate(2, rank)


def test_sim_split_lists_must_agree():
    with pytest.raises(RuntimeError, match="every rank must call split with the same ranks"):
        simulate(2, lambda g: g.split([0] if g.rank == 0 else [1]))


@pytest.mark.parametrize("bad, why", [(5, "is not another rank"), (0, "is not another rank")])
def test_send_to_a_bad_rank_is_refused(bad, why):
    def rank(g):
        if g.rank == 0:
            g.send(torch.zeros(1), bad)

    with pytest.raises(RuntimeError, match=why):
        simulate(2, rank)


@pytest.mark.parametrize("ranks", [[], [0, 0], [3], [True]])
def test_split_refuses_bad_lists(ranks):
    with pytest.raises(RuntimeError, match="split: ranks"):
        simulate(2, lambda g: g.split(ranks))


def test_sim_split_of_a_split():
    def rank(g):
        a = g.split([1, 2, 3])
        if a is None:
            return None
        b = a.split([1, 2])  # world ranks 2, 3
        return None if b is None else (b.rank, b.all_gather(torch.tensor([g.rank])).tolist())

    assert simulate(4, rank) == [None, None, (0, [2, 3]), (1, [2, 3])]


@pytest.mark.slow
def test_gloo_send_recv_split():
    _check(spawn(4, _p2p_program, timeout_s=120), 4)


def test_pd_per_rank_code_runs_on_the_simulated_mesh(one_device):
    """The composition's P/D path of generate_on_rank (what gloo ranks run for a producer of 3 ranks, which the
    step loop refuses: 8 heads % 3) on P + N simulated ranks: world.split makes the two groups, whole blocks
    move with send / recv; the tokens are one-device greedy's."""
    from spec_pd_cases import prompts, reference

    from cpattn.models.generate import pd_generate_on_rank

    _, params, cfg, ref = reference(one_device, "qwen3", 6)
    outs = simulate(5, pd_generate_on_rank, "qwen3", params, cfg, prompts(), 6, pcp_size=3, dcp_size=2,
                    block_size=4)
    assert all(torch.equal(o.tokens, ref.tokens) for o in outs)
    assert [o.facts.role for o in outs] == ["prefill"] * 3 + ["decode"] * 2
    blocks = sum(-(-len(q) // 4) for q in prompts())
    assert sum(o.facts.handoff.blocks_sent for o in outs[:3]) == sum(o.facts.handoff.blocks_received
                                                                    for o in outs[3:]) == blocks
    assert sum(o.facts.handoff.bytes_sent for o in outs[:3]) == sum(o.facts.handoff.bytes_received for o in outs[3:])
    assert sum(o.facts.bytes_sent["handoff"] for o in outs[:3]) > sum(o.facts.handoff.bytes_sent for o in outs[:3])
