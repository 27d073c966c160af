"""The command line's shared vocabulary: one spelling of every common flag, one way to fail.

Every ``cpattn`` command builds its parser here, so flags mean the same
thing everywhere and bad input ends the same way: before any rank starts,
with ONE line on stderr naming the flag, the value and the rule, and exit
status 2 (argparse's convention for usage errors). Exit status 1 means the
command ran but a check failed (results differ, a rank failed).

Flags (vLLM's engine-argument names first, short aliases after):

========================================== ======== =======================================
flag                                       alias    meaning
========================================== ======== =======================================
``--tensor-parallel-size``                 ``--tp`` TP ranks (DCP and DSA-CP reuse them)
``--prefill-context-parallel-size``        ``--pcp`` PCP ranks (added to the world)
``--decode-context-parallel-size``         ``--dcp`` DCP ranks (a share of the TP ranks)
``--cp-kv-cache-interleave-size``                   tokens per DCP owner run
``--block-size``                                    tokens per KV-cache block
``--dtype``                                         float32/fp32, bfloat16/bf16, float16/fp16,
                                                    float64/fp64
``--json PATH``                                     results as JSON; ``-``: only JSON on stdout
``--quick``                                         small sizes, a fast run
``--timeout S``                                     stall bound of the ranks (default 120 s)
``--no-progress``                                   no progress output on stderr
``--backend``                                       a graph backend (:func:`check_backend`)
========================================== ======== =======================================

Paths and devices are checked before any work, at parse time where the flag
is declared with :func:`output_file` / :func:`output_file_made` / :func:`output_dir` /
:func:`input_file` / :func:`input_dir` (``--json PATH``: its directory must exist), and a graph
backend by :func:`check_backend` (``cuda`` needs a CUDA GPU, ``npu`` / ``torchair``
need torch_npu): one line, exit 2, before any rank starts.

This module never imports torch (``cpattn.cli`` parses every command line,
and refuses a typo, before ``import torch``); nor may a command's parser.

The number of processes a command starts is always given by the parallel
size those ranks realise (``--pcp`` for PCP prefill, ``--dcp`` for DCP
decode, ``--tp`` for DSA-CP); ``--world-size`` only where the ranks have
no parallel role (``cpattn bench comm``).

Example
-------
>>> p = parser("cpattn toy", "A toy command.")
>>> add_parallel(p, pcp=2, block_size=16)
>>> add_dtype(p)
>>> a = p.parse_args(["--pcp", "4", "--dtype", "bf16"])
>>> a.prefill_context_parallel_size, a.block_size, a.dtype
(4, 16, 'bfloat16')
>>> import contextlib, io
>>> err = io.StringIO()
>>> with contextlib.redirect_stderr(err):
...     try:
...         p.parse_args(["--pcp", "0"])
...     except SystemExit as e:
...         print(e.code)
2
>>> print(err.getvalue().strip())
cpattn toy: error: argument --prefill-context-parallel-size/--pcp: saw '0'; rule: an integer >= 1 (see cpattn toy --help)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from typing import NoReturn

from cpattn.config.cli_paths import (  # noqa: F401 (re-exported: the parsers' one vocabulary)
    input_dir, input_file, json_output, output_dir, output_file, output_file_made,
)

TIMEOUT_S = 120.0  # default stall bound of every command that starts ranks

# every accepted dtype spelling -> the canonical name (a key of cpattn.bench.common.DTYPES)
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}

# (flags, dest, help) of the parallel and cache sizes, by the keyword add_parallel takes
PARALLEL = {
    "tp": (("--tensor-parallel-size", "--tp"), "tensor_parallel_size", "tensor-parallel ranks"),
    "pcp": (("--prefill-context-parallel-size", "--pcp"), "prefill_context_parallel_size",
            "prefill context-parallel ranks (PCP adds ranks: one gloo process each here)"),
    "dcp": (("--decode-context-parallel-size", "--dcp"), "decode_context_parallel_size",
            "decode context-parallel ranks (DCP reuses the TP ranks)"),
    "interleave": (("--cp-kv-cache-interleave-size",), "cp_kv_cache_interleave_size",
                   "tokens per DCP owner run: token t lives on DCP rank (t // size) %% dcp"),
    "block_size": (("--block-size",), "block_size", "tokens per KV-cache block"),
}

# graph backends a command line can name (cpattn.graphs.backends.backends(); a test keeps the two equal)
GRAPH_BACKENDS = ("aot_eager", "auto", "cpu", "cuda", "eager", "inductor", "npu", "torchair")

# model types of the embedded tiny models (cpattn.models.family.FAMILY_MODULES; a test keeps the two equal)
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "qwen3", "qwen3_5",
               "qwen3_5_moe", "qwen3_moe", "qwen3_next")

# config field -> the flag a user types, for problems reported by cpattn.config
FLAG_OF_FIELD = {
    "tp_size": "--tensor-parallel-size/--tp",
    "pcp_size": "--prefill-context-parallel-size/--pcp",
    "dcp_size": "--decode-context-parallel-size/--dcp",
    "cp_kv_cache_interleave_size": "--cp-kv-cache-interleave-size",
    "block_size": "--block-size",
    "num_attention_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "capture_sizes": "--capture-sizes",
    "graph_mode": "--graph-mode",
    "graph_backend": "--backend",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with every option's default (unless its help already states one, or it is an on/off switch),
    and the description / epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or isinstance(action, (argparse._StoreTrueAction,
                                                                    argparse._StoreFalseAction)):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, f"{message} (see {self.prog} --help)")


def parser(prog: str, doc: str | None) -> Parser:
    """A parser for command ``prog``: the doc's first line as description, the rest as epilog.

    >>> parser("cpattn x", "Does x.\\n\\nUsage::\\n\\n    cpattn x").description
    'Does x.'
    """
    first, _, rest = (doc or "").strip().partition("\n")
    return Parser(prog=prog, description=first.strip(), epilog=rest.strip() or None, formatter_class=HelpFormatter)


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


# ----------------------------------------------------------------------------- flags
def add_parallel(p: argparse.ArgumentParser, helps: dict[str, str] | None = None, **defaults) -> None:
    """Add the parallel / cache size flags named by the keywords (``tp``, ``pcp``, ``dcp``,
    ``interleave``, ``block_size``), each with its default (None allowed: "decided later").

    Values are validated at parse time (integers >= 1); ``helps`` replaces a flag's help text.

    >>> p = parser("cpattn x", None)
    >>> add_parallel(p, dcp=2, interleave=1, helps={"dcp": "DCP ranks"})
    >>> vars(p.parse_args(["--dcp", "4"]))
    {'decode_context_parallel_size': 4, 'cp_kv_cache_interleave_size': 1}
    """
    unknown = sorted(set(defaults) - set(PARALLEL))
    if unknown:
        raise TypeError(f"add_parallel: unknown flags {unknown}; known: {list(PARALLEL)}")
    for key, default in defaults.items():
        flags, dest, text = PARALLEL[key]
        text = (helps or {}).get(key, text)
        p.add_argument(*flags, dest=dest, type=positive_int, default=default, metavar="N", help=text)


def add_dtype(p: argparse.ArgumentParser, default: str = "float32", help: str = "data type of the inputs") -> None:
    """Add ``--dtype`` (any spelling of :data:`DTYPE_ALIASES`; the parsed value is the canonical name)."""
    p.add_argument("--dtype", type=dtype_name, default=dtype_name(default), metavar="DTYPE",
                   help=f"{help}: float32/fp32, bfloat16/bf16, float16/fp16, float64/fp64")


def add_json(p: argparse.ArgumentParser) -> None:
    """Add ``--json PATH``; ``-`` puts only JSON on stdout (see :func:`report_stream`)."""
    p.add_argument("--json", metavar="PATH", default=None, type=json_output,
                   help="also write the results as JSON to PATH (its directory must exist); '-' writes only JSON "
                        "to stdout and the text report to stderr (default: no JSON)")


def add_quick(p: argparse.ArgumentParser, help: str) -> None:
    """Add ``--quick`` with a help text that says what it shrinks."""
    p.add_argument("--quick", action="store_true", help=help)


def add_timeout(p: argparse.ArgumentParser, default: float = TIMEOUT_S) -> None:
    """Add ``--timeout S``: a rank silent (or a collective waiting) this long ends the run, naming the rank."""
    p.add_argument("--timeout", type=positive_float, default=default, metavar="S",
                   help="seconds a rank may go without a heartbeat, or a collective may wait, before the run "
                        "ends with an error naming the rank")


def add_progress(p: argparse.ArgumentParser) -> None:
    """Add ``--no-progress`` (progress is shown only when stderr is a terminal anyway)."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (a bar is drawn only when stderr is a terminal)")


