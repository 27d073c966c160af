"""Benchmark: ``cpattn serve`` under load -- TTFT / TPOT / ITL percentiles, throughput and goodput per layout.

Starts real ``cpattn serve`` servers (subprocesses on 127.0.0.1, free ports, the embedded tiny Qwen3 of
``cpattn demo``; a multi-rank server's ranks as gloo processes, ``--distributed-executor-backend mp``, or
``uni`` for threads of one process; all stopped at the end), one set per layout:

- ``dp2``: data parallel, two independent one-rank servers, requests round-robin;
- ``dcp2``: one server, DCP 2 (eager);
- ``dcp2-graph``: DCP 2 with ``--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'`` (captured
  uniform decode steps);
- ``pcp2-dcp2``: one engine, PCP 2 + DCP 2 (prefill chunks under PCP, decode under DCP; eager);
- ``pcp2-dcp2-elastic``: the same with ``--pcp-policy elastic --pcp-min-tokens measure`` (only chunks of at
  least the threshold the server timed on its ranks at start-up run PCP, shorter ones prefill data-parallel,
  one rank each; under ``uni``, threads that cannot be timed apart, the planner's break-even) and captured
  decode steps (FULL_DECODE_ONLY, as it would be served);
- ``pd-2-2``: P/D in one server, ``--kv-transfer-config`` kv_both: a PCP 2 prefill role hands each
  request's KV through an in-process pool to a DCP 2 decode role.

After a warm-up, the load generator (:mod:`cpattn.bench.serve_load`, the real ``openai.AsyncOpenAI``
client, streaming, ``temperature=0``) sends each workload at each ``--request-rate`` (Poisson
arrivals, ``--seed``), the layouts interleaved per rate (their order rotated from rate to rate), every
layout getting the same requests at a rate. Workloads:

- ``mixed``: most requests short (``--short-len``, default 64-256 tokens), ``--long-fraction`` (0.2) long
  (``--long-len``, default 2048-4096 on this 2-core machine; ``--long-len 8192,16384`` for
  8K-16K), outputs ``--output-len`` (16-48), a shared 64-token prefix (prefix-cache hits);
- ``fixed``: ``--fixed-len`` (512 in, 32 out), random prompts.

Per run: TTFT / TPOT / ITL / e2e p50 / p90 / p99, request throughput, output tokens/s, goodput under
``--slo-ttft-ms`` / ``--slo-tpot-ms``, and from the servers' ``/metrics`` (deltas over the run) the
prefix-cache hit rate and the steps replayed / eager. The summary (:func:`summary`) sets them side by
side: on the mixed workload, short- and long-request TTFT p50 (split by prompt class) and goodput per
layout; elastic vs dp2 (short) and vs pcp2-dcp2 (long); long-request TTFT p50 of PCP 2 / dp2 at the lowest
rate; captured (dcp2-graph) TPOT p50 <= eager (dcp2) per rate. Each cell is one interleaved run on a
shared machine: ratios are medians over rates, and ranks are approximate.

Usage::

    cpattn bench serve                                   # 2 workloads x rates 0.5,1,2 x 6 layouts
    cpattn bench serve --request-rate 0.5,1 --long-len 8192,16384
    cpattn bench serve --quick --json -                  # seconds of load (server start dominates)
    cpattn bench serve --plot serve.png                  # latency-vs-rate curves per layout
"""

from __future__ import annotations

import json
import os
import signal
import time

from cpattn.bench import harness
from cpattn.bench.serve_servers import METRICS, NAME, Server, _delta, free_port, parse_metrics  # noqa: F401
from cpattn.bench.serve_report import _progress_line, plot, summary, summary_lines, table  # noqa: F401
from cpattn.config import cli_args as cli

PROG = "cpattn bench serve"
GRAPH = '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
KV = '{"kv_connector": "CpattnPoolConnector", "kv_role": "kv_both"}'
# layout -> the extra flags of each of its servers (several servers: data parallel, round-robin)
LAYOUTS = {
    "dp2": (["--dcp", "1"], ["--dcp", "1"]),
    "dcp2": (["--dcp", "2"],),
    "dcp2-graph": (["--dcp", "2", "--compilation-config", GRAPH],),
    "pcp2-dcp2": (["--pcp", "2", "--dcp", "2"],),
    "pcp2-dcp2-elastic": (["--pcp", "2", "--dcp", "2", "--pcp-policy", "elastic", "--pcp-min-tokens", "measure",
                           "--compilation-config", GRAPH],),
    "pd-2-2": (["--pcp", "2", "--dcp", "2", "--kv-transfer-config", KV],),
}
WORKLOADS = ("mixed", "fixed")


