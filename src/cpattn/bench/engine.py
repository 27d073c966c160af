"""Benchmark: the step loop's host time -- scheduling and input preparation as a fraction of a step.

On the demo model (the tiny Qwen3 of ``cpattn demo``, random weights), one
process (a one-rank gloo group, so a captured step can be compiled), the
:class:`~cpattn.engine.llm.LLMEngine` runs:

- **decode** at batch 1 / 8 / 32: every request prefilled, then uniform
  decode steps, eager and captured (FULL_DECODE_ONLY, ``--graph-backend``), once per
  ``--output-kinds`` (``SamplingParams.output_kind``: FINAL_ONLY, vLLM's offline
  ``LLM.generate`` choice, builds no RequestOutput until a request finishes; CUMULATIVE builds
  one per row per step), the kinds' engines stepped in interleaved blocks of 5 steps;
- **mixed**: 8 decoding requests and one ``--chunk``-token prompt chunk in
  one step (always eager, as FULL_DECODE_ONLY asks);
- **chunked TTFT**: one ``--prompt``-token prompt prefilled in ``--chunk``
  chunks vs in one step (budget = the prompt), the first token's wall time,
  in interleaved rounds (:func:`cpattn.bench.harness.compare`; under PCP 2
  each sample is the slowest rank's), median [low-high] of the per-round
  ratios, of wall time and of CPU seconds (``time.process_time``: on a shared
  machine the wall ratio mostly measures who got a core); on one rank and under PCP 2 +
  DCP 2 (two gloo ranks: each chunk's rows run PCP and attend their cached
  context -- kept on every rank from the chunks before, in one causal call
  with the chunk: :mod:`cpattn.engine.runner_pcp`).

Per step the engine records host seconds by phase (``engine.step_times``):
schedule, prepare (the input tensors), forward (the model step), sample,
update, outputs (the RequestOutput objects). ``host %`` = (step - forward) /
step, the median over the timed steps with [low-high] -- the part of a step
that is not the model; ``sched+prep %`` = (schedule + prepare + update) /
step -- the scheduler (its schedule and its commit of the sampled tokens) and
the input preparation alone. On a model this small the forward is short, so the fraction
is an upper bound of what a real model sees. The parser, the rounds, the spreads, the rank
launch, the table and ``--json`` are :mod:`cpattn.bench.harness`'s.

Usage::

    cpattn bench engine              # float32 and bfloat16, 2K chunks of an 8K prompt
    cpattn bench engine --quick      # float32, eager graph runner, 512-token chunks of 2K, < 60 s
    cpattn bench engine --json -     # only JSON on stdout
"""

from __future__ import annotations

import statistics

from cpattn.bench import harness
from cpattn.config import cli_args as cli

PROG = "cpattn bench engine"
PHASES = ("schedule", "prepare", "forward", "sample", "update", "outputs")
COLUMNS = ["scenario", "mode", "outputs", "step ms", "host %", "sched+prep %", "replayed"]


def _mlh(s: harness.Spread) -> dict:
    """median / low / high of a :class:`~cpattn.bench.harness.Spread` (the JSON of every spread here)."""
    return {"median": s.median, "low": s.low, "high": s.high}


def _spread(xs: list[float]) -> dict:
    """median [low-high] of plain samples, as JSON.

    >>> _spread([0.3, 0.1, 0.2])
    {'median': 0.2, 'low': 0.1, 'high': 0.3}
    """
    return _mlh(harness.spread(xs))


def _sched_prep(t: dict) -> float:
    """The scheduler's and the input preparation's share of a step: (schedule + prepare + update) / step."""
    return (t["schedule"] + t["prepare"] + t["update"]) / t["total"]


