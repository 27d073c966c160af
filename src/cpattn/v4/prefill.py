"""DeepSeek-V4 prefill on the engine: the whole model over a PCP group, keeping what a decode cache needs.

The prompts are split head-tail over the group (:func:`cpattn.v4.pcp.v4_pcp_plan`;
a group of one rank is plain prefill) and every rank runs the model on its
tokens with :class:`V4PrefillStep` as the attention step: each layer is
:func:`~cpattn.v4.pcp.v4_pcp_attention` (halos for the window and the
compressors, one all-gather of the entries). Besides the logits, the step
keeps, per layer, exactly what a decode cache is seeded with
(:mod:`cpattn.v4.handoff`):

- the *tail* rows of this rank's tokens: the K = V window row, the
  compressor rows ``[kv | gate]`` and (CSA) the indexer's, of the tokens
  at positions ``>= L - back`` (the rings' reach, ``back`` = W - 1 or the
  compressors' ``2m - 1`` / ``m - 1``); a few hundred rows per request;
- the gathered compressed entries and indexer keys (every rank holds all
  of them after the layer's all-gather).

No cached prefix: a V4 prefill starts at position 0 (its compressor state
would have to be cached too).

Example
-------
>>> import torch, cpattn
>>> from cpattn.layout.batch import Prompts
>>> from cpattn.models import deepseek_v4 as v4
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> outs = cpattn.simulate(2, lambda g: v4_prefill(g, v4.forward, params, cfg, Prompts.of([list(range(20))])))
>>> outs[0].first_logits.shape, [o.tail.positions.tolist()[:3] for o in outs]  # HCA m = 16: the last 15
(torch.Size([1, 64]), [[15, 16, 17], [5, 6, 7]])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.layout.batch import Prompts
from cpattn.ops.logits import as_logits
from cpattn.layout.pcp import gather_unshard
from cpattn.layout.pcp import PCPPlan, pcp_shard
from cpattn.v4.attention import LayerInput
from cpattn.v4.cache import V4Layout
from cpattn.v4.pcp import V4PCPPlan, v4_pcp_attention, v4_pcp_plan


def ring_reach(layout: V4Layout) -> int:
    """Positions before a step that any of the layout's rings reads: the tail a prefill keeps.

    >>> ring_reach(V4Layout(kinds=("sliding", "csa"), head_dim=4, window=8))
    7
    """
    rings = ["window"] + [f"raw_{k}" for k in ("csa", "hca") if k in layout.kinds]
    return max(layout.back(r) for r in rings)


@dataclass(frozen=True)
class TailRows:
    """Tail rows (see the module doc), per layer: requests / positions [R]; window[l] [R, D]; raw[l]
    [R, 2C] and index_raw[l] [R, 4 D_I] (None where the layer has none). ``ranks``: every prefill rank's
    (requests, positions) of its tail rows, known on every rank from the plan (a gather needs no header)."""

    requests: torch.Tensor
    positions: torch.Tensor
    window: tuple[torch.Tensor, ...]
    raw: tuple[torch.Tensor | None, ...]
    index_raw: tuple[torch.Tensor | None, ...]
    ranks: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class GatheredEntries:
    """Every request's compressed entries of each layer, as the prefill's all-gather left them:
    entries[l] [S, D] / index_keys[l] [S, D_I] (None for other kinds); request b's entry e of a
    layer of kind k at row ``offsets[k][b] + e``."""

    entries: tuple[torch.Tensor | None, ...]
    index_keys: tuple[torch.Tensor | None, ...]
    offsets: dict[str, torch.Tensor]


@dataclass(frozen=True)
class V4PrefillOut:
    """One rank's result of :func:`v4_prefill`.

    plan: the head-tail split (``pcp``, a :class:`~cpattn.layout.pcp.PCPPlan`);
    first_logits: [B, V] float32 (float64 in a float64 run), each request's last prompt token (every rank);
    prompt_logits: [T, V] float32 (float64 in a float64 run) in request order, or None; hidden: ``{name: [T, ...]}``
    in request order, or None; tail / entries: what seeds a decode cache;
    lens: the prompt lengths; bytes_sent: what this rank sent during the stage.
    """

    plan: PCPPlan
    first_logits: torch.Tensor
    prompt_logits: torch.Tensor | None
    hidden: dict | None
    tail: TailRows
    entries: GatheredEntries
    lens: tuple[int, ...]
    bytes_sent: int


class V4PrefillStep:
    """The attention step of a V4 prefill on one rank of a PCP group (see the module doc).

    ``positions`` [T_r]: this rank's tokens' positions (plan order);
    :meth:`attend` runs one layer and keeps its tail rows and entries.
    """

    def __init__(self, group: Group, plan: V4PCPPlan):
        self.group, self.plan = group, plan
        r, reach = group.rank, ring_reach(plan.layout)
        ends = torch.tensor(plan.pcp.query_lens, dtype=torch.int64)
        self.positions = plan.pcp.positions[r].long()
        kept = []  # every rank's local rows at positions >= L - reach (the plan is the same on every rank)
        for j in range(plan.pcp.pcp_size):
            req, pos = plan.row_request[j], plan.pcp.positions[j].long()
            kept.append((pos >= ends[req] - reach).nonzero().view(-1) if req.numel() else req)
        self._tail = kept[r]
        self._ranks = tuple((plan.row_request[j][k], plan.pcp.positions[j].long()[k]) for j, k in enumerate(kept))
        n = len(plan.layout.kinds)
        self.window: list = [None] * n
        self.raw: list = [None] * n
        self.index_raw: list = [None] * n
        self.entries: list = [None] * n
        self.index_keys: list = [None] * n
        self.offsets: dict[str, torch.Tensor] = {}

    def attend(self, layer: int, inp: LayerInput) -> torch.Tensor:
        """Layer ``layer``'s attention output [T_r, H, D] for this rank's tokens."""
        kind = self.plan.layout.kinds[layer]
        res = v4_pcp_attention(inp, kind, self.plan, self.group)
        keep = self._tail.to(inp.kv.device)
        self.window[layer] = inp.kv[keep]
        if kind != "sliding":
            c = inp.compression
            self.raw[layer] = torch.cat([c.kv, c.gate], dim=-1)[keep]
            self.entries[layer], self.offsets[kind] = res.entries, res.offsets
        if kind == "csa":
            c = inp.index_compression
            self.index_raw[layer] = torch.cat([c.kv, c.gate], dim=-1)[keep]
            self.index_keys[layer] = res.index_keys
        return res.out

    def tail(self) -> TailRows:
        """This rank's tail rows of every layer (after the forward)."""
        r = self.group.rank
        return TailRows(self.plan.row_request[r][self._tail], self.positions[self._tail], tuple(self.window),
                        tuple(self.raw), tuple(self.index_raw), self._ranks)

    def gathered(self) -> GatheredEntries:
        """Every layer's gathered entries (after the forward)."""
        return GatheredEntries(tuple(self.entries), tuple(self.index_keys), dict(self.offsets))


