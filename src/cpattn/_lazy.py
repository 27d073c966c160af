"""Lazy package exports (PEP 562): a package's public names imported from their modules on first use, so
importing the package (and the CLIs' parsers) stays torch-free (any layer may use it).

>>> getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"}, namespace := {})
>>> getattr_("sqrt")(4.0), "sqrt" in namespace, dir_()
(2.0, True, ['sqrt'])
>>> getattr_("nope")
Traceback (most recent call last):
...
AttributeError: module 'pkg' has no attribute 'nope'
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: name -> the module ``exports[name]`` it is read from;
    a name read once is cached in ``namespace`` (the package's ``globals()``), so later lookups skip the
    hook."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