# ----------------------------------------------------------------------------- checks and output
def check_engine(prog: str, flags: dict[str, str] | None = None, **flat):
    """``cpattn.config.EngineConfig.create(**flat)``, or a one-line usage error naming every broken rule.

    ``flags`` maps config fields to the flag that sets them in this command
    (default :data:`FLAG_OF_FIELD`). Exits with status 2 on any problem.

    >>> check_engine("cpattn x", tp_size=2, dcp_size=2, attention="mla").parallel.dcp_size
    2
    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     try:
    ...         check_engine("cpattn x", tp_size=2, dcp_size=4, attention="mla")
    ...     except SystemExit as e:
    ...         print(e.code)
    2
    >>> print(err.getvalue().strip())  # doctest: +NORMALIZE_WHITESPACE
    cpattn x: error: argument --decode-context-parallel-size/--dcp: saw --dcp=4, --tp=2 (mla); rule: MLA/DSA/V4 models
    need --tp >= --dcp and --tp % --dcp == 0 (DCP reuses TP ranks); fix: use --dcp in [2, 1] or --tp in [4, 8]
    """
    from cpattn.config import ConfigError, EngineConfig

    try:
        return EngineConfig.create(**flat)
    except ConfigError as e:
        speak_problems(prog, e.problems, flags)


