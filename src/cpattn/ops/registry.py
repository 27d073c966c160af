"""One op registry: every cpattn kernel is defined once, implemented per device.

An op is declared with :func:`define` (a ``torch.library`` custom op in the
``cpattn`` namespace whose default body raises :class:`NoKernelError`), gets a
fake (meta) implementation with :func:`fake`, and one kernel per device type
with :func:`kernel`. Eager calls and captured graphs (torch.compile, CUDA
graphs, NPU graphs) dispatch through the very same ``torch.ops.cpattn.*``
entries, so the eager fallback is never a second implementation.

Example
-------
>>> import torch
>>> from cpattn.ops import registry
>>> sorted(registry.kernels("attention_with_lse"))  # doctest: +SKIP
['cpu']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "cpattn"

# op name -> device type -> kernel function (kept for error messages and docs)
_KERNELS: dict[str, dict[str, Callable]] = {}
_OPS: dict[str, Any] = {}


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
        _OPS[name] = op
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
        _KERNELS[name][device_type] = fn
        return fn

    return wrap


def generic(name: str) -> None:
    """Mark op ``name`` as device-generic: its default body is plain torch code."""
    _KERNELS[name]["any"] = _OPS[name]


def kernels(name: str) -> dict[str, Callable]:
    """The device types (and functions) registered for op ``name``."""
    if name not in _KERNELS:
        raise KeyError(f"no cpattn op named {name!r}; defined ops: {sorted(_KERNELS)}")
    return dict(_KERNELS[name])


def ops() -> list[str]:
    """Names of every defined cpattn op."""
    return sorted(_OPS)
