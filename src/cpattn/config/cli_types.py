"""The command line's parse-time values: argparse types, the one-line usage error, graph backends.

A bad value ends a command the same way everywhere: ONE line on stderr naming the
flag, the value and the rule, exit status 2 (:func:`usage_error`, :func:`bad_value`).
Torch-free, like every parser module (:mod:`cpattn.config.cli_args` re-exports
these names, its flags' one vocabulary).

>>> positive_int("3"), dtype_name("bf16"), int_list("4,2")
(3, 'bfloat16', (4, 2))
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import NoReturn

# every accepted dtype spelling -> the canonical name (a key of cpattn.bench.common.DTYPES)
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}

# graph backends a command line can name (cpattn.graphs.backends.backends(); a test keeps the two equal)
GRAPH_BACKENDS = ("aot_eager", "auto", "cpu", "cuda", "eager", "inductor", "npu", "torchair")


def usage_error(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` as one line on stderr and exit with status 2."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def bad_value(prog: str, flag: str, value: object, rule: str, fix: str) -> NoReturn:
    """A usage error naming the flag, the value seen, the rule and a fix (one line, exit 2)."""
    usage_error(prog, f"argument {flag}: saw {value}; rule: {rule}; fix: {fix}")


# ----------------------------------------------------------------------------- parse-time types
def _int(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: {what}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1.

    >>> positive_int("3")
    3
    """
    return _int(text, 1, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0.

    >>> nonnegative_int("0")
    0
    """
    return _int(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0.

    >>> positive_float("2.5")
    2.5
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a number > 0")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 1..65535 (``cpattn serve``'s and ``cpattn pool serve``'s ``--port``).

    >>> port("8000")
    8000
    """
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a TCP port in 1..65535")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1.

    >>> int_list("4096,1000,37")
    (4096, 1000, 37)
    """
    parts = [p.strip() for p in text.split(",")]
    rule = "comma-separated integers >= 1"
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: {rule}") from None
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: {rule} ({bad[0]} is not)")
    return values


def dtype_name(text: str) -> str:
    """argparse type: a dtype spelling -> its canonical name (``bf16`` -> ``bfloat16``).

    >>> dtype_name("bf16"), dtype_name("FP32")
    ('bfloat16', 'float32')
    """
    name = DTYPE_ALIASES.get(text.strip().lower().removeprefix("torch."))
    if name is None:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: one of {', '.join(DTYPE_ALIASES)}")
    return name


def backend_unavailable(name: str) -> str | None:
    """Why graph backend ``name`` cannot run on this machine (None: it can, as far as can be seen without
    running it). ``cuda`` imports torch to ask ``torch.cuda.is_available()``; the others stay torch-free.

    >>> backend_unavailable("cpu") is None
    True
    """
    if name == "cuda":
        build = _torch_build()
        if build.endswith("+cpu"):  # certain without importing torch
            return f"a CUDA GPU and a CUDA build of torch, and this torch is {build}, a CPU-only build"
        import torch

        if not torch.cuda.is_available():
            why = "a CPU-only torch build" if torch.version.cuda is None else "no CUDA device visible"
            return f"a CUDA GPU, and torch.cuda.is_available() is False here ({why})"
    if name in ("npu", "torchair") and importlib.util.find_spec("torch_npu") is None:
        return "torch_npu (Ascend's PyTorch adapter), which is not installed here"
    return None


def _torch_build() -> str:
    """torch's installed version (``2.13.0+cpu`` for a CPU-only wheel), read from its metadata, not by importing it."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def check_backend(prog: str, flag: str, name: str) -> None:
    """A usage error (one line, exit 2) unless ``name`` is a graph backend this machine can run.

    >>> check_backend("cpattn x", "--backend", "eager")
    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     try:
    ...         check_backend("cpattn x", "--backend", "gpu")
    ...     except SystemExit as e:
    ...         print(e.code)
    2
    >>> print(err.getvalue().strip())  # doctest: +NORMALIZE_WHITESPACE
    cpattn x: error: argument --backend: saw 'gpu'; rule: one of aot_eager, auto, cpu, cuda, eager, inductor, npu,
    torchair; fix: pick one of them (cpu = torch.compile inductor, eager = no compiler)
    """
    if name not in GRAPH_BACKENDS:
        bad_value(prog, flag, repr(name), f"one of {', '.join(GRAPH_BACKENDS)}",
                  "pick one of them (cpu = torch.compile inductor, eager = no compiler)")
    why = backend_unavailable(name)
    if why is not None:
        bad_value(prog, flag, repr(name), f"backend {name!r} needs {why}",
                  f"use {flag} cpu (torch.compile inductor) or {flag} eager on this machine")
