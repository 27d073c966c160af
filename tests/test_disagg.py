"""P/D disaggregation: a PCP prefill engine hands whole KV blocks to a DCP decode engine.

Tokens must equal plain single-device greedy generation (float64 tiny models, see test_speculative.py).
The simulated mesh deals the blocks in memory; the gloo test moves them with isend/irecv between the
two process sets of one world.
"""

from __future__ import annotations

import pytest
import torch
import spec_pd_cases
from spec_pd_cases import pd_cases, prompts, tiny_qwen3

from cpattn.comm.launch import spawn
from cpattn.comm.sim import SimMesh
from cpattn.engine.batch import Prompts
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.handoff import deal_blocks, request_blocks
from cpattn.engine.prefill import gather_unshard, prefill
from cpattn.layout.dcp import unshard_kv_blocks
from cpattn.models.generate import disagg_generate, pd_configs

NEW = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(one_device):
    """name -> (model, params, cfg, the one-device greedy recompute of NEW tokens) for a tiny model
    (:func:`spec_pd_cases.reference`; conftest.py's ``one_device`` oracle)."""
    return lambda name: spec_pd_cases.reference(one_device, name, NEW)


LAYOUTS = [(1, 1), (2, 2), (3, 4), (5, 2), (8, 8), (7, 1), (4, 8), (6, 4)]  # (prefill PCP, decode DCP)


@pytest.mark.slow
@pytest.mark.parametrize("p,n", LAYOUTS, ids=[f"P{p}-N{n}" for p, n in LAYOUTS])
def test_matches_single_engine(reference, p, n):
    model, params, cfg, ref = reference("qwen3")
    out = disagg_generate(model, params, cfg, prompts(), NEW, pcp_size=p, dcp_size=n,
                          block_size=2 if n == 8 else 4, pcp_method="allgather" if p == 5 else "ring")
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.allclose(out.logits.double(), ref.logits.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_mla_dsa_with_speculation(reference, name):
    model, params, cfg, ref = reference(name)
    out = disagg_generate(model, params, cfg, prompts(), NEW, pcp_size=2, dcp_size=2, block_size=4,
                          drafter=NgramDrafter(), num_speculative_tokens=2)
    assert torch.equal(out.tokens, ref.tokens)


def test_blocks_are_whole_and_dealt_round_robin(reference):
    """Block j of a request goes to decode rank j % N as local block j // N; tails past the prompt are NaN."""
    model, params, cfg, _ = reference("qwen3")
    ps = Prompts.of(prompts())
    cu = ps.cu_seqlens
    one = SimMesh(1).groups()[0]
    out = prefill(one, model.FAMILY, params, cfg, ps)
    rows = gather_unshard(one, out.rows, out.plan)  # [T, F] request order
    bs, n = 4, 3
    blocks = request_blocks(rows, cu, bs)
    dealt = deal_blocks(blocks, dcp_size=n)
    for b, (a, e) in enumerate(zip(cu, cu[1:])):
        empty = blocks[b].new_zeros(0, bs, rows.shape[1])  # [0, B, F]
        parts = []
        for r in range(n):
            mine = sorted(((i, pl) for rb, i, pl in dealt[r] if rb == b), key=lambda x: x[0])  # (local block, [B, F])
            assert [i for i, _ in mine] == list(range(len(mine)))
            parts.append(torch.stack([pl for _, pl in mine]) if mine else empty)
        whole = unshard_kv_blocks(parts, dcp_size=n, interleave_size=bs, block_size=bs)  # [nb, B, F]
        flat = whole.reshape(-1, rows.shape[1])
        assert torch.equal(flat[: e - a], rows[a:e])
        assert torch.isnan(flat[e - a :]).all()


def test_config_rules():
    _, _, cfg = tiny_qwen3()
    prod, cons = pd_configs("qwen3", cfg, pcp_size=4, dcp_size=2, block_size=8)
    assert (prod.kv_transfer.kv_role, prod.parallel.pcp_size, cons.kv_transfer.kv_role, cons.parallel.pcp_size, cons.parallel.dcp_size) == \
        ("kv_producer", 4, "kv_consumer", 1, 2)
    assert cons.cache.cp_kv_cache_interleave_size == cons.cache.block_size == 8
    with pytest.raises(ValueError, match="pcp_size"):
        pd_configs("qwen3", cfg, pcp_size=2, dcp_size=2, block_size=8, decode_pcp_size=2)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        pd_configs("qwen3", cfg, pcp_size=2, dcp_size=2, block_size=8, interleave_size=1)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        pd_configs("qwen3", cfg, pcp_size=2, dcp_size=1, block_size=8, interleave_size=2)
    model, params, _ = tiny_qwen3()
    with pytest.raises(ValueError, match=r"num_attention_heads % tp_size == 0"):
        disagg_generate(model, params, cfg, prompts(), 4, pcp_size=2, dcp_size=3)


@pytest.mark.slow
def test_on_gloo_ranks(reference):
    """One world of 4 gloo processes: P=2 -> N=2 (plain, and speculative with another DCP merge: both through
    the step loop's run_rank), then P=3 -> N=1 (the composition: a producer of 3 ranks is an engine the step loop
    refuses, 8 heads % 3)."""
    from cpattn.engine.connector_pd import usable_blocks

    model, params, cfg, ref = reference("qwen3")
    args = ("qwen3", params, cfg, prompts(), NEW)
    cases = [(args, {"pcp_size": 2, "dcp_size": 2, "block_size": 4}),
             (args, {"pcp_size": 2, "dcp_size": 2, "block_size": 2, "drafter": NgramDrafter(),
                     "num_speculative_tokens": 3, "dcp_merge": "a2a"}),
             (args, {"pcp_size": 3, "dcp_size": 1, "block_size": 4})]
    step_loop = [True, True, False]
    per_rank = spawn(4, pd_cases, cases)
    for c, (_, kw) in enumerate(cases):
        p, bs = kw["pcp_size"], kw["block_size"]
        sent = [per_rank[r][c].facts for r in range(p)]
        got = [per_rank[r][c].facts for r in range(p, 4)]
        assert [f.role for f in sent] == ["prefill"] * p and [f.role for f in got] == ["decode"] * (4 - p)
        # the step loop sends the blocks the consumer can use (it computes its tail), the composition all of them
        blocks = [usable_blocks(len(q), bs, 4 - p) if step_loop[c] else -(-len(q) // bs) for q in prompts()]
        assert sum(f.handoff.blocks_sent for f in sent) == sum(f.handoff.blocks_received for f in got) == sum(blocks)
        assert sum(f.handoff.bytes_sent for f in sent) == sum(f.handoff.bytes_received for f in got) > 0
        for r in range(4):  # every rank returns the decode engine's tokens
            assert torch.equal(per_rank[r][c].tokens, ref.tokens)
