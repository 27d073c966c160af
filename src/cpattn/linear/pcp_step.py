"""The linear layers' step of a PCP prefill: :func:`pcp_causal_conv1d` and :func:`pcp_gated_delta` per layer.

The counterpart of :class:`cpattn.engine.prefill_steps.PCPStep` (the
attention layers) for a hybrid model's linear layers: the same local tokens
(with :meth:`ScanLayout.head_tail` they are the attention layout's ``[A | B]``
parts, ``parts_cu = (plan.cu_a[r], plan.cu_b[r])``), each layer's conv and
recurrent state continued from a :class:`~cpattn.linear.state.RecurrentCache`
(zeros, or the states of an earlier chunk of a chunked prefill). After the
forward, :meth:`PCPLinearStep.finish` holds every request's states after all
its new tokens -- the same on every rank, so a decode rank can take them
from any prefill rank.

Example
-------
>>> import torch, cpattn
>>> from cpattn.linear import ScanLayout, scan_shard
>>> from cpattn.linear.state import RecurrentCache
>>> def rank(group):
...     lay = ScanLayout.contiguous(group.size)
...     idx, parts = scan_shard([0, 5], lay, group.rank)
...     cache = RecurrentCache.empty(1, batch=1, conv_channels=2, kernel=4, heads=1, k_dim=2, v_dim=2)
...     step = PCPLinearStep(group, lay, parts, cache)
...     step.conv(0, torch.ones(5, 2)[idx], torch.ones(2, 4))
...     return step.finish().conv[0].shape
>>> cpattn.simulate(2, rank)
[torch.Size([1, 3, 2]), torch.Size([1, 3, 2])]
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cpattn.comm.group import Group
from cpattn.linear.layout import ScanLayout
from cpattn.linear.scan import pcp_causal_conv1d, pcp_gated_delta
from cpattn.linear.state import RecurrentCache


class PCPLinearStep:
    """``conv`` / ``delta`` of this rank's local tokens over ``group`` (see the module doc)."""

    def __init__(self, group: Group, layout: ScanLayout, parts_cu: list[torch.Tensor], cache: RecurrentCache):
        self.group, self.layout, self.parts_cu, self.cache = group, layout, list(parts_cu), cache
        self._conv, self._state = list(cache.conv), list(cache.state)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y, self._conv[layer] = pcp_causal_conv1d(self.group, self.layout, x, weight, bias, self.parts_cu,
                                                 self._conv[layer], silu=True)
        return y

    def delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float) -> torch.Tensor:
        o, self._state[layer] = pcp_gated_delta(self.group, self.layout, q, k, v, g, beta, self.parts_cu,
                                                self._state[layer], scale=scale)
        return o

    def finish(self) -> RecurrentCache:
        """Every request's states after all of its new tokens (equal on all ranks)."""
        return replace(self.cache, conv=tuple(self._conv), state=tuple(self._state))
