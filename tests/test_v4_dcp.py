"""DCP for DeepSeek-V4 attention: exact vs one device on the simulated mesh (N = 2, 3, 4).

Compressed entries are sharded interleaved over the DCP ranks (I = 1 and
2), the rings replicated, the window's heads split over the ranks (each
head's window partial, with its sink, computed by one rank), CSA's top-k
selected exactly from key-sharded indexer keys. Two requests are prefilled
(in chunks, through the same DCP step) and then decoded with multi-token
queries (1 + k = 4 rows: speculative verify). Every rank's output equals
the one-device step in float64; with N = 4 the short request's early
entries leave some ranks without any (their partials are empty).
"""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.v4.cache import V4Cache
from test_v4_attention import CHUNKS, LENGTHS, layout, make_layer, run_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def dcp_rank(group, kind, xs, chunks, interleave_size, dtype=torch.float64):
    cache = V4Cache.empty(layout(kind), batch=len(xs), max_len=64, dtype=dtype, dcp_rank=group.rank,
                          dcp_size=group.size, interleave_size=interleave_size, seed=1 + group.rank)
    outs, cache = run_steps(cache, xs, chunks, kind, group)
    return outs, cache.seq_lens


@pytest.mark.slow
@pytest.mark.parametrize("n,interleave_size", [(2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_dcp_matches_one_device(kind, n, interleave_size):
    xs = [make_layer(kind, L, seed=b) for b, L in enumerate(LENGTHS)]
    # the one-device step (equal to the float64 oracle: test_v4_attention)
    one, _ = run_steps(V4Cache.empty(layout(kind), batch=2, max_len=64, dtype=torch.float64, seed=1), xs, CHUNKS, kind)
    ranks = cpattn.simulate(n, dcp_rank, kind, xs, CHUNKS, interleave_size)
    for r, (outs, lens) in enumerate(ranks):
        assert lens == tuple(LENGTHS)
        for b in range(2):
            torch.testing.assert_close(outs[b], one[b], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"rank {r}, request {b}: {m}")


def test_dcp_entry_caches_are_sharded():
    """Each rank holds only its interleaved share of the entries: the others' rows stay NaN."""
    kind, n = "csa", 2
    xs = [make_layer(kind, 24, seed=0)]

    def rank(group):
        cache = V4Cache.empty(layout(kind), batch=1, max_len=64, dtype=torch.float64, dcp_rank=group.rank,
                              dcp_size=n, seed=0)
        _, cache = run_steps(cache, xs, [[24]], kind, group)
        local = (cache.tables["ent_csa"][0][:, None] * 4 + torch.arange(4)).flatten()  # slots of local rows 0, 1, ...
        return cache.entries[0].view(-1, 16)[local]

    rows = cpattn.simulate(n, rank)  # per rank: its local rows in local order
    for r in range(n):
        filled = (~torch.isnan(rows[r][:, 0])).nonzero().flatten().tolist()
        assert filled == [0, 1, 2], f"rank {r} holds local entries {filled}; 6 entries over 2 ranks give 3 each"
