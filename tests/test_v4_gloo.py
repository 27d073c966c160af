"""DeepSeek-V4 PCP and DCP on 2 real gloo processes (torch.distributed), exact vs one device.

One spawn runs both (process start-up dominates): a CSA layer's PCP
prefill (halo ring exchanges, entry all-gather) and its DCP prefill +
multi-token decode (key-sharded exact top-k, partial all-gather).
"""

from __future__ import annotations

import pytest
import torch

from cpattn.comm.launch import spawn
from cpattn.v4.cache import V4Cache
from test_v4_attention import CHUNKS, LENGTHS, layout, make_layer, packed_input, run_steps
from test_v4_pcp import LENS, shard


def both(group):
    """Rank's PCP output (its tokens) and DCP outputs (every request, all steps) for a CSA layer."""
    from cpattn.v4.pcp import v4_pcp_attention, v4_pcp_plan

    xs = [make_layer("csa", n, seed=b) for b, n in enumerate(LENS)]
    plan = v4_pcp_plan([0, LENS[0], sum(LENS)], group.size, layout("csa"))
    inp = packed_input(xs, [(0, n) for n in LENS], "csa")
    pcp = v4_pcp_attention(shard(inp, plan.pcp.token_index[group.rank]), "csa", plan, group).out
    ys = [make_layer("csa", n, seed=b) for b, n in enumerate(LENGTHS)]
    cache = V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64, dcp_rank=group.rank,
                          dcp_size=group.size, interleave=2, seed=4)
    dcp, _ = run_steps(cache, ys, CHUNKS, "csa", group)
    return pcp, dcp


def test_pcp_and_dcp_on_gloo():
    import cpattn
    from cpattn.v4.pcp import v4_pcp_plan

    ranks = spawn(2, both, timeout_s=240)
    plan = v4_pcp_plan([0, LENS[0], sum(LENS)], 2, layout("csa"))
    xs = [make_layer("csa", n, seed=b) for b, n in enumerate(LENS)]
    one, _ = run_steps(V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64), xs, [list(LENS)], "csa")
    got = cpattn.pcp_unshard([pcp for pcp, _ in ranks], plan.pcp)
    torch.testing.assert_close(got, torch.cat(one), rtol=1e-12, atol=1e-12)
    ys = [make_layer("csa", n, seed=b) for b, n in enumerate(LENGTHS)]
    one, _ = run_steps(V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64), ys, CHUNKS, "csa")
    for r, (_, dcp) in enumerate(ranks):
        for b in range(2):
            torch.testing.assert_close(dcp[b], one[b], rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {r}: {m}")