def _rates(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated request rates > 0 (``inf``: all at once).

    >>> _rates("0.5,2,inf")
    (0.5, 2.0, inf)
    """
    import argparse

    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            v = float("nan")
        if not v > 0:
            raise argparse.ArgumentTypeError(f"saw {text!r}; rule: comma-separated request rates > 0 (or inf)")
        out.append(v)
    return tuple(out)


def _pair(text: str) -> tuple[int, int]:
    """argparse type: ``A,B`` with 1 <= A <= B (a range or an in,out pair; one number: A = B).

    >>> _pair("2048,4096"), _pair("16")
    ((2048, 4096), (16, 16))
    """
    import argparse

    try:
        vals = cli.int_list(text)
    except argparse.ArgumentTypeError:
        vals = ()
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: two comma-separated integers >= 1, e.g. 2048,4096")
    return vals[0], vals[1]


def _range(text: str) -> tuple[int, int]:
    import argparse

    lo, hi = _pair(text)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: MIN,MAX with MIN <= MAX")
    return lo, hi


def _fraction(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a fraction in [0, 1]")
    return v


def _layouts(text: str) -> tuple[str, ...]:
    import argparse

    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: comma-separated layouts of {', '.join(LAYOUTS)}")
    return names


def _workloads(text: str) -> tuple[str, ...]:
    import argparse

    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names or any(n not in WORKLOADS for n in names):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: comma-separated workloads of {', '.join(WORKLOADS)}")
    return names


def parser():
    p = harness.parser(PROG, __doc__, quick="3 requests per run, rate 4, short prompts (long 256-384), 4-8 output "
                                            "tokens, captured layouts on the eager graph backend (no compiler)")
    p.add_argument("--request-rate", type=_rates, default=None, metavar="R,...",
                   help="request rates (requests/s, Poisson arrivals; inf: all at once) (default 0.5,1,2; --quick 4)")
    p.add_argument("--num-requests", type=cli.positive_int, default=None, metavar="N",
                   help="requests per run (one workload, one rate, one layout) (default 16; --quick 3)")
    p.add_argument("--workloads", type=_workloads, default=WORKLOADS, metavar="W,...", help="mixed, fixed")
    p.add_argument("--layouts", type=_layouts, default=tuple(LAYOUTS), metavar="L,...",
                   help=f"layouts compared side by side: {', '.join(LAYOUTS)}")
    p.add_argument("--short-len", type=_range, default=(64, 256), metavar="MIN,MAX",
                   help="mixed workload: prompt tokens of a short request")
    p.add_argument("--long-len", type=_range, default=(2048, 4096), metavar="MIN,MAX",
                   help="mixed workload: prompt tokens of a long request (8192,16384: 8K-16K long contexts)")
    p.add_argument("--long-fraction", type=_fraction, default=0.2, metavar="F", help="mixed: share of long requests")
    p.add_argument("--output-len", type=_range, default=(16, 48), metavar="MIN,MAX",
                   help="mixed workload: tokens generated per request")
    p.add_argument("--fixed-len", type=_pair, default=(512, 32), metavar="IN,OUT",
                   help="fixed workload: prompt and output tokens of every request")
    p.add_argument("--slo-ttft-ms", type=cli.positive_float, default=1000.0, metavar="MS",
                   help="goodput: a request meets its SLOs with TTFT <= this")
    p.add_argument("--slo-tpot-ms", type=cli.positive_float, default=50.0, metavar="MS",
                   help="goodput: ... and TPOT <= this")
    p.add_argument("--max-num-seqs", type=cli.positive_int, default=16, metavar="N", help="each server's request cap")
    p.add_argument("--max-num-batched-tokens", type=cli.positive_int, default=2048, metavar="N",
                   help="each server's step budget")
    p.add_argument("--seed", type=cli.nonnegative_int, default=0, help="seed of the workloads and arrivals")
    p.add_argument("--plot", type=cli.output_file, default=None, metavar="PATH.png",
                   help="latency-vs-rate curves per layout (TTFT p50 / p99, TPOT p50; matplotlib) (default: no plot)")
    p.add_argument("--server-timeout", type=cli.positive_float, default=300.0, metavar="S",
                   help="seconds a server may take to answer /health")
    p.add_argument("--distributed-executor-backend", choices=("uni", "mp"), default="mp",
                   help="where a multi-rank server's ranks run (cpattn serve's flag): mp, one gloo process per rank, "
                        "as a deployment runs them; uni, threads of the server's process (they share its GIL: a "
                        "captured step's Python wrapper then waits on the other rank's thread and the HTTP loop, so "
                        "captured TPOT read 1.08-1.21x eager's there against 0.51-0.65x under mp); dp2's servers "
                        "have one rank each")
    return p


# ----------------------------------------------------------------------------- servers
def settings(a) -> dict:
    """The run's sizes from the flags (``--quick`` shrinks what was not given)."""
    q = a.quick
    long = a.long_len if not (q and a.long_len == (2048, 4096)) else (256, 384)
    out = a.output_len if not (q and a.output_len == (16, 48)) else (4, 8)
    fixed = a.fixed_len if not (q and a.fixed_len == (512, 32)) else (96, 6)
    short = a.short_len if not (q and a.short_len == (64, 256)) else (40, 80)
    return {"rates": list(a.request_rate or ((4.0,) if q else (0.5, 1.0, 2.0))),
            "num_requests": a.num_requests or (3 if q else 16), "workloads": list(a.workloads),
            "layouts": list(a.layouts), "short_len": list(short), "long_len": list(long),
            "long_fraction": a.long_fraction if not q or a.long_fraction != 0.2 else 0.34,
            "output_len": list(out), "fixed_len": list(fixed), "slo_ttft_ms": a.slo_ttft_ms,
            "slo_tpot_ms": a.slo_tpot_ms, "seed": a.seed, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens, "executor": a.distributed_executor_backend,
            "max_model_len": max(long[1] + out[1], fixed[0] + fixed[1], short[1] + out[1]) + 64,
            "graph_backend": "eager" if q else None}  # --quick: captured layouts replay without a compiler


def _executor(flags: list[str], executor: str) -> list[str]:
    """A layout's server flags under ``executor``: ``uni`` drops ``--pcp-min-tokens measure`` (its ranks are
    threads of one process, which cannot be timed apart: the planner's break-even then).

    >>> _executor(["--pcp-policy", "elastic", "--pcp-min-tokens", "measure"], "uni")
    ['--pcp-policy', 'elastic']
    """
    if executor != "uni" or "measure" not in flags:
        return list(flags)
    i = flags.index("measure")
    return [*flags[:i - 1], *flags[i + 1:]]


def _graph(flags: list[str], backend: str | None) -> list[str]:
    """A layout's server flags, its FULL_DECODE_ONLY compilation config naming ``backend`` when one is given.

    >>> _graph(["--dcp", "2", "--compilation-config", GRAPH], "eager")[-1]
    '{"cudagraph_mode": "FULL_DECODE_ONLY", "backend": "eager"}'
    """
    if backend is None:
        return list(flags)
    return [f'{GRAPH[:-1]}, "backend": "{backend}"}}' if f == GRAPH else f for f in flags]


def workload(name: str, s: dict, seed: int, vocab: int):
    from cpattn.bench.serve_load import fixed_workload, mixed_workload

    if name == "mixed":
        return mixed_workload(s["num_requests"], seed, vocab, short=tuple(s["short_len"]), long=tuple(s["long_len"]),
                              long_fraction=s["long_fraction"], output=tuple(s["output_len"]))
    return fixed_workload(s["num_requests"], seed, vocab, input_len=s["fixed_len"][0], output_len=s["fixed_len"][1])


def _warm_up(servers: list[Server], vocab: int) -> None:
    """Two concurrent short requests per server (first steps, captures, the client's connections)."""
    import asyncio

    from cpattn.bench.serve_load import fixed_workload, run_load

    for srv in servers:
        reqs = fixed_workload(2, 999, vocab, input_len=40, output_len=6)
        records, _ = asyncio.run(run_load([(srv.url + "/v1", NAME)], reqs, [0.0, 0.0]))
        bad = [r.error for r in records if r.error]
        if bad:
            raise RuntimeError(f"warm-up of cpattn serve {' '.join(srv.args)} failed: {bad[0]}")


def run(s: dict, progress=None) -> dict:
    """Every (workload, rate, layout) run; the servers started first and stopped at the end."""
    import asyncio

    from cpattn.bench.serve_load import poisson_arrivals, run_load, summarize
    from cpattn.models.family import get_family

    say = progress or (lambda *_: None)
    vocab = get_family("qwen3").config_class.tiny().vocab_size
    common = ["--model-type", "qwen3", "--max-model-len", str(s["max_model_len"]), "--max-num-seqs",
              str(s["max_num_seqs"]), "--max-num-batched-tokens", str(s["max_num_batched_tokens"])]
    servers: dict[str, list[Server]] = {}
    t_start, machine = time.monotonic(), _machine()
    try:
        for name in s["layouts"]:
            executor = ["--distributed-executor-backend", s.get("executor", "uni")] if name != "dp2" else []
            servers[name] = [Server([*_graph(_executor(flags, s.get("executor", "uni")), s.get("graph_backend")),
                                     *executor], common) for flags in LAYOUTS[name]]
        deadline = time.monotonic() + s.get("server_timeout", 300.0)
        for name, group in servers.items():
            for srv in group:
                srv.wait_ready(deadline)
        say(f"{sum(len(g) for g in servers.values())} servers up in {time.monotonic() - t_start:.1f} s; warming up")
        for group in servers.values():
            _warm_up(group, vocab)
        results = []
        for w in s["workloads"]:
            for ri, rate in enumerate(s["rates"]):
                seed = s["seed"] * 1000 + 17 * ri + (0 if w == "mixed" else 500)
                reqs = workload(w, s, seed, vocab)
                arrivals = poisson_arrivals(len(reqs), rate, seed)
                order = s["layouts"][ri % len(s["layouts"]):] + s["layouts"][:ri % len(s["layouts"])]
                for name in order:
                    group = servers[name]
                    before = [g.metrics() for g in group]
                    records, duration = asyncio.run(run_load([(g.url + "/v1", NAME) for g in group], reqs, arrivals))
                    after = [g.metrics() for g in group]
                    summary = summarize(records, duration, s["slo_ttft_ms"] / 1e3, s["slo_tpot_ms"] / 1e3)
                    row = {"workload": w, "rate": rate if rate != float("inf") else "inf", "layout": name,
                           **summary, **_delta(before, after)}
                    results.append(row)
                    say(_progress_line(row))
    finally:
        for group in servers.values():
            for srv in group:
                srv.stop()
    return {"settings": s, "layouts": {n: [list(f) for f in LAYOUTS[n]] for n in s["layouts"]},
            "server_flags": common, "results": results, "wall_s": time.monotonic() - t_start,
            "machine": {**machine, "loadavg_end": _machine()["loadavg"]}}


def _machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "loadavg": list(load) if load else None}


