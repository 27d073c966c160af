"""Per-request recurrent and conv states of the linear layers on one device, and the step a model calls.

A hybrid model's linear layer j (counting linear layers only) calls, on the
step object it is given (the counterpart of the attention step,
:class:`cpattn.models.common.Attention`):

- ``lin.conv(j, x, weight, bias) -> y``: the causal conv of this step's
  packed tokens x [T, C] (SiLU after), continuing each request's conv state;
- ``lin.delta(j, q, k, v, g, beta, scale) -> o``: the gated delta rule
  (q/k L2-normalised), continuing each request's recurrent state.

:class:`RecurrentCache` holds, per linear layer, ``conv[j]`` [B, K-1, C]
(the activations' dtype) and ``state[j]`` [B, Hv, Dk, Dv] (float32, float64
for float64 models). :meth:`RecurrentCache.step` plans one step;
:class:`RecurrentStep` runs the chunked op (prefill, chunked prefill) or, when
every request brings one token, the recurrent op (decode), and
:meth:`RecurrentStep.finish` returns the cache with the new states. The
states are small and fixed-size: nothing grows with the context.

Example
-------
>>> import torch
>>> cache = RecurrentCache.empty(1, batch=2, conv_channels=6, kernel=4, heads=1, k_dim=2, v_dim=2)
>>> step = cache.step([3, 1])
>>> step.conv(0, torch.randn(4, 6), torch.randn(6, 4)).shape
torch.Size([4, 6])
>>> step.finish().conv[0].shape
torch.Size([2, 3, 6])
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpattn.layout.rows import cu_seqlens
from cpattn.ops import gated_delta as gd
from cpattn.ops.ref import acc_dtype


@dataclass(frozen=True)
class RecurrentCache:
    """Per linear layer j: ``conv[j]`` [B, K-1, C] and ``state[j]`` [B, Hv, Dk, Dv] (see module doc)."""

    conv: tuple[torch.Tensor, ...]
    state: tuple[torch.Tensor, ...]

    @classmethod
    def empty(cls, num_layers: int, *, batch: int, conv_channels: int, kernel: int, heads: int, k_dim: int,
              v_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> RecurrentCache:
        """Zero states (a fresh request starts from zero conv inputs and a zero state)."""
        conv = tuple(torch.zeros(batch, kernel - 1, conv_channels, dtype=dtype, device=device)
                     for _ in range(num_layers))
        state = tuple(torch.zeros(batch, heads, k_dim, v_dim, dtype=acc_dtype(dtype), device=device)
                      for _ in range(num_layers))
        return cls(conv, state)

    def step(self, new_lens: list[int]) -> RecurrentStep:
        """Plan one forward step that brings ``new_lens[b]`` tokens to request b."""
        batch = self.conv[0].shape[0] if self.conv else len(new_lens)
        if len(new_lens) != batch:
            raise ValueError(f"new_lens has {len(new_lens)} entries for a recurrent cache of {batch} requests")
        return RecurrentStep(self, tuple(int(n) for n in new_lens))

    def state_bytes(self) -> int:
        """Bytes of all states (they do not grow with the context)."""
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.state))


class RecurrentStep:
    """One step on a :class:`RecurrentCache`: the ``conv`` / ``delta`` calls of a hybrid model's linear layers."""

    def __init__(self, cache: RecurrentCache, new_lens: tuple[int, ...]):
        self.cache, self.new_lens = cache, new_lens
        device = cache.conv[0].device if cache.conv else "cpu"
        self.cu_seqlens = torch.tensor(cu_seqlens(new_lens), dtype=torch.int32, device=device)
        self.decode = len(new_lens) > 0 and all(n == 1 for n in new_lens)
        self._conv, self._state = list(cache.conv), list(cache.state)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv + SiLU of x [T, C] (weight [C, K]) from layer ``layer``'s conv state; stores the new one."""
        y, self._conv[layer] = gd.causal_conv1d(x, weight, bias, self.cu_seqlens, self._conv[layer], silu=True)
        return y

    def delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float) -> torch.Tensor:
        """Gated delta rule of this step's tokens (q/k L2-normalised) from layer ``layer``'s state; stores the
        new one."""
        if self.decode:
            o, self._state[layer] = gd.gated_delta_step(q, k, v, g, beta, self._state[layer], scale=scale)
        else:
            o, self._state[layer] = gd.gated_delta_chunk(q, k, v, g, beta, self.cu_seqlens, self._state[layer],
                                                         scale=scale)
        return o

    def finish(self) -> RecurrentCache:
        """The cache after this step (new state tensors; the old cache is unchanged)."""
        return replace(self.cache, conv=tuple(self._conv), state=tuple(self._state))
