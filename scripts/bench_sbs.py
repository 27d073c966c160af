"""Benchmarks side by side against an earlier revision, in one run.

For each benchmark name, ``cpattn bench NAME --quick --json F`` runs on the revision ``--base`` (a git
worktree made under a temporary folder, run with this checkout's Python through ``PYTHONPATH``) and on this
checkout, alternately (base head, head base, ...; ``--rounds`` each), then the two JSON payloads are
compared field by field:

- ``keys``: whether both have the same set of field paths (list items by position; a path only on one side
  is printed);
- ``ints``: integer and boolean fields (byte counts, token counts, equality checks) equal on both sides, and
  the ones that differ;
- ``time ratio``: head / base of each float field whose path names a time (``_s``, ``_ms``, ``seconds``), the
  median over fields and rounds [low-high], a base value of 0 skipped.

Usage::

    python scripts/bench_sbs.py --base d416596 pcp spec engine
    python scripts/bench_sbs.py --base HEAD~5 --rounds 2 --arg --reps=1 pool

Exit status 0 when every benchmark ran on both sides (differences are reported, not failed on), 1 when one
failed, 2 for usage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME_MARKS = ("_s", "_ms", "seconds", "time")


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Leaf values of a JSON payload by path (``a.b[2].c``).

    >>> flatten({"a": {"b": [1, {"c": 2.5}]}, "d": True})
    {'a.b[0]': 1, 'a.b[1].c': 2.5, 'd': True}
    """
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def is_time(path: str) -> bool:
    """Whether a field path names a time (its last part ends in ``_s`` / ``_ms`` or says seconds / time).

    >>> is_time("rows[0].ttft_ms"), is_time("rows[0].bytes"), is_time("one_s")
    (True, False, True)
    """
    last = path.rsplit(".", 1)[-1].split("[", 1)[0].lower()
    return any(last.endswith(m) or m in last and m in ("seconds", "time") for m in TIME_MARKS)


def compare(base: dict, head: dict) -> dict:
    """Field-by-field comparison of two payloads of one benchmark (see module doc).

    >>> r = compare({"x_ms": 2.0, "n": 3, "only": 1}, {"x_ms": 3.0, "n": 4})
    >>> r["same_keys"], r["only_base"], r["ints_differ"], r["time_ratios"]
    (False, ['only'], ['n: 3 -> 4'], [1.5])
    """
    fb, fh = flatten(base), flatten(head)
    common = [p for p in fb if p in fh]
    ints = [p for p in common if isinstance(fb[p], (bool, int)) and isinstance(fh[p], (bool, int))]
    ratios = [fh[p] / fb[p] for p in common if is_time(p) and isinstance(fb[p], (int, float))
              and isinstance(fh[p], (int, float)) and not isinstance(fb[p], bool) and fb[p] > 0]
    return {"same_keys": set(fb) == set(fh), "only_base": sorted(set(fb) - set(fh)),
            "only_head": sorted(set(fh) - set(fb)), "ints": len(ints),
            "ints_differ": [f"{p}: {fb[p]} -> {fh[p]}" for p in ints if fb[p] != fh[p]], "time_ratios": ratios}


def run_bench(name: str, src: Path, out: Path, extra: list[str]) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "cpattn", "bench", name, "--quick", "--json", str(out), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if res.returncode != 0:
        print(f"  {name} at {src.parent.name}: exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return None
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_sbs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="+", help="benchmark names (cpattn bench NAME)")
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=1, help="runs per side, alternating (default 1)")
    p.add_argument("--arg", action="append", default=[], help="an extra argument for every run (repeatable)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: saw {a.rounds}; rule: at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench_sbs_"))
    tree = tmp / "base"
    made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.base],
                          capture_output=True, text=True)
    if made.returncode != 0:
        print(f"bench_sbs.py: --base {a.base}: {made.stderr.strip()}", file=sys.stderr)
        return 2
    failed = False
    try:
        for name in a.names:
            pairs = []
            for r in range(a.rounds):
                order = [("base", tree / "src"), ("head", ROOT / "src")]
                runs = {}
                for side, src in (order if r % 2 == 0 else order[::-1]):
                    runs[side] = run_bench(name, src, tmp / f"{name}_{side}_{r}.json", a.arg)
                if runs["base"] is None or runs["head"] is None:
                    failed = True
                    break
                pairs.append(compare(runs["base"], runs["head"]))
            if not pairs:
                print(f"{name}: did not run on both sides")
                continue
            c = pairs[0]
            ratios = sorted(x for pr in pairs for x in pr["time_ratios"])
            spread = (f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] over {len(ratios)}"
                      if ratios else "-")
            print(f"{name}: same keys {c['same_keys']}; ints equal {c['ints'] - len(c['ints_differ'])}/{c['ints']}; "
                  f"time ratio head/base {spread}")
            for what in ("only_base", "only_head", "ints_differ"):
                for line in c[what][:8]:
                    print(f"  {what}: {line}")
                if len(c[what]) > 8:
                    print(f"  {what}: ... {len(c[what]) - 8} more")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