def speak_problems(prog: str, problems: list[str], flags: dict[str, str] | None = None) -> NoReturn:
    """Print config problems (``"field: saw ...; rule: ...; fix: ..."``) as one usage-error line in flag
    names (several problems joined by `` -- also ``), and exit with status 2. ``flags`` adds to
    :data:`FLAG_OF_FIELD`.

    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     try:
    ...         speak_problems("cpattn x", ["block_size: saw 0; rule: a positive int; fix: pass block_size >= 1"])
    ...     except SystemExit as e:
    ...         print(e.code)
    2
    >>> print(err.getvalue().strip())
    cpattn x: error: argument --block-size: saw 0; rule: a positive int; fix: pass --block-size >= 1
    """
    names = {**FLAG_OF_FIELD, **(flags or {})}
    parts = []
    for prob in problems:
        field, _, rest = prob.partition(": ")
        for name, flag in names.items():  # speak in flags: "use dcp_size in [1, 2]" -> "use --dcp in [1, 2]"
            rest = re.sub(rf"\b{name}\b", flag.split("/")[-1], rest)
        parts.append(f"argument {names.get(field, field)}: {rest}")
    usage_error(prog, " -- also ".join(parts))


def report_stream(json_path: str | None):
    """Where the text report goes: stderr when ``--json -`` owns stdout, else stdout."""
    return sys.stderr if json_path == "-" else sys.stdout


@contextlib.contextmanager
def report_to(json_path: str | None) -> Iterator[None]:
    """Within the block, ``print`` goes to :func:`report_stream` (stderr under ``--json -``).

    Write the JSON after the block, so it alone reaches stdout.
    """
    if json_path != "-":
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield
