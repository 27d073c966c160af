"""PCP prefill for DeepSeek-V4 attention: exact vs one device on the simulated mesh (P = 2, 3, 4).

Head-tail split of two prompts (45 and 13 tokens: uneven over 2P chunks,
and chunks of 13 // 8 tokens are far shorter than the window, so halos
span several chunks and ranks). Each rank's output, unsharded, equals the
one-device step in float64, and its gathered entries equal the oracle's.
The byte counters show what moves: a sliding layer's halo costs the same
for a 48- and a 480-token prompt (O(window)); the entries' all-gather is
O(tokens / m).
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

import cpattn
from cpattn.v4.attention import Compression, LayerInput
from cpattn.v4.cache import V4Cache
from cpattn.v4.pcp import v4_pcp_attention, v4_pcp_plan
from test_v4_attention import (
    CSA, D, DI, HCA, WINDOW, finish_fn, layout, make_layer, oracle_entries, packed_input, run_steps,
)

pytestmark = pytest.mark.usefixtures("one_thread")
LENS = (45, 13)


def shard(inp: LayerInput, idx: torch.Tensor) -> LayerInput:
    """The rows ``idx`` of every per-token tensor of a LayerInput."""
    def pick(v):
        if isinstance(v, Compression):
            return replace(v, kv=v.kv[idx], gate=v.gate[idx])
        return v[idx] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == inp.q.shape[0] else v
    return replace(inp, **{f.name: pick(getattr(inp, f.name)) for f in fields(inp) if f.name != "sinks"})


def pcp_rank(group, kind, inp, plan):
    res = v4_pcp_attention(shard(inp, plan.pcp.token_index[group.rank]), kind, plan, group)
    return res, group.stats.as_dict()


def prefill(kind, lens, p):
    xs = [make_layer(kind, n, seed=b) for b, n in enumerate(lens)]
    inp = packed_input(xs, [(0, n) for n in lens], kind)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    plan = v4_pcp_plan(cu, p, layout(kind))
    return xs, inp, plan, cpattn.simulate(p, pcp_rank, kind, inp, plan)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_pcp_matches_one_device(kind, p):
    xs, inp, plan, ranks = prefill(kind, LENS, p)
    got = cpattn.pcp_unshard([res.out for res, _ in ranks], plan.pcp)
    one, _ = run_steps(V4Cache.empty(layout(kind), batch=2, max_len=64, dtype=torch.float64), xs, [list(LENS)], kind)
    torch.testing.assert_close(got, torch.cat(one), rtol=1e-12, atol=1e-12)
    if kind == "sliding":
        return
    m, overlap = (CSA, True) if kind == "csa" else (HCA, False)
    for res, _ in ranks:  # every rank holds every request's entries, pooled by exactly one rank each
        for b, n in enumerate(LENS):
            want = oracle_entries(xs[b]["ckv"], xs[b]["cgate"], xs[b]["cbias"], m, overlap, finish_fn(0.01), n)
            at = int(res.offsets[b])
            torch.testing.assert_close(res.entries[at : at + n // m], want, rtol=1e-12, atol=1e-12)
            if kind == "csa":
                keys = oracle_entries(xs[b]["ikv"], xs[b]["igate"], xs[b]["ibias"], m, True, finish_fn(-0.02), n)
                torch.testing.assert_close(res.index_keys[at : at + n // m], keys, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lens,p", [((3,), 4), ((17, 0, 5), 3)])
def test_pcp_ranks_without_tokens_and_empty_requests(lens, p):
    xs, inp, plan, ranks = prefill("csa", lens, p)
    assert 0 in plan.pcp.num_tokens or 0 in lens
    got = cpattn.pcp_unshard([res.out for res, _ in ranks], plan.pcp)
    one, _ = run_steps(V4Cache.empty(layout("csa"), batch=len(lens), max_len=64, dtype=torch.float64), xs,
                       [list(lens)], "csa")
    torch.testing.assert_close(got, torch.cat(one), rtol=1e-12, atol=1e-12)


def test_sliding_halo_bytes_do_not_grow_with_the_prompt():
    """Halo traffic of a sliding layer: (W - 1) rows of D float64 per chunk start, for 48 or 480 tokens."""
    sent = []
    for n in (48, 480):
        _, _, plan, ranks = prefill("sliding", (n,), 2)
        per_rank = [stats["bytes_sent"].get("ring", 0) for _, stats in ranks]
        sent.append(per_rank)
        assert set(ranks[0][1]["calls"]) == {"ring"}  # no all-gather, no ring of the whole sequence
    assert sent[0] == sent[1]
    row = D * 8  # one K = V row in float64
    assert sent[0] == [(WINDOW - 1) * row, (WINDOW - 1) * row]  # rank 0 -> chunk 3, rank 1 -> chunk 1


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_entry_gather_is_tokens_over_m(kind):
    n = 256
    _, _, plan, ranks = prefill(kind, (n,), 2)
    m = CSA if kind == "csa" else HCA
    width = (D + DI) if kind == "csa" else D
    got = ranks[0][1]["bytes_sent"]["all_gather"]
    assert got == plan.kinds[kind].max_windows * width * 8  # (P - 1) x this rank's padded entries
    assert plan.kinds[kind].max_windows == n // m // 2  # half the entries each: n / m / P rows
