"""One op registry: every cpattn kernel is defined once, implemented per device.

An op is declared with :func:`define` (a ``torch.library`` custom op in the
``cpattn`` namespace whose default body raises :class:`NoKernelError`), gets a
fake (meta) implementation with :func:`fake`, and one kernel per device type
with :func:`kernel`. Eager calls and captured graphs (torch.compile, CUDA
graphs, NPU graphs) dispatch through the very same ``torch.ops.cpattn.*``
entries, so the eager fallback is never a second implementation.

A custom op is one opaque call to torch.compile: its kernel runs eagerly,
op by op, at every replay. An op may therefore also register a
:func:`decomposition`: plain torch code, without host syncs, that computes
the same result. While torch.compile traces (and only then, only on the
device types it names, only where its ``when`` holds) :func:`call` inlines
it, so inductor fuses it with the code around it. It is the op's own math
in traceable form, tested against the same oracle as the kernel; eager
code, CUDA graphs and NPU graphs keep calling the op.

Example
-------
>>> import torch
>>> from cpattn.ops import registry
>>> sorted(registry.kernels("attention_with_lse"))  # doctest: +SKIP
['cpu']
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "cpattn"

# op name -> device type -> kernel function (kept for error messages and docs)
_KERNELS: dict[str, dict[str, Callable]] = {}
_OPS: dict[str, Any] = {}
_BODIES: dict[str, Callable] = {}  # op name -> the Python function it was defined from
# op name -> (function, device types, condition on the arguments or None)
_DECOMPOSITIONS: dict[str, tuple[Callable, tuple[str, ...], Callable[..., bool] | None]] = {}


def _eager_until_dynamo(op: Any, device_type: str | None) -> None:
    """Call op's ``device_type`` kernel directly until torch._dynamo is imported.

    ``torch.library.custom_op`` wraps each kernel in ``torch._disable_dynamo``,
    which imports torch._dynamo (about 2 s) on its first call, in every process,
    even one that never compiles. That wrapper only clears dynamo's frame
    callback, and nothing can set that callback before torch._dynamo is
    imported (torch.compile imports it first). So until then the plain kernel
    is the same call; from then on every call goes through torch's wrapper,
    exactly as before.
    """
    wrapped = op._backend_fns.get(device_type)
    plain = getattr(wrapped, "__wrapped__", None)
    if plain is None:  # torch changed its wrapper: keep it as it is
        return

    def backend(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            return wrapped(*args, **kwargs)
        return plain(*args, **kwargs)

    op._backend_fns[device_type] = backend


class NoKernelError(NotImplementedError):
    """Raised when an op is called on a device type that has no kernel."""


def no_kernel(name: str, *tensors: torch.Tensor) -> NoKernelError:
    """Build the error for calling op ``name`` on a device without a kernel."""
    devices = sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)})
    have = sorted(_KERNELS.get(name, {}))
    hint = ""
    if "npu" in devices or "privateuseone" in devices:
        hint = " For Ascend NPUs call cpattn.ops.enable_npu() after installing torch_npu."
    return NoKernelError(
        f"{NAMESPACE}::{name} has no kernel for device type {devices or ['?']}; "
        f"kernels are registered for {have}. Move the tensors to one of those "
        f"devices or register a kernel with cpattn.ops.registry.kernel().{hint}"
    )


def define(name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Decorator: define ``cpattn::name`` from a typed Python signature.

    The decorated function's body is the default implementation, used for
    any device type without its own kernel; it should raise
    ``no_kernel(name, ...)`` unless the op is device-generic torch code.
    """

    def wrap(fn: Callable) -> Any:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)(fn)
        _eager_until_dynamo(op, None)
        _OPS[name] = op
        _BODIES[name] = fn
        _KERNELS.setdefault(name, {})
        return op

    return wrap


def fake(name: str) -> Callable:
    """Decorator: the fake (meta) implementation of op ``name``."""

    def wrap(fn: Callable) -> Callable:
        _OPS[name].register_fake(fn)
        return fn

    return wrap


def kernel(name: str, device_type: str) -> Callable:
    """Decorator: the kernel of op ``name`` for ``device_type`` ("cpu", "cuda", "npu")."""

    def wrap(fn: Callable) -> Callable:
        _OPS[name].register_kernel(device_type)(fn)
        _eager_until_dynamo(_OPS[name], device_type)
        _KERNELS[name][device_type] = fn
        return fn

    return wrap


def generic(name: str) -> None:
    """Mark op ``name`` as device-generic: its default body is plain torch code.

    That body must then be free of host syncs; it also serves as the op's
    CPU :func:`decomposition`.
    """
    _KERNELS[name]["any"] = _OPS[name]
    decomposition(name)(_BODIES[name])


def decomposition(
    name: str, *, devices: tuple[str, ...] = ("cpu",), when: Callable[..., bool] | None = None
) -> Callable:
    """Decorator: a traceable body of op ``name`` that torch.compile inlines on ``devices``.

    ``fn`` takes the op's arguments and returns what the op returns; it must
    not sync to the host or allocate by data. ``when(*args)`` (static facts
    only: shapes, dtypes) says where it applies; elsewhere the op is called.

    Example
    -------
    >>> # in cpattn.ops.paged: small batches trace the batched path at the table's full width
    >>> # @registry.decomposition("paged_attention_with_lse", when=_traceable)
    >>> # def _paged_traced(q, k_cache, v_cache, block_table, req_indices, kv_lens, softmax_scale): ...
    >>> import cpattn.ops
    >>> decompositions()["paged_attention_with_lse"]
    ('cpu',)
    """

    def wrap(fn: Callable) -> Callable:
        if name not in _OPS:
            raise KeyError(f"no cpattn op named {name!r}; define it before its decomposition")
        _DECOMPOSITIONS[name] = (fn, tuple(devices), when)
        return fn

    return wrap


def call(name: str, *args: Any) -> Any:
    """Run op ``name`` on ``args`` (positional, as the op's schema orders them).

    Under torch.compile, a registered :func:`decomposition` for the first
    tensor argument's device type is traced instead of the opaque op.

    Example
    -------
    >>> import torch
    >>> import cpattn.ops
    >>> o, l = call("merge_attn_states", torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1))
    >>> round(l.item(), 4)
    0.6931
    """
    if torch.compiler.is_compiling() and name in _DECOMPOSITIONS:
        fn, devices, when = _DECOMPOSITIONS[name]
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if device in devices and (when is None or when(*args)):
            return fn(*args)
    return _OPS[name](*args)


def decompositions() -> dict[str, tuple[str, ...]]:
    """Op name -> device types with a registered :func:`decomposition`.

    Example
    -------
    >>> import cpattn.ops
    >>> {"merge_attn_states", "merge_into", "paged_attention_with_lse", "write_kv"} <= set(decompositions())
    True
    """
    return {name: devices for name, (_, devices, _) in _DECOMPOSITIONS.items()}


def kernels(name: str) -> dict[str, Callable]:
    """The device types (and functions) registered for op ``name``."""
    if name not in _KERNELS:
        raise KeyError(f"no cpattn op named {name!r}; defined ops: {sorted(_KERNELS)}")
    return dict(_KERNELS[name])


def ops() -> list[str]:
    """Names of every defined cpattn op."""
    return sorted(_OPS)
