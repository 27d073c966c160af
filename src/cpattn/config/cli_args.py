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
import re
import sys
from collections.abc import Iterator
from typing import NoReturn

from cpattn.config.cli_paths import (  # noqa: F401 (re-exported: the parsers' one vocabulary)
    input_dir, input_file, json_output, output_dir, output_file, output_file_made,
)
from cpattn.config.cli_types import (  # noqa: F401 (re-exported: the parsers' one vocabulary)
    DTYPE_ALIASES, GRAPH_BACKENDS, _int, _torch_build, backend_unavailable, bad_value, check_backend, dtype_name,
    int_list, nonnegative_int, port, positive_float, positive_int, usage_error,
)

TIMEOUT_S = 120.0  # default stall bound of every command that starts ranks

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
