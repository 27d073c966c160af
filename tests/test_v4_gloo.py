"""DeepSeek-V4 PCP and DCP on 2 real gloo processes (torch.distributed), exact vs one device.

One spawn runs everything (process start-up dominates): a CSA layer's PCP
prefill (halo ring exchanges, entry all-gather) and its DCP prefill +
multi-token decode (key-sharded exact top-k, partial all-gather); then the
whole tiny model through the engine on the same two processes: one engine
with PCP 2 and DCP 2 (``generate_on_rank``: tail rows all-gathered, each
rank keeps its entries) and P/D, rank 0 prefilling and sending its hand-off
point to point to rank 1, which decodes -- the tokens of one device.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.comm.launch import spawn
from cpattn.v4.cache import V4Cache
from test_v4_attention import CHUNKS, LENGTHS, layout, make_layer, packed_input, run_steps
from test_v4_pcp import LENS, shard

pytestmark = pytest.mark.slow


def both(group):
    """Rank's PCP output (its tokens) and DCP outputs (every request, all steps) for a CSA layer."""
    from cpattn.v4.pcp import v4_pcp_attention, v4_pcp_plan

    xs = [make_layer("csa", n, seed=b) for b, n in enumerate(LENS)]
    plan = v4_pcp_plan([0, LENS[0], sum(LENS)], group.size, layout("csa"))
    inp = packed_input(xs, [(0, n) for n in LENS], "csa")
    pcp = v4_pcp_attention(shard(inp, plan.pcp.token_index[group.rank]), "csa", plan, group).out
    ys = [make_layer("csa", n, seed=b) for b, n in enumerate(LENGTHS)]
    cache = V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64, dcp_rank=group.rank,
                          dcp_size=group.size, interleave_size=2, seed=4)
    dcp, _ = run_steps(cache, ys, CHUNKS, "csa", group)
    return pcp, dcp, engine_runs(group)


def engine_runs(group):
    """The tiny model through the engine over real gloo: one engine PCP 2 + DCP 2, and P/D 1 -> 1."""
    from cpattn.models import deepseek_v4 as v4
    from cpattn.models import generate as gen

    cfg, params = MODEL()
    one = gen.pcp_dcp_generate_on_rank(group, v4, params, cfg, PROMPTS, NEW, config=gen.pcp_dcp_config(v4, cfg, 2))
    pd = gen.pd_generate_on_rank(group, v4, params, cfg, PROMPTS, NEW, pcp_size=1, dcp_size=1)
    return one.tokens, pd.tokens, pd.facts.handoff


def MODEL():
    from cpattn.models import deepseek_v4 as v4

    cfg = v4.DeepseekV4Config.tiny()
    params = v4.init_params(cfg, seed=3, std=0.2)  # in float64: tokens compared with torch.equal (DESIGN.md §5)
    return cfg, {n: t.double() if t.is_floating_point() else t for n, t in params.items()}


PROMPTS, NEW = [[5, 9, 2, 7, 1], [(3 * i + 1) % 64 for i in range(37)]], 6


def test_pcp_and_dcp_on_gloo(one_device):
    import cpattn
    from cpattn.v4.pcp import v4_pcp_plan

    ranks = spawn(2, both, timeout_s=240)
    cfg, params = MODEL()
    want = one_device("deepseek_v4", params, cfg, PROMPTS, NEW).tokens
    for r, (_, _, (colocated, pd, facts)) in enumerate(ranks):
        assert torch.equal(colocated, want) and torch.equal(pd, want), f"rank {r}"
        assert (facts.bytes_sent > 0) if r == 0 else (facts.bytes_received > 0)  # the hand-off crossed ranks
    plan = v4_pcp_plan([0, LENS[0], sum(LENS)], 2, layout("csa"))
    xs = [make_layer("csa", n, seed=b) for b, n in enumerate(LENS)]
    one, _ = run_steps(V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64), xs, [list(LENS)], "csa")
    got = cpattn.pcp_unshard([pcp for pcp, _, _ in ranks], plan.pcp)
    torch.testing.assert_close(got, torch.cat(one), rtol=1e-12, atol=1e-12)
    ys = [make_layer("csa", n, seed=b) for b, n in enumerate(LENGTHS)]
    one, _ = run_steps(V4Cache.empty(layout("csa"), batch=2, max_len=64, dtype=torch.float64), ys, CHUNKS, "csa")
    for r, (_, dcp, _) in enumerate(ranks):
        for b in range(2):
            torch.testing.assert_close(dcp[b], one[b], rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {r}: {m}")
