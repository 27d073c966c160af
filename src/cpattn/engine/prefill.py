"""The prefill stage: a batch of prompts over a group of ranks, one device, PCP or DSA-CP.

The prompts' new tokens are split over the group (:func:`split_plan`: the
head-tail PCP plan, or a DSA-CP plan for DSA models); each rank runs the
whole model on its tokens with a parallel attention step
(:mod:`cpattn.engine.prefill_steps`), RoPE at the plan's global positions.
A group of one rank is plain prefill. A cached prefix (prefix caching, a
KV-pool hit) enters every layer's attention as a :class:`~cpattn.engine.prefill_steps.Prefix`.

What comes out (:class:`PrefillOut`): each request's first token logits
(from whichever rank holds its last prompt token, summed over the group),
this rank's KV rows in plan order (what the hand-off moves), and on demand
the prompt logits and hidden states in request order (all-gathered).

Example
-------
>>> import torch, cpattn
>>> from cpattn.engine.batch import Prompts
>>> from cpattn.models.family import get_family
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> fam, params = get_family("qwen3"), qwen3.init_params(cfg)
>>> outs = cpattn.simulate(2, lambda g: prefill(g, fam, params, cfg, Prompts.of([[1, 2, 3, 4, 5]])))
>>> outs[0].first_logits.shape, [o.rows.shape[0] for o in outs]
(torch.Size([1, 32]), [3, 2])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.dsa import DSACPPlan, dsa_cp_plan
from cpattn.engine.batch import Prompts
from cpattn.models.family import ModelFamily
from cpattn.engine.kv_rows import pack_rows
from cpattn.engine.logits import as_logits
from cpattn.engine.options import Algorithms
from cpattn.engine.prefill_steps import DSACPStep, PCPStep, Prefix
from cpattn.layout.pcp import PCPPlan, gather_unshard, pcp_plan, pcp_shard


@dataclass(frozen=True)
class PrefillOut:
    """One rank's result of :func:`prefill`.

    plan: the token split (``token_index``, ``positions``, ``num_tokens``, ...);
    rows: [T_r, F] this rank's KV rows in plan order (:mod:`cpattn.engine.kv_rows`);
    first_logits: [B, V] float32 (float64 in a float64 run), each request's last prompt token (every rank);
    prompt_logits: [T, V] float32 (float64 in a float64 run) in request order, or None;
    hidden: ``{name: [T, H]}`` in request order (see the family's forward), or None;
    bytes_sent: what this rank sent during the stage.
    """

    plan: PCPPlan | DSACPPlan
    rows: torch.Tensor
    first_logits: torch.Tensor
    prompt_logits: torch.Tensor | None
    hidden: dict | None
    bytes_sent: int


def split_plan(family: ModelFamily, cu_seqlens: list[int], size: int, *, algorithms: Algorithms = Algorithms(),
               context_lens: tuple[int, ...] | None = None) -> PCPPlan | DSACPPlan:
    """How a batch's new tokens (``cu_seqlens`` [B+1]) are split over ``size`` ranks (host-side, the same on every rank).

    >>> from cpattn.models.family import get_family
    >>> [t.tolist() for t in split_plan(get_family("qwen3"), [0, 8], 2).token_index]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    if family.attention == "dsa":
        return dsa_cp_plan(cu_seqlens, size, context_lens=context_lens, split=algorithms.dsa_split)
    return pcp_plan(cu_seqlens, size, context_lens=context_lens)


def prefill(group: Group, family: ModelFamily, params: dict, cfg: Any, prompts: Prompts, *,
            algorithms: Algorithms = Algorithms(), prefix: Prefix | None = None, prompt_logits: bool = False,
            hidden_layers: tuple | None = None) -> PrefillOut:
    """Prefill ``prompts`` with their tokens split over ``group``; run it on every rank of the group.

    prefix: cached KV of each request's first ``prefix.context_lens[b]``
    tokens (only the rest is computed). prompt_logits: also return the
    logits of every computed token, gathered in request order. hidden_layers:
    ask the forward for hidden states (what a drafter reads), gathered in
    request order. Returns a :class:`PrefillOut`.
    """
    layouts = family.kv_layouts(cfg)
    new = prompts if prefix is None else prompts.suffix(prefix.context_lens)
    cu = new.cu_seqlens
    ctx = None if prefix is None else prefix.context_lens
    plan = split_plan(family, cu, group.size, algorithms=algorithms, context_lens=ctx)
    if family.attention == "dsa":
        step = DSACPStep(group, plan, layouts, prefix=prefix)
    else:
        step = PCPStep(group, plan, layouts, method=algorithms.pcp_method, prefix=prefix)
    before = group.stats.total_sent()
    mine = pcp_shard(new.tokens, plan, group.rank)  # [T_r]
    idx = plan.token_index[group.rank]  # [T_r] packed ids of my tokens
    last = torch.tensor(cu[1:]) - 1  # [B] each request's last prompt token
    rows_end, reqs = (idx[:, None] == last[None, :]).nonzero(as_tuple=True)  # my rows that end a request
    logits_index = None if prompt_logits else rows_end
    extra = {} if hidden_layers is None else {"hidden_layers": tuple(hidden_layers)}
    out = family.forward(params, cfg, mine, step, logits_index=logits_index, **extra)
    logits, hidden = out if hidden_layers is not None else (out, None)
    logits = as_logits(logits)
    full = None
    if prompt_logits:
        full = gather_unshard(group, logits, plan)  # [T, V]
        first = full[last]
    else:
        first = torch.zeros(new.num_requests, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        first = group.all_reduce(first.index_copy(0, reqs, logits))  # each request's row comes from one rank
    if hidden is not None:
        hidden = {name: gather_unshard(group, h, plan) for name, h in hidden.items()}
    n = len(layouts)
    kv = [step.kv[l] for l in range(n)]
    rows = pack_rows(layouts, [r.k for r in kv], [r.v for r in kv], [r.k_index for r in kv])  # [T_r, F]
    return PrefillOut(plan, rows, first, full, hidden, group.stats.total_sent() - before)
