"""The dtypes of a run: the one a model runs in (:func:`param_dtype`), and the one its logits leave it in:
float32, or float64 for a float64 run.

A float64 run is the engine's exactness oracle (DESIGN.md §5): casting its
logits to float32 would round two float64 paths that differ in their last
bits (a prefix path sums in another order) to float32 values one ulp apart,
and every comparison after the cast would then test float32 rounding, not
the engine.

>>> as_logits(torch.zeros(2, dtype=torch.bfloat16)).dtype, as_logits(torch.zeros(2, dtype=torch.float64)).dtype
(torch.float32, torch.float64)
"""

from __future__ import annotations

import torch

from cpattn.ops.ref import acc_dtype


def as_logits(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., V] in the logits dtype (:func:`~cpattn.ops.ref.acc_dtype`): float64 stays, else float32."""
    return x.to(acc_dtype(x))


def forward_logits(forward, params: dict, cfg, tokens: torch.Tensor, *attn, hidden_layers: tuple | None = None):
    """A decode step's tail: ``forward(params, cfg, tokens, *attn)`` (a family's forward; ``attn``: its step
    object(s)) -> (logits [T, V] in the logits dtype, argmax [T]), plus the hidden states ``{name: [T, H]}``
    as a third output with ``hidden_layers`` (passed on to ``forward``).

    >>> fwd = lambda params, cfg, tokens, attn, hidden_layers=None: (
    ...     torch.eye(3)[tokens] if hidden_layers is None else (torch.eye(3)[tokens], {"norm": tokens}))
    >>> logits, top = forward_logits(fwd, {}, None, torch.tensor([2, 0]), None)
    >>> logits.dtype, top.tolist(), forward_logits(fwd, {}, None, torch.tensor([1]), None, hidden_layers=("norm",))[2]
    (torch.float32, [2, 0], {'norm': tensor([1])})
    """
    if hidden_layers is None:
        logits = as_logits(forward(params, cfg, tokens, *attn))
        return logits, logits.argmax(-1)
    logits, hidden = forward(params, cfg, tokens, *attn, hidden_layers=hidden_layers)
    logits = as_logits(logits)
    return logits, logits.argmax(-1), hidden


def param_dtype(params: dict) -> torch.dtype:
    """The dtype a model runs in (and its KV cache is kept in): the floating dtype holding most of its
    parameter elements -- a DeepSeek router kept in float32 beside bfloat16 weights does not count.

    >>> param_dtype({"router": torch.zeros(4, dtype=torch.float32), "w": torch.zeros(8, dtype=torch.bfloat16)})
    torch.bfloat16
    """
    counts: dict[torch.dtype, int] = {}
    for t in params.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    if not counts:
        raise ValueError("params hold no floating-point tensor; pass the model's weights")
    return max(counts, key=counts.get)


__all__ = ["acc_dtype", "as_logits", "forward_logits", "param_dtype"]
