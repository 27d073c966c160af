"""``check_static``: prove on CPU that a decode step can be captured.

A captured step must keep, for a fixed capture size:

- no host sync: no ``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)`` or
  Python ``if`` on tensor values in the step's own code;
- no allocation by data: every shape comes from input shapes, never from
  tensor contents (no ``nonzero``, boolean-mask indexing, ``unique``,
  ``torch.zeros(int(n))``);
- no shape change between replays: the same program serves every batch of
  that size, whatever its lengths and slots.

:func:`check_static` compiles the step with ``torch.compile(fullgraph=True,
dynamic=False)``. Any of the above in the step's code is rejected there:
under ``fullgraph=True`` dynamo traces ``.item()`` and masks as unbacked
symbols, and :class:`~cpattn.graphs.backends.CompileBackend` refuses graphs
that hold them; a Python branch on a tensor value fails to trace. It then
runs the program on further batches of the same shapes with
``error_on_recompile`` set, so a guard on tensor contents or a changed
shape fails too. Registered ``torch.ops.cpattn.*`` ops are opaque to the trace
(their fake impls give the shapes), except where an op has a CPU
decomposition (:func:`cpattn.ops.registry.decomposition`): that is traced
too, so it is checked like the step's own code. A kernel that reads tensors
on the host internally (``attention_with_lse``'s CPU driver calls
``.tolist()``) is fine under torch.compile but not inside a CUDA/NPU graph:
those devices' kernels must be sync-free themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cpattn.graphs.backends import CompileBackend, StaticStepError


def check_static(
    step: Callable[[Any, dict[str, torch.Tensor]], Any],
    state: Any,
    batches: Sequence[dict[str, torch.Tensor]],
    *,
    compiler: str = "aot_eager",
    atol: float = 1e-6,
    rtol: float = 1e-6,
) -> list[Any]:
    """Compile ``step`` once on ``batches[0]`` and replay it on every batch without recompiling.

    Arguments
    ---------
    step: ``step(state, batch) -> outputs`` (a DecodeRunner step).
    state: pytree of tensors (weights, caches). Each run gets a fresh clone,
        so cache writes of one batch never leak into the next.
    batches: >= 1 dicts of tensors with identical shapes and dtypes, ideally
        different contents (lengths, slots, padding rows).
    compiler: dynamo backend; "aot_eager" is torchair's precondition and
        cheap; "inductor" also checks code generation.
    atol, rtol: every element of a compiled output must be within
        ``atol + rtol * max|eager output|`` of eager's (infinities and NaN
        must match). Inductor fuses reductions (a softmax over a row's keys)
        in its own order, so fp32 results differ from eager by a few ulps of
        the output's largest values: the ``rtol`` term keeps the bound at
        that size when outputs exceed 1.

    Returns
    -------
    The compiled outputs, one per batch.

    Raises
    ------
    StaticStepError naming the batch and what broke.

    Example
    -------
    >>> import torch
    >>> def step(state, batch):
    ...     return batch["x"] * state["w"]
    >>> outs = check_static(step, {"w": torch.ones(2)}, [{"x": torch.ones(3, 2)}, {"x": torch.zeros(3, 2)}])
    >>> len(outs)
    2
    """
    if not batches:
        raise ValueError("check_static needs at least one batch")
    backend = CompileBackend(compiler)
    args = (_clone(state), {k: v.clone() for k, v in batches[0].items()})  # the persistent buffers
    outs = []
    for i, batch in enumerate(batches):
        if set(batch) != set(args[1]):
            raise ValueError(f"batches[{i}] has keys {sorted(batch)}; batches[0] had {sorted(args[1])}")
        try:
            if i == 0:
                replay = backend.capture(step, args, size=0)  # compiles and runs once
            _copy_into(pytree.tree_leaves(args[0]), pytree.tree_leaves(state))  # clean caches
            _copy_into([args[1][k] for k in batch], list(batch.values()))
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = replay()
        except StaticStepError:
            raise
        except Exception as e:
            raise StaticStepError(
                f"batch {i}: the step is not capturable ({type(e).__name__}: {e}). Look for .item(), "
                ".tolist(), int()/bool() of a tensor, Python branches on tensor values, nonzero/boolean "
                "masks, or shapes computed from tensor contents, and move that work into the host-side plan"
            ) from e
        if backend.compiles != 1:
            raise StaticStepError(f"batch {i}: the step compiled {backend.compiles} graphs; expected exactly 1")
        want = step(_clone(state), dict(batch))
        for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(want)):
            if a.shape != b.shape or not agree(a, b, atol=atol, rtol=rtol):
                raise StaticStepError(
                    f"batch {i}: compiled and eager outputs differ (shape {tuple(a.shape)}, max abs diff "
                    f"{(a.double() - b.double()).abs().max().item() if a.shape == b.shape else 'n/a'})"
                )
        outs.append(out)
    return outs


def agree(a: torch.Tensor, b: torch.Tensor, *, atol: float = 1e-6, rtol: float = 1e-6) -> bool:
    """True when ``|a - b| <= atol + rtol * max|b|`` elementwise (max over b's finite values); inf/NaN must match.

    Example
    -------
    >>> import torch
    >>> agree(torch.tensor([2.5, 0.1]), torch.tensor([2.5, 0.1 + 2e-6]))  # within 1e-6 + 1e-6 * 2.5
    True
    >>> agree(torch.tensor([0.5]), torch.tensor([0.5 + 2e-6]))
    False
    """
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(a, b, atol=atol + rtol * scale, rtol=0.0, equal_nan=True)


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _copy_into(dst: list, src: list) -> None:
    for d, s in zip(dst, src):
        if not isinstance(d, torch.Tensor):
            continue
        if d.shape != s.shape or d.dtype != s.dtype:
            raise StaticStepError(
                f"every batch must have the shapes and dtypes of batches[0]; got {tuple(s.shape)} {s.dtype} "
                f"where the first had {tuple(d.shape)} {d.dtype}"
            )
        d.copy_(s)