def v4_prefill(group: Group, forward: Callable[..., Any], params: dict, cfg: Any, prompts: Prompts, *,
               prompt_logits: bool = False, hidden_layers: tuple | None = None,
               block_size: int = 16) -> V4PrefillOut:
    """Prefill ``prompts`` with their tokens split over ``group``; run it on every rank of the group.

    forward: the model's forward (``cfg.layout()`` gives the attention state's
    shape); prompt_logits: also return every prompt token's logits, gathered in
    request order; hidden_layers: ask the forward for hidden states, gathered
    likewise; block_size: rows per block of the prefill's scratch rings and
    gathered entries (any value: the decode cache has its own).
    """
    lay = cfg.layout(block_size=block_size)
    cu = prompts.cu_seqlens
    plan = v4_pcp_plan(cu, group.size, lay)
    step = V4PrefillStep(group, plan)
    before = group.stats.total_sent()
    r = group.rank
    mine = pcp_shard(prompts.tokens, plan.pcp, r)  # [T_r]
    idx = plan.pcp.token_index[r]  # [T_r] packed ids of my tokens
    last = torch.tensor(cu[1:]) - 1  # [B] each request's last prompt token
    rows_end, reqs = (idx[:, None] == last[None, :]).nonzero(as_tuple=True)
    extra = {} if hidden_layers is None else {"hidden_layers": tuple(hidden_layers)}
    out = forward(params, cfg, mine, step, logits_index=None if prompt_logits else rows_end, **extra)
    logits, hidden = out if hidden_layers is not None else (out, None)
    logits = as_logits(logits)
    full = None
    if prompt_logits:
        full = gather_unshard(group, logits, plan.pcp)  # [T, V]
        first = full[last]
    else:
        first = torch.zeros(prompts.num_requests, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        first = group.all_reduce(first.index_copy(0, reqs, logits))  # each request's row comes from one rank
    if hidden is not None:
        hidden = {name: gather_unshard(group, h, plan.pcp) for name, h in hidden.items()}
    return V4PrefillOut(plan.pcp, first, full, hidden, step.tail(), step.gathered(), tuple(prompts.prompt_lens),
                        group.stats.total_sent() - before)
