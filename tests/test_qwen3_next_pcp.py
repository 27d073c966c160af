"""Qwen3-Next prefill under PCP (simulated mesh, P in {1, 2, 3}) against HF and one device.

The attention layers run :class:`cpattn.engine.prefill_steps.PCPStep` over a head-tail ``pcp_plan``; the
linear layers :class:`cpattn.linear.pcp_step.PCPLinearStep` on the very same local tokens (the head-tail
:class:`ScanLayout`: 2P segments scanned in sequence order). Checked:

- prompt logits (restored to request order) within 1e-4 relative of HF, and close to one device;
- every rank ends with the same conv / recurrent states, equal to one device's to fp32 rounding;
- the prefill's KV rows and states handed to a one-device decode give HF ``generate``'s greedy tokens;
- a chunked prefill continued under PCP (cached KV as a replicated prefix, cached linear states) matches HF.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

import cpattn  # noqa: E402
from near_tie import check_tokens, rel_err  # noqa: E402
from test_qwen3_next_hf import NEW, PROMPT_LENS, caches, reference, step  # noqa: E402

from cpattn.engine.prefill_steps import PCPStep  # noqa: E402
from cpattn.linear import ScanLayout  # noqa: E402
from cpattn.linear.pcp_step import PCPLinearStep  # noqa: E402
from cpattn.models import qwen3_next as qn  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FLIPS: list = []


def pcp_prefill(params, cfg, prompts, size, method):
    tokens = torch.cat(prompts)
    cu = [0, PROMPT_LENS[0], sum(PROMPT_LENS)]
    plan = cpattn.pcp_plan(cu, size)
    layout = ScanLayout.head_tail(size)

    def rank(group):
        r = group.rank
        attn = PCPStep(group, plan, qn.kv_layouts(cfg), method=method)
        lin = PCPLinearStep(group, layout, [plan.cu_a[r], plan.cu_b[r]], qn.recurrent_cache(cfg, batch=2))
        with torch.no_grad():
            logits = qn.forward(params, cfg, tokens[plan.token_index[r]], attn, lin)
        return logits, lin.finish(), {j: rows for j, rows in attn.kv.items()}, group.stats.as_dict()

    res = cpattn.simulate(size, rank)
    logits = torch.cat([x[0] for x in res])[plan.restore_index]
    kv = {j: tuple(torch.cat([x[2][j][i] for x in res])[plan.restore_index] for i in (0, 1)) for j in res[0][2]}
    return logits, [x[1] for x in res], kv, [x[3] for x in res]


@pytest.mark.parametrize("size,method", [(1, "ring"), (2, "ring"), (3, "allgather")])
def test_pcp_prefill_matches_hf_and_one_device(size, method):
    hf, cfg, params, prompts, ref_logits, ref_tokens, ref_gen = reference("moe")
    logits, states, kv, stats = pcp_prefill(params, cfg, prompts, size, method)
    for b, got in enumerate(logits.split(list(PROMPT_LENS))):
        assert rel_err(got, ref_logits[b]) <= 1e-4, f"P={size} request {b}"
    kv1, rec1 = caches(cfg, 2, 40)
    with torch.no_grad():
        one, kv1, rec1 = step(params, cfg, kv1, rec1, prompts)
    assert rel_err(logits, one) <= 2e-5
    for st in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(st.state + st.conv, states[0].state + states[0].conv))
    for a, b in zip(states[0].state + states[0].conv, rec1.state + rec1.conv):
        assert rel_err(a, b) <= 1e-5
    if size > 1:  # the linear layers' exchange: 3 layers x (summaries + conv tails) in one all-gather each
        assert stats[0]["calls"]["all_gather"] >= 2 * len(cfg.layer_slots("linear_attention"))

    # hand-off: the prefill's KV rows and states into a one-device decode
    dec_kv, _ = caches(cfg, 2, max(PROMPT_LENS) + NEW)
    at = 0
    for b, n in enumerate(PROMPT_LENS):
        for j, (k, v) in kv.items():
            dec_kv.k[j][b, :n], dec_kv.v[j][b, :n] = k[at:at + n], v[at:at + n]
        at += n
    dec_kv, rec = dataclasses.replace(dec_kv, seq_lens=PROMPT_LENS), states[0]  # the rows written above
    last = logits[torch.tensor([PROMPT_LENS[0] - 1, sum(PROMPT_LENS) - 1])]
    toks, logs = [[], []], [[], []]
    with torch.no_grad():
        for _ in range(NEW):
            nxt = last.argmax(-1)
            for b in range(2):
                toks[b].append(int(nxt[b]))
                logs[b].append(last[b])
            last, dec_kv, rec = step(params, cfg, dec_kv, rec, [nxt[:1], nxt[1:]])
    for b in range(2):
        check_tokens(torch.tensor(toks[b]), torch.stack(logs[b]), ref_tokens[b], ref_gen[b], f"P={size} req {b}",
                     FLIPS)
    assert len(FLIPS) <= 1, FLIPS


@pytest.mark.parametrize("size", [2, 3])
def test_pcp_continues_a_chunked_prefill(size):
    """The first 8 / 5 tokens on one device, the rest under PCP: the attention layers read the cached KV as a
    replicated :class:`Prefix`, the linear layers start from the cached conv / recurrent states."""
    from cpattn.engine.kv_rows import pack_rows
    from cpattn.engine.prefill_steps import Prefix

    hf, cfg, params, prompts, ref_logits, _, _ = reference("moe")
    ctx = [8, 5]
    kv, rec = caches(cfg, 2, 40)
    with torch.no_grad():
        _, kv, rec = step(params, cfg, kv, rec, [p[:c] for p, c in zip(prompts, ctx)])
    layouts = qn.kv_layouts(cfg)
    cached = [torch.cat([kv.k[j][b, :c] for b, c in enumerate(ctx)]) for j in range(len(layouts))]
    cached_v = [torch.cat([kv.v[j][b, :c] for b, c in enumerate(ctx)]) for j in range(len(layouts))]
    prefix = Prefix(pack_rows(layouts, cached, cached_v, [None] * len(layouts)), tuple(ctx))
    rest = [p[c:] for p, c in zip(prompts, ctx)]
    lens = [r.numel() for r in rest]
    plan = cpattn.pcp_plan([0, lens[0], sum(lens)], size, context_lens=ctx)
    layout, tokens = ScanLayout.head_tail(size), torch.cat(rest)

    def rank(group):
        r = group.rank
        attn = PCPStep(group, plan, layouts, prefix=prefix)
        lin = PCPLinearStep(group, layout, [plan.cu_a[r], plan.cu_b[r]], rec)
        with torch.no_grad():
            return qn.forward(params, cfg, tokens[plan.token_index[r]], attn, lin), lin.finish()

    res = cpattn.simulate(size, rank)
    logits = torch.cat([x[0] for x in res])[plan.restore_index]
    for b, got in enumerate(logits.split(lens)):
        assert rel_err(got, ref_logits[b][ctx[b]:]) <= 1e-4, f"P={size} request {b}"
    kv1, rec1 = caches(cfg, 2, 40)
    with torch.no_grad():
        _, _, rec1 = step(params, cfg, kv1, rec1, prompts)
    for a, b in zip(res[-1][1].state + res[-1][1].conv, rec1.state + rec1.conv):
        assert rel_err(a, b) <= 1e-5