def _stop_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C (KeyboardInterrupt), so the servers are stopped on the way out."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    _stop_on_sigterm()
    missing = [n for n in ("openai", "fastapi", "uvicorn") if _missing(n)]
    if missing:
        cli.usage_error(PROG, f"needs {', '.join(missing)}, not installed; fix: pip install 'cpattn[serve]' openai")
    s = settings(a)
    s["server_timeout"] = a.server_timeout
    say = harness.progress  # on stderr, never on stdout
    say(f"{PROG}: {len(s['layouts'])} layouts x {len(s['rates'])} rates x {len(s['workloads'])} workloads, "
        f"{s['num_requests']} requests per run (embedded tiny Qwen3, {os.cpu_count()} CPUs)")
    with harness.Report(a) as out:
        payload = run(s, say)
        failed = sum(r["failed"] for r in payload["results"])
        payload["ok"] = failed == 0
        payload["summary"] = summary(payload)
        out.line(table(payload))
        out.line("\n".join(summary_lines(payload["summary"])))
        if a.plot:
            why = plot(payload, a.plot)
            out.line(f"plot: {a.plot}" if why is None else f"plot skipped: {why}")
        if failed:
            errors = sorted({e for r in payload["results"] for e in r["errors"]})
            out.line(f"{failed} requests failed: {'; '.join(errors[:3])}")
        out.payload = payload
    return 0 if failed == 0 else 1


def _missing(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except (ValueError, ImportError):
        return True
