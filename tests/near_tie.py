"""Greedy choices compared up to near ties (DESIGN.md §5): one definition for every test that needs it.

Random-init tiny models can have near-tied logits, where a last-bit difference between two correct runs
(another summation order, a padded batch, another CPU's float kernels) flips the greedy token. A float32
or bfloat16 run's tokens are therefore compared up to such flips:

- :func:`check_tokens` (one request's greedy sequence): logits within ``rel`` up to the first differing
  step; there the reference's top-2 margin must be at most twice the measured logit error, the flip is
  recorded in ``flips``, and later steps are not compared (their contexts differ);
- :func:`check_choices` (independent rows of one step, e.g. each request's next token): every differing
  row must be such a near tie, each recorded.

Each test file keeps its ``flips`` list and asserts at its end that they stay rare. A float64 run needs no
allowance: compare its tokens with ``torch.equal``.
"""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the best and the second-best logit of one row [V]."""
    top = logits.double().topk(2).values
    return float(top[0] - top[1])


def check_tokens(ours, our_logits, ref, ref_logits, what: str, flips: list, *, rel: float = 1e-4) -> int:
    """Equal tokens, or a first difference where the reference had a near tie (recorded in ``flips``).

    ours, ref: one request's tokens [N] (tensors or lists); our_logits, ref_logits: [N, V], row i the
    logits token i was chosen from. Returns how many steps were compared.
    """
    ours, ref = torch.as_tensor(ours), torch.as_tensor(ref)
    assert ours.shape == ref.shape, f"{what}: {ours.shape[0]} tokens, reference {ref.shape[0]}"
    diff = (ours != ref).nonzero()
    n = ref.numel() if diff.numel() == 0 else int(diff[0]) + 1
    err = float((our_logits[:n].double() - ref_logits[:n].double()).abs().max())
    assert rel_err(our_logits[:n], ref_logits[:n]) <= rel, f"{what}: decode logits off by {err:.2e}"
    if diff.numel():  # after a flip the contexts differ, so later tokens cannot be compared
        i = n - 1
        err = float((our_logits[i].double() - ref_logits[i].double()).abs().max())  # at the flipped step itself
        flips.append((what, i))
        margin = top2_margin(ref_logits[i])
        assert margin <= 2 * err, (
            f"{what}: token {i} is {int(ours[i])}, reference {int(ref[i])}, with a top-2 margin {margin:.2e} "
            f"above twice the logit error {err:.2e}: a real mismatch, not a near tie"
        )
    return n


def check_choices(ours, our_logits, ref, ref_logits, what: str, flips: list, *, rel: float = 1e-4) -> None:
    """Each row's choice equal, or a near tie of the reference there (recorded in ``flips``).

    ours, ref: [R] the argmax of our_logits, ref_logits [R, V] (rows independent of each other).
    """
    assert rel_err(our_logits, ref_logits) <= rel, f"{what}: logits off by {rel_err(our_logits, ref_logits):.2e}"
    for i in (ours != ref).nonzero().flatten().tolist():
        err = float((our_logits[i].double() - ref_logits[i].double()).abs().max())
        flips.append((what, i))
        margin = top2_margin(ref_logits[i])
        assert margin <= 2 * err, (
            f"{what}: row {i} chose {int(ours[i])}, reference {int(ref[i])}, with a top-2 margin {margin:.2e} "
            f"above twice the logit error {err:.2e}: a real mismatch, not a near tie"
        )