def _engine(group, params, cfg, *, batch: int, budget: int, graph: str | None, num_blocks: int,
            max_model_len: int | None = None):
    from cpattn.config import SchedulerConfig
    from cpattn.engine.llm import LLMEngine

    n = group.size  # > 1: PCP + DCP over the group (one engine)
    return LLMEngine("qwen3", params, cfg, world=group, dcp_size=n, pcp_size=n, block_size=16,
                     num_blocks=num_blocks,
                     graph_mode="FULL_DECODE_ONLY" if graph else "NONE", graph_backend=graph or "eager",
                     capture_sizes=[batch] if graph else None,
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max(batch, 9),
                                               enable_prefix_caching=False, max_model_len=max_model_len))


def _decode_rows(group, params, cfg, batch: int, steps: int, graph: str | None, kinds=("FINAL_ONLY",)) -> list:
    """Host fraction of ``steps`` uniform decode steps at ``batch`` requests (after their prefill), one row per
    output kind (``SamplingParams.output_kind`` of every request): one engine each, timed side by side in
    interleaved blocks of 5 steps."""
    from cpattn.engine.llm import SamplingParams
    from cpattn.engine.outputs import RequestOutputKind

    per_request = -(-(64 + steps + 8) // 16)  # 16-token blocks of a request at its longest (any --steps)
    engines = {}
    for kind in kinds:
        eng = _engine(group, params, cfg, batch=batch, budget=64 * batch, graph=graph,
                      num_blocks=batch * per_request, max_model_len=64 + steps + 8)  # tables as wide as needed
        for i in range(batch):
            eng.add_request([(7 * i + j) % cfg.vocab_size for j in range(64)],
                            SamplingParams(max_tokens=steps + 3, output_kind=RequestOutputKind[kind]))
        while eng.stats.steps < 1 or eng.last_step[0].is_prefill[0]:
            eng.step()
        eng.step()  # warm-up decode
        engines[kind] = eng
    times = {kind: [] for kind in kinds}
    replayed = dict.fromkeys(kinds, 0)
    for start in range(0, steps, 5):
        for kind, eng in engines.items():
            for _ in range(min(5, steps - start)):
                eng.step()
                times[kind].append(eng.step_times)
                replayed[kind] += eng.last_step[1]
    rows = []
    for kind, ts in times.items():
        rows.append({"outputs": kind.lower(), "host_frac": _spread([(t["total"] - t["forward"]) / t["total"] for t in ts]),
                     "sched_prep_frac": _spread([_sched_prep(t) for t in ts]),
                     "step_s": _spread([t["total"] for t in ts]), "replayed": replayed[kind], "steps": steps,
                     "phases_s": {p: statistics.median(t[p] for t in ts) for p in PHASES}})
    return rows


def _mixed_row(group, params, cfg, chunk: int) -> dict:
    """One step holding 8 decodes and a ``chunk``-token prompt chunk (eager)."""
    from cpattn.engine.llm import SamplingParams

    eng = _engine(group, params, cfg, batch=8, budget=chunk + 8, graph=None, num_blocks=8 * 8 + chunk // 16 + 4)
    for i in range(8):
        eng.add_request([(3 * i + j) % cfg.vocab_size for j in range(64)], SamplingParams(max_tokens=8))
    eng.step()
    eng.step()  # decodes running
    eng.add_request([j % cfg.vocab_size for j in range(chunk + 1)], SamplingParams(max_tokens=1))
    eng.step()
    t, out = eng.step_times, eng.last_step[0]
    return {"host_frac": (t["total"] - t["forward"]) / t["total"], "sched_prep_frac": _sched_prep(t),
            "step_s": t["total"],
            "rows": len(out.req_ids), "tokens": out.num_scheduled_tokens, "phases_s": {p: t[p] for p in PHASES}}


def _ttft(group, params, cfg, prompt: int, chunk: int, rounds: int) -> dict:
    """First-token time of one prompt in ``chunk``-token chunks vs in one step: :func:`harness.compare`'s
    interleaved rounds (one warm-up call each first), each call one request added and stepped to its
    token on that variant's engine (built once; prefix caching off, so every call computes the prompt)."""
    from cpattn.engine.llm import SamplingParams

    toks = [j * 5 % cfg.vocab_size for j in range(prompt)]

    def first_token(budget: int):
        eng = _engine(group, params, cfg, batch=1, budget=budget, graph=None, num_blocks=prompt // 16 + 2)

        def run():
            eng.add_request(toks, SamplingParams(max_tokens=1))
            while eng.has_unfinished():
                eng.step()
        return run

    c = harness.compare({"chunked": first_token(chunk), "whole": first_token(prompt)}, rounds, group=group)
    return {"chunked_s": _spread(c.samples["chunked"].wall), "whole_s": _spread(c.samples["whole"].wall),
            "ratio": _mlh(c.ratio("chunked", "whole")), "cpu_ratio": _mlh(c.ratio("chunked", "whole", clock="cpu"))}


def ttft_rank(group, cfg: dict) -> dict:
    """The chunked-vs-whole TTFT on a PCP + DCP group, per dtype."""
    from cpattn.bench.common import DTYPES
    from cpattn.models import qwen3

    mcfg = qwen3.Qwen3Config.tiny()
    return {dt: _ttft(group, qwen3.init_params(mcfg, dtype=DTYPES[dt]), mcfg, cfg["prompt"], cfg["chunk"],
                      cfg["rounds"]) for dt in cfg["dtypes"]}


def engine_rank(group, cfg: dict) -> dict:
    """Every scenario on this rank (a one-rank group), for each dtype."""
    import torch

    from cpattn.bench.common import DTYPES
    from cpattn.models import qwen3

    mcfg = qwen3.Qwen3Config.tiny()
    torch.manual_seed(0)
    out = {}
    for dt in cfg["dtypes"]:
        params = qwen3.init_params(mcfg, dtype=DTYPES[dt])
        rows = []
        for b in cfg["batches"]:
            for graph in (None, cfg["graph_backend"]):
                mode = "captured" if graph else "eager"
                harness.progress(f"{dt} decode b={b} {mode}")
                for r in _decode_rows(group, params, mcfg, b, cfg["steps"], graph, cfg["output_kinds"]):
                    rows.append({"scenario": f"decode b={b}", "mode": mode, **r})
        harness.progress(f"{dt} 8 decodes + {cfg['chunk']}-token chunk; TTFT one rank")
        rows.append({"scenario": f"8 decodes + {cfg['chunk']}-token chunk", "mode": "eager",
                     **_mixed_row(group, params, mcfg, cfg["chunk"])})
        out[dt] = {"rows": rows, "ttft": _ttft(group, params, mcfg, cfg["prompt"], cfg["chunk"], cfg["rounds"])}
    return out


def _pct(h) -> str:
    """A fraction (or a median [low-high] spread of them) in percent.

    >>> _pct(0.1234), _pct({"median": 0.1, "low": 0.05, "high": 0.2})
    ('12.3', '10.0 [5.0-20.0]')
    """
    if isinstance(h, dict):
        return f"{100 * h['median']:.1f} [{100 * h['low']:.1f}-{100 * h['high']:.1f}]"
    return f"{100 * h:.1f}"


def _cells(row: dict) -> dict:
    """One table row of a scenario's result."""
    st = row["step_s"]["median"] if isinstance(row["step_s"], dict) else row["step_s"]
    return {"scenario": row["scenario"], "mode": row["mode"], "outputs": row.get("outputs", "cumulative"),
            "step ms": f"{1e3 * st:.2f}",
            "host %": _pct(row["host_frac"]), "sched+prep %": _pct(row["sched_prep_frac"]),
            "replayed": str(row.get("replayed", "-"))}


def _ratio(s: dict) -> str:
    return f"{s['median']:.2f} [{s['low']:.2f}-{s['high']:.2f}]"


def _parser():
    p = harness.parser(PROG, __doc__, quick="float32 only, eager graph runner, batches 1,8, 2K prompt in 512-token "
                                            "chunks, < 60 s (flags given beside it win)", timeout=1800.0)
    p.add_argument("--batches", type=cli.int_list, default="1,8,32", metavar="B,...", help="decode batch sizes")
    p.add_argument("--steps", type=cli.positive_int, default=20, help="timed decode steps per batch size")
    p.add_argument("--prompt", type=cli.positive_int, default=8192, help="prompt tokens of the chunked-TTFT run")
    p.add_argument("--chunk", type=cli.positive_int, default=2048, help="prefill chunk (the step's token budget)")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="interleaved TTFT rounds")
    p.add_argument("--dtypes", default="float32,bfloat16", metavar="D,...", help="model dtypes")
    p.add_argument("--output-kinds", default="final_only,cumulative", metavar="K,...",
                   help="SamplingParams.output_kind of the decode rows' requests (final_only, delta, cumulative), "
                        "timed side by side")
    p.add_argument("--graph-backend", default="cpu", metavar="NAME",
                   help="graph backend of the captured decode steps (cpu compiles with inductor; eager: no compiler)")
    return p


QUICK = dict(batches=(1, 8), steps=8, prompt=2048, chunk=512, rounds=2, graph_backend="eager", dtypes="float32")


def main(argv=None) -> int:
    """Run the engine benchmark and print host fractions and the chunked-prefill TTFT ratio."""
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:  # its sizes, except those given on the command line
        defaults = vars(p.parse_args([]))
        for name, value in QUICK.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    dtypes = [cli.dtype_name(d) for d in args.dtypes.split(",") if d]
    if args.chunk > args.prompt:
        cli.bad_value(p.prog, "--chunk", args.chunk, "a chunk no longer than --prompt",
                      f"pass --chunk <= {args.prompt}")
    cli.check_backend(p.prog, "--graph-backend", args.graph_backend)
    kinds = [k.strip().upper() for k in args.output_kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("FINAL_ONLY", "DELTA", "CUMULATIVE")] or not kinds
    if bad:
        cli.bad_value(p.prog, "--output-kinds", args.output_kinds, "a comma list of final_only, delta, cumulative",
                      "pass e.g. --output-kinds final_only,cumulative")
    cfg = dict(batches=list(args.batches), steps=args.steps, prompt=args.prompt, chunk=args.chunk,
               rounds=args.rounds, dtypes=dtypes, graph_backend=args.graph_backend, output_kinds=kinds)
    with harness.Report(args) as out:
        out.line(f"engine step loop on the demo model (tiny Qwen3), one gloo rank; graph backend {args.graph_backend}; "
                 f"host % = (step - forward) / step; sched+prep % = (schedule + prepare + update) / step; "
                 f"median [low-high] over {args.steps} steps; TTFT: {args.rounds} interleaved rounds")
        res = harness.ranks(1, engine_rank, cfg, threads=2, timeout_s=args.timeout, label="decode, mixed, TTFT")[0]
        pcp = harness.ranks(2, ttft_rank, cfg, timeout_s=args.timeout, label="TTFT under PCP 2 + DCP 2")[0]
        for dt in res:
            res[dt]["ttft_pcp2"] = pcp[dt]
        for dt, r in res.items():
            out.line(f"\n{dt}")
            out.table([_cells(row) for row in r["rows"]], COLUMNS)
            for key, where in (("ttft", "one rank"), ("ttft_pcp2", "PCP 2 + DCP 2")):
                t = r[key]
                out.line(f"TTFT {args.prompt}-token prompt, {where}: {args.chunk}-token chunks "
                         f"{t['chunked_s']['median']:.3f} s vs one step {t['whole_s']['median']:.3f} s; chunked / "
                         f"whole {_ratio(t['ratio'])}; CPU seconds {_ratio(t['cpu_ratio'])}")
        out.line(f"\n({out.elapsed:.0f} s)")
        out.payload = {"benchmark": "engine", "config": cfg, "results": res}
    return 0
