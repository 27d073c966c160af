"""``cpattn``: the command line. ``cpattn demo`` is the main job; ``cpattn bench NAME`` runs a benchmark.

Commands are looked up in a table and imported lazily, so ``cpattn --help``
is instant and a benchmark's imports cost nothing until it runs.

Exit status: 0 success; 1 the command ran but a check failed or a rank
failed (the reason is printed, without the launcher's own traceback); 2 a
usage error (one line on stderr naming the flag, the value and the rule);
130 interrupted.

Example
-------
>>> main(["bench", "nonsense"])  # doctest: +SKIP
cpattn bench: error: unknown benchmark 'nonsense'; choose one of comm, dcp, dsa, graph, paged, pcp, spec
2
"""

from __future__ import annotations

import difflib
import importlib
import sys

COMMANDS = {
    "demo": ("cpattn.bench.demo:main",
             "main job: PCP prefill -> KV handoff -> DCP decode in graph mode on P gloo ranks, checked vs one device"),
    "prefill": ("cpattn.bench.pcp:prefill_main", "PCP prefill attention on P gloo ranks, checked against one rank"),
    "plan": ("cpattn.plan.cli:main",
             "predicted TTFT / TPOT / KV bytes per (tp, pcp, dcp) on H200, B200, Ascend 910C (plan calibrate|validate|anchors)"),
    "train-target": ("cpattn.lab.train:target_main",
                     "a tiny Qwen3 / DeepSeek-V3 target trained on the synthetic corpus (CPU, minutes), saved as a checkpoint"),
    "train-draft": ("cpattn.lab.train:main",
                    "an MTP / Eagle3 / DSpark head trained by self-distillation on a target's greedy continuations"),
    "serve": ("cpattn.serve.cli:main",
              "OpenAI-compatible HTTP server (/v1/completions: token ids, or text with a tokenizer; sampling) on the step loop, 127.0.0.1"),
}
BENCHMARKS = {
    "pcp": ("cpattn.bench.pcp:bench_main", "16K-token PCP prefill: ring / all-gather / PyTorch ring vs one rank"),
    "dcp": ("cpattn.bench.dcp:main", "64K-context DCP decode: one rank vs DCP ranks, merge traffic, paged vs contiguous"),
    "paged": ("cpattn.bench.paged:main", "CPU paged attention: batched vs flash-loop vs compiled paths, and dispatch's pick"),
    "comm": ("cpattn.bench.comm:main", "gloo collectives: the backend's own algorithms vs DistGroup's all_to_all ones"),
    "graph": ("cpattn.bench.graph:main", "decode step: eager vs graph-captured (DCP demo program on gloo)"),
    "spec": ("cpattn.bench.spec:main", "speculative acceptance per drafter/k; TTFT PCP+DCP vs PCP prefill + P/D transfer"),
    "dsa": ("cpattn.bench.dsa:main", "DSA decode vs dense MLA at 32K/64K, FP8 selection, DSA-CP prefill on TP ranks"),
    "pool": ("cpattn.bench.pool:main", "KV pool: store / load per block; TTFT cold vs warm (pooled prefix), 1 and 2 ranks"),
    "v4": ("cpattn.bench.v4:main", "DeepSeek-V4: KV bytes per token vs V3.2/MLA; 64K decode 1 rank vs DCP; 16K prefill 1 rank vs PCP"),
    "engine": ("cpattn.bench.engine:main", "step loop: scheduling + input preparation as a fraction of a step, "
               "decode batch 1/8/32 eager vs captured; chunked-prefill TTFT"),
    "serve": ("cpattn.bench.serve:main", "cpattn serve under Poisson load (openai client): TTFT / TPOT / ITL p50-p99, "
              "goodput, prefix hits; data parallel vs DCP 2 vs PCP 2 + DCP 2 vs DCP 2 captured"),
    "mlapo": ("cpattn.bench.mlapo:main", "DeepSeek decode step with / without the fused MLA preprocessing op, DCP 1 and 2"),
    "hybrid": ("cpattn.bench.hybrid:main", "Qwen3-Next (hybrid): 16K prefill PCP 2 vs one rank, scan cost, state vs KV bytes, 32K decode DCP 2"),
    "drafts": ("cpattn.lab.report:main",
               "MTP / Eagle3 / DSpark on tiny trained targets: acceptance per position; decode tok/s vs plain, DCP 1 and 2"),
}
PLAN_EXPERIMENTS = ("calibrate", "validate", "anchors")  # cpattn plan SUB: benchmark-side (cpattn.bench.perf.cli)
POOL = {
    "serve": ("cpattn.pool.server:main", "a Mooncake master on 127.0.0.1 and a long-lived process holding the pool's memory"),
}
GROUPS = {"bench": BENCHMARKS, "pool": POOL}  # two-word commands: cpattn GROUP NAME


