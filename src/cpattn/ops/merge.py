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

from cpattn.ops import checks, ref, registry


@registry.define("merge_attn_states")
def _merge_op(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.merge(outs, lses)


registry.generic("merge_attn_states")


@registry.fake("merge_attn_states")
def _merge_fake(outs, lses):
    lse_dtype = ref.acc_dtype(outs, lses)
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
    lses: [N, T, H] (or N tensors [T, H]) -- their natural-log LSEs.

    Returns
    -------
    out: [T, H, D] in outs' dtype; lse: [T, H] float32 (float64 for float64
    input). Rows where every partial is empty give out 0, lse -inf.

    Empty partials and NaN
    ----------------------
    Only an LSE of exactly -inf marks an empty partial ``(0, -inf)``, which
    the kernels produce for a row with no visible key; its output is
    ignored, whatever it holds. A NaN (or +inf) LSE, or a NaN in the output
    of a partial that is not empty, is data: that row's result is NaN, just
    as it is on one device where the row sees the same keys. A weight that
    underflows to 0 does not hide it (0 * NaN = NaN). See docs/exactness.md.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops import merge_attn_states
    >>> o = torch.randn(2, 3, 4, 8); l = torch.randn(2, 3, 4)
    >>> out, lse = merge_attn_states(o, l)
    >>> torch.allclose(lse, torch.logsumexp(l, 0))
    True
    """
    outs = outs if isinstance(outs, torch.Tensor) else list(outs)
    lses = lses if isinstance(lses, torch.Tensor) else list(lses)
    named = {**_named("outs", outs), **_named("lses", lses)}  # torch.stack would not name a stray device
    if named:
        first = next(iter(named))
        checks.same_device(first, named[first], **named)
    if not isinstance(outs, torch.Tensor):
        outs = torch.stack(outs)
    if not isinstance(lses, torch.Tensor):
        lses = torch.stack(lses)
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[:3] != lses.shape:
        raise ValueError(
            f"merge_attn_states wants outs [N, T, H, D] and lses [N, T, H]; got "
            f"{tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    if outs.shape[0] == 0:
        raise ValueError("merge_attn_states needs at least one partial (N >= 1); got N = 0")
    return registry.call("merge_attn_states", outs, lses)


def _named(name: str, xs: torch.Tensor | list) -> dict[str, torch.Tensor]:
    """``{name: xs}`` for a tensor, ``{"name[i]": xs[i]}`` for a list (its tensors only)."""
    if isinstance(xs, torch.Tensor):
        return {name: xs}
    return {f"{name}[{i}]": x for i, x in enumerate(xs) if isinstance(x, torch.Tensor)}


def _merge_into_body(out_acc, lse_acc, out, lse, maybe_empty: bool) -> None:
    # two-way update, in place: L = logaddexp(L_acc, L_new); O = O_acc + w_new (O_new - O_acc), w_new = the new
    # partial's share (lerp: one pass over O_acc, no temporary). Only lse == -inf is an empty partial; NaN
    # propagates (torch.maximum keeps it; 0 * NaN is NaN). ``maybe_empty``: some row of the new partial may be
    # empty, so its output (possibly garbage) is replaced by 0 first -- a full-size temporary.
    inf = float("inf")
    l_new = lse.to(lse_acc.dtype)
    m = torch.maximum(lse_acc, l_new)
    m = torch.where(m == -inf, 0.0, m)
    a, b = torch.exp(lse_acc - m), torch.exp(l_new - m)  # [T, H]
    total = a + b
    empty = (lse_acc == -inf) & (l_new == -inf)
    if maybe_empty:
        out = torch.where((l_new == -inf)[..., None], 0.0, out)  # an empty partial may hold garbage
    out_acc.lerp_(out.to(out_acc.dtype), (b / torch.where(empty, 1.0, total))[..., None])
    lse_acc.copy_(torch.where(empty, -inf, m + torch.log(total)))


@registry.define("merge_into", mutates_args=("out_acc", "lse_acc"))
def _merge_into_op(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    _merge_into_body(out_acc, lse_acc, out, lse, True)  # sync-free: the traced and device-generic body


@registry.kernel("merge_into", "cpu")
def _merge_into_cpu(out_acc, lse_acc, out, lse) -> None:
    # eager CPU: look first (a host check costs nothing here), and skip the temporary -- a fresh 32 MB buffer
    # costs more in page faults than the merge itself -- when no row of the new partial is empty
    _merge_into_body(out_acc, lse_acc, out, lse, bool(torch.isneginf(lse).any()))


registry.generic("merge_into")


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one more partial ``(out, lse)`` into an accumulator, in place.

    Arguments
    ---------
    out_acc: [T, H, D] float32/float64 accumulator, updated in place.
    lse_acc: [T, H] its LSE (same dtype), updated in place; start from
        ``(0, -inf)`` for an empty accumulator.
    out: [T, H, D] (any float dtype); lse: [T, H] -- the new partial.

    The two-way special case of :func:`merge_attn_states`, with no stacking
    and one pass over ``out_acc`` (``lerp_``): the running merge of ring
    attention.
    Same rule: lse -inf is an empty partial (its out is ignored); NaN is
    data and propagates. Rows of the accumulator with lse -inf must hold
    out 0 (how it starts, and what every kernel returns for such rows).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.merge import merge_into
    >>> acc, acc_lse = torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf"))
    >>> o, l = torch.randn(3, 2, 4), torch.randn(3, 2)
    >>> merge_into(acc, acc_lse, o, l)
    >>> torch.equal(acc_lse, l)
    True
    """
    if out_acc.shape != out.shape or lse_acc.shape != lse.shape or out_acc.shape[:2] != lse_acc.shape:
        raise ValueError(
            f"merge_into wants out_acc/out [T, H, D] and lse_acc/lse [T, H] of equal shapes; got "
            f"{tuple(out_acc.shape)}, {tuple(lse_acc.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}"
        )
    checks.same_device("out_acc", out_acc, lse_acc=lse_acc, out=out, lse=lse)
    if out_acc.dtype not in (torch.float32, torch.float64) or lse_acc.dtype != out_acc.dtype:
        raise ValueError(
            f"merge_into accumulates in float32 or float64 (out_acc and lse_acc alike); got "
            f"{out_acc.dtype} and {lse_acc.dtype}"
        )
    registry.call("merge_into", out_acc, lse_acc, out, lse)
