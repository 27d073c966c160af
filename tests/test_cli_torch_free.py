"""A typo costs no ``import torch``: every command parses its flags, and refuses a bad one, before torch loads.

Each case runs ``cpattn.cli.main`` in a fresh process with an import hook
that fails the run at the first attempt to import torch (so a command that
imports it anywhere on the way to its usage error is caught, not just timed):
an unknown flag, a bad value, ``--help``. One interpreter installs the hook and
imports ``cpattn.cli`` (which imports no torch), then forks one child per case:
each child starts from exactly the state a fresh ``python -c`` would have reached
there, at a millisecond instead of an interpreter start. The check looks at ``sys.modules``
as well, and at the exit status (2 for a usage error, 0 for help). Rules that
need the model (``cpattn demo --dcp 3`` against its heads, with the layouts
that would pass offered as the fix) read its config and may import torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, sys, tempfile

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            import traceback
            where = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "cpattn" in f.filename]
            sys.__stdout__.write(json.dumps({"torch": True, "where": where[-3:]}) + "\n")
            sys.__stdout__.flush()
            import os
            os._exit(99)

sys.meta_path.insert(0, NoTorch())
import io, contextlib
import cpattn.cli as cli
assert "torch" not in sys.modules
results = []
for argv in json.loads(sys.stdin.read()):
    with tempfile.TemporaryFile() as f:
        pid = os.fork()
        if pid == 0:  # the case: the hook and cpattn.cli as a fresh interpreter would have them, nothing more
            os.dup2(f.fileno(), 1)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli.main(argv)
                except SystemExit as e:
                    code = e.code
            print(json.dumps({"torch": "torch" in sys.modules, "code": code, "stderr": err.getvalue(),
                              "stdout": out.getvalue()}))
            sys.stdout.flush()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        f.seek(0)
        lines = f.read().decode().strip().splitlines()
        results.append(json.loads(lines[-1]) if lines else {"torch": f"no result (wait status {status})"})
sys.__stdout__.write(json.dumps(results) + "\n")
"""


def _cpu_torch() -> bool:
    from cpattn.bench.args import _torch_build

    return _torch_build().endswith("+cpu")


CPU_TORCH = _cpu_torch()  # a CPU-only wheel: --backend cuda is refused from torch's metadata, without importing it


def _commands() -> list[list[str]]:
    from cpattn import cli

    from cpattn.plan.cli import SUBCOMMANDS

    return ([[c] for c in cli.COMMANDS] + [[g, n] for g, table in cli.GROUPS.items() for n in table]
            + [["plan", sub] for sub in SUBCOMMANDS])


BAD_VALUES = [
    ["demo", "--pcp", "x"], ["demo", "--model-type", "llama"], ["demo", "--graph-mode", "full"],
    ["demo", "--kv-pool", "redis:x"], ["demo", "--backend", "gpu"],
    ["demo", "--json", "/nonexistent/dir/out.json"],
    ["bench", "pcp", "--nonsense"], ["bench", "pcp", "--kv-heads", "3"], ["bench", "graph", "--backend", "gpu"],
    ["bench", "mlapo", "--graph-backend", "gpu"], ["bench", "drafts", "--backend", "gpu"],
    ["plan", "validate", "--pcp-json", "/nonexistent.json"], ["plan", "--devices", "0"],
    ["bench", "nonsense"], ["nonsense"],
    *([["demo", "--backend", "cuda"], ["bench", "graph", "--backend", "cuda"]] if CPU_TORCH else []),
]
HELP = [["--help"], ["bench", "--help"], ["pool", "--help"], ["demo", "--help"], ["bench", "pcp", "--help"],
        ["plan", "--help"]]


@pytest.fixture(scope="module")
def probed() -> dict:
    """Every case's result, by argv: one interpreter, one fork per case."""
    argvs = [[*cmd, "--no-such-flag"] for cmd in _commands()] + BAD_VALUES + HELP
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.stdout.strip(), proc.stderr
    return {tuple(a): r for a, r in zip(argvs, json.loads(proc.stdout.strip().splitlines()[-1]))}


@pytest.mark.parametrize("cmd", _commands(), ids=" ".join)
def test_an_unknown_flag_is_refused_before_torch_is_imported(cmd, probed):
    r = probed[(*cmd, "--no-such-flag")]
    assert not r["torch"], f"cpattn {' '.join(cmd)} imported torch before refusing a bad flag: {r.get('where')}"
    named = "--no-such-flag" in r["stderr"] or "arguments are required" in r["stderr"]  # argparse names those first
    assert r["code"] == 2 and named and len(r["stderr"].strip().splitlines()) == 1, r


@pytest.mark.parametrize("argv", BAD_VALUES, ids=" ".join)
def test_bad_values_are_refused_before_torch_is_imported(argv, probed):
    r = probed[tuple(argv)]
    assert not r["torch"], f"cpattn {' '.join(argv)} imported torch before refusing it: {r.get('where')}"
    assert r["code"] == 2 and len(r["stderr"].strip().splitlines()) == 1 and "error" in r["stderr"], r


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_needs_no_torch(argv, probed):
    r = probed[tuple(argv)]
    assert not r["torch"] and r["code"] == 0 and "usage:" in r["stdout"], r


def test_pool_help_is_the_pool_groups_own(probed):
    """``cpattn pool --help`` lists the pool commands, not every command."""
    r = probed[("pool", "--help")]
    assert r["code"] == 0 and "cpattn pool NAME" in r["stdout"] and "serve" in r["stdout"]
    assert "demo" not in r["stdout"] and "bench" not in r["stdout"], r["stdout"]


@pytest.mark.slow
def test_the_cli_tables_agree_with_the_registries():
    """args.py's torch-free lists (parsed before torch) are the registries' own names (in a fresh process:
    this one's tests register backends of their own)."""
    code = ("import json; from cpattn.bench import args as cli; from cpattn.engine.family import FAMILY_MODULES; "
            "from cpattn.graphs.backends import backends; print(json.dumps([sorted(FAMILY_MODULES), "
            "list(cli.MODEL_TYPES), sorted(backends()), list(cli.GRAPH_BACKENDS)]))")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.abspath(src)})
    families, model_types, backends, graph_backends = json.loads(proc.stdout)
    assert families == model_types and backends == graph_backends