def _load(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _usage() -> str:
    lines = ["usage: cpattn COMMAND [options]   (cpattn COMMAND --help for options)", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += [f"  {group} {name:<{11 - len(group)}} {doc}" for group, table in GROUPS.items()
              for name, (_, doc) in table.items()]
    return "\n".join(lines)


def _group_usage(group: str, table: dict, what: str) -> str:
    """``cpattn GROUP --help``: the group's own commands (``cpattn GROUP NAME --help`` for a command's options).

    >>> print(_group_usage("pool", {"serve": ("m:f", "a pool")}, "pool command"))
    usage: cpattn pool NAME [options]   (cpattn pool NAME --help for options)
    <BLANKLINE>
    pool commands:
      serve        a pool
    """
    lines = [f"usage: cpattn {group} NAME [options]   (cpattn {group} NAME --help for options)", "",
             f"{what}s:" if what == "benchmark" else f"{group} commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, doc) in table.items()]
    return "\n".join(lines)


def _unknown(prog: str, what: str, name: str, valid: list[str]) -> int:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    print(f"{prog}: error: unknown {what} {name!r}; choose one of {', '.join(sorted(valid))}{hint} "
          f"(see cpattn --help)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``cpattn ARGV``; return the exit status (see module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in GROUPS:
        table, what = GROUPS[cmd], "benchmark" if cmd == "bench" else f"{cmd} command"
        if not rest:
            print(f"cpattn {cmd}: error: name a {what}: {', '.join(table)} (see cpattn --help)", file=sys.stderr)
            return 2
        if rest[0] in ("-h", "--help"):
            print(_group_usage(cmd, table, what))
            return 0
        if rest[0] not in table:
            return _unknown(f"cpattn {cmd}", what, rest[0], list(table))
        prog, target, rest = f"cpattn {cmd} {rest[0]}", table[rest[0]][0], rest[1:]
    elif cmd == "plan" and rest and rest[0] in PLAN_EXPERIMENTS:  # the planner's experiments run benchmarks
        prog, target = f"cpattn plan {rest[0]}", "cpattn.bench.perf.cli:main"
    elif cmd in COMMANDS:
        prog, target = f"cpattn {cmd}", COMMANDS[cmd][0]
    else:
        return _unknown("cpattn", "command", cmd, [*COMMANDS, *GROUPS])
    return _run(prog, target, rest)


def _run(prog: str, target: str, argv: list[str]) -> int:
    try:
        return _exit_code(_load(target)(argv))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _spawn_error(e):
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return 1


def _spawn_error(e: BaseException) -> bool:
    """Whether ``e`` is a :class:`cpattn.comm.launch.SpawnError` (a failed rank), without importing the
    launcher (and torch) for commands that never start ranks: a SpawnError implies its module is loaded."""
    launch = sys.modules.get("cpattn.comm.launch")
    return launch is not None and isinstance(e, launch.SpawnError)


def _exit_code(result) -> int:
    """A command's exit status: its int result, 0 for anything else (some return their result dict)."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
