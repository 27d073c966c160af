"""``merge_attn_states``: exact n-way merge of partial attention by LSE.

Partials ``(O_i, L_i)`` over disjoint key sets combine as
``L = logsumexp_i L_i`` and ``O = sum_i exp(L_i - L) O_i`` (DESIGN.md §4.1),
computed in float32 with the maximum subtracted first, so LSE gaps of
hundreds neither overflow nor underflow into NaN. The op is plain torch
code, so one device-generic body serves CPU, CUDA and NPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpattn.ops import ref, registry


@registry.define("merge_attn_states")
def _merge_op(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.merge(outs, lses)


registry.generic("merge_attn_states")


@registry.fake("merge_attn_states")
def _merge_fake(outs, lses):
    lse_dtype = torch.float64 if torch.float64 in (outs.dtype, lses.dtype) else torch.float32
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:], dtype=lse_dtype)


def merge_attn_states(
    outs: torch.Tensor | Sequence[torch.Tensor], lses: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention results computed over disjoint key sets.

    Arguments
    ---------
    outs: [N, T, H, D] (or a sequence of N tensors [T, H, D]) -- partial outputs,
        each normalised over its own keys. Keep them in float32 when you can:
        rounding partials to bf16 is where merge error comes from.
    lses: [N, T, H] (or N tensors [T, H]) -- their natural-log LSEs. NaN and
        +inf count as -inf (an empty partial).

    Returns
    -------
    out: [T, H, D] in outs' dtype; lse: [T, H] float32 (float64 for float64
    input). Rows where every partial is empty give out 0, lse -inf.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops import merge_attn_states
    >>> o = torch.randn(2, 3, 4, 8); l = torch.randn(2, 3, 4)
    >>> out, lse = merge_attn_states(o, l)
    >>> torch.allclose(lse, torch.logsumexp(l, 0))
    True
    """
    if not isinstance(outs, torch.Tensor):
        outs = torch.stack(list(outs))
    if not isinstance(lses, torch.Tensor):
        lses = torch.stack(list(lses))
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[:3] != lses.shape:
        raise ValueError(
            f"merge_attn_states wants outs [N, T, H, D] and lses [N, T, H]; got "
            f"{tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    if outs.shape[0] == 0:
        raise ValueError("merge_attn_states needs at least one partial (N >= 1); got N = 0")
    return torch.ops.cpattn.merge_attn_states(outs, lses)
