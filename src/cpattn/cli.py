"""``cpattn``: the command line. ``cpattn demo`` is the main job; ``cpattn bench NAME`` runs a benchmark.

Commands are looked up in a table and imported lazily, so ``cpattn --help``
is instant and a benchmark's imports cost nothing until it runs.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("cpattn.bench.demo:main",
             "main job: PCP prefill -> KV handoff -> DCP decode in graph mode on P gloo ranks, checked vs one device"),
    "prefill": ("cpattn.bench.pcp:prefill_main", "PCP prefill attention on P gloo ranks, checked against one rank"),
}
BENCHMARKS = {
    "pcp": ("cpattn.bench.pcp:bench_main", "16K-token PCP prefill: ring / all-gather / PyTorch ring vs one rank"),
    "dcp": ("cpattn.bench.dcp:main", "64K-context DCP decode: one rank vs DCP=2, merge traffic, paged vs contiguous"),
    "paged": ("cpattn.bench.paged:main", "CPU paged attention: batched vs flash-loop vs compiled paths, and dispatch's pick"),
    "comm": ("cpattn.bench.comm:main", "gloo collectives: the backend's own algorithms vs DistGroup's all_to_all ones"),
    "graph": ("cpattn.bench.graph:main", "decode step: eager vs graph-captured (DCP demo program on gloo)"),
    "spec": ("cpattn.bench.spec:main", "speculative acceptance per drafter/k; TTFT PCP+DCP vs PCP prefill + P/D transfer"),
    "dsa": ("cpattn.bench.dsa:main", "DSA decode vs dense MLA at 32K/64K, FP8 selection, DSA-CP prefill on 2 ranks"),
}


def _load(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _usage() -> str:
    lines = ["usage: cpattn COMMAND [options]   (cpattn COMMAND --help for options)", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += [f"  bench {name:<6} {doc}" for name, (_, doc) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"cpattn bench: choose one of {sorted(BENCHMARKS)}\n\n{_usage()}", file=sys.stderr)
            return 2
        return _exit_code(_load(BENCHMARKS[rest[0]][0])(rest[1:]))
    if cmd not in COMMANDS:
        print(f"cpattn: unknown command {cmd!r}; valid: {sorted(COMMANDS) + ['bench']}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _exit_code(_load(COMMANDS[cmd][0])(rest))


def _exit_code(result) -> int:
    """A command's exit status: its int result, 0 for anything else (some return their result dict)."""
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
