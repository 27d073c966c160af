"""Ranks that own nothing: prompts of 1 .. 2P-1 tokens and batches where some ranks hold no token.

Every primitive that runs per rank must give the one-device result when
a rank's share is empty: DSA-CP (both splits, both outputs), DCP decode
(ranks holding no key of a short sequence), and a DCP-sharded cached
context under PCP (ranks with no new token and/or no cached token).
Simulated mesh; the oracles are the float64 references of each area.
"""

import pytest
import torch

import cpattn
from cpattn.dsa import dsa_cp_plan
from cpattn.layout.pcp import pcp_plan, pcp_unshard
from test_dcp_decode import build, build_prefill, check, prefill_heads_rank, prefill_tokens_rank, run_cases
from test_dsa_cp import case, check_cp, cp_rank

SIZES = [2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("n", SIZES)
def test_dsa_cp_short_prompts_and_idle_ranks(n, one_thread):
    """Prompts of 1 .. 2n-1 tokens, and a batch with zero-length requests: every split and output."""
    batches = [[m] for m in range(1, 2 * n)] + [[1, 0, 2], [0, 1]]
    cases = [case(lens, h=2 * n, topk=3, seed=60 + i) for i, lens in enumerate(batches)]
    for split in ("contiguous", "balanced"):
        plans = [dsa_cp_plan(c["cu_q"], n, split=split) for c in cases]
        assert any(0 in p.num_tokens for p in plans)  # the cases do leave ranks empty
        for output in ("token", "head"):
            per_rank = cpattn.simulate(n, cp_rank, cases, split, output)
            for i, c in enumerate(cases):
                check_cp(c, [per_rank[r][i] for r in range(n)], n, split, output)


@pytest.mark.parametrize("n", SIZES)
def test_dcp_decode_sequences_shorter_than_the_group(n, one_thread):
    """Sequences of 1 .. 2n-1 tokens: some ranks hold none of a request's keys (partial (0, -inf))."""
    cases = []
    for inter in (1, 2):
        seq = list(range(1, 2 * n))
        ql = [1] * len(seq)
        ql[-1] = min(2, seq[-1])  # one speculative pair too
        cases.append(build(70 + inter, n, seq, ql, inter=inter, bs=4, hl=1, hkv=1))
    cases.append(build(75, n, [1], [1], inter=1, bs=4, hl=2, hkv=1, pad_rows=2))  # one token, padding rows
    results = cpattn.simulate(n, run_cases, cases)
    for i, c in enumerate(cases):
        per_rank = [results[r][i] for r in range(n)]
        check(c, [(p[0], p[1]) for p in per_rank])
        check(c, [(p[2], p[3]) for p in per_rank])


@pytest.mark.parametrize("n", SIZES)
def test_dcp_context_with_ranks_owning_nothing(n, one_thread):
    """PCP prefill over a DCP-sharded context: 1-token prompts (most ranks get no new token) and
    contexts shorter than the group (ranks with no cached token), by tokens and by heads."""
    case_tok = build_prefill(80 + n, n, [0, 1, n + 1], [1, 2 * n - 1, 1], inter=1, bs=4)
    for method in ("ring", "allgather"):
        plan = pcp_plan(case_tok["cu"], n, context_lens=case_tok["ctx"].tolist())
        assert 0 in [plan.num_a(r) for r in range(n)]
        out = pcp_unshard(cpattn.simulate(n, prefill_tokens_rank, case_tok, method), plan)
        torch.testing.assert_close(out.double(), case_tok["want"], rtol=1e-5, atol=2e-5)
    one_token = build_prefill(90 + n, n, [1], [1], inter=1, bs=4)
    plan = pcp_plan(one_token["cu"], n, context_lens=[1])
    out = pcp_unshard(cpattn.simulate(n, prefill_tokens_rank, one_token, "ring"), plan)
    torch.testing.assert_close(out.double(), one_token["want"], rtol=1e-5, atol=2e-5)
    case_heads = build_prefill(95 + n, n, [1, 0, 2], [1, 1, 3], inter=2, bs=4, hq=2 * n, hkv=1)
    for merge in ("ag_rs", "a2a"):
        out = torch.cat(cpattn.simulate(n, prefill_heads_rank, case_heads, merge), dim=1)
        torch.testing.assert_close(out.double(), case_heads["want"], rtol=1e-5, atol=2e-5)
