"""Benchmark: acceptance and decode speed of MTP, Eagle3 and DSpark on tiny trained targets.

Usage::

    cpattn bench drafts [--data DIR] [--quick] [--reps R] [--backend NAME] [--json PATH] [--timeout S]

DIR holds trained targets and heads as ``cpattn train-target`` / ``train-draft``
write them (default: the shipped ``tests/data/speculative``): ``qwen3``,
``deepseek_v3`` and ``{target}-{method}``.

Part 1, acceptance (simulated mesh, one rank, float32, greedy): per target,
method and k = 1..4 on the same corpus prompts -- mean acceptance length
(tokens per verify step: accepted drafts + the bonus token), the acceptance
rate of each draft position, verify steps against plain decode steps.

Part 2, speed (gloo ranks, FULL_DECODE_ONLY graph mode: the verify step and
the draft steps replayed from captures): decode tokens per second of each
method against plain decode, on one rank and on DCP = 2, measured side by
side in one run -- rounds of interleaved runs (each round starts with a
different one). Decode speed is the steady state: a step's mean wall time
from step 3 on over the tokens a step emits (a drafter captures its step
programs on first use, in step 1; the target's step is captured before
decode). Ratios are ``plain seconds per token / method seconds per token``
per round: best (fastest / fastest) and the spread (low-median-high) over
rounds.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys


from cpattn.bench import harness
from cpattn.config.cli_args import bad_value, check_backend, positive_int

DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[3] / "tests" / "data" / "speculative"
PAIRS = {"deepseek_v3": ("mtp", "eagle3", "dspark"), "qwen3": ("eagle3", "dspark")}


def load(data, target: str, dtype=None):
    """(model, cfg, params, {method: drafter}) of a target and every head trained for it in ``data``
    (``dtype`` default: float32)."""
    import torch

    from cpattn.lab import target as tg
    from cpattn.drafters.registry import DRAFTERS

    dtype = torch.float32 if dtype is None else dtype

    model, cfg, params = tg.load(os.path.join(data, target), dtype=dtype)
    heads = {m: DRAFTERS[m].from_checkpoint(os.path.join(data, f"{target}-{m}"), dtype=dtype)
             for m in PAIRS[target] if os.path.isdir(os.path.join(data, f"{target}-{m}"))}
    return model, cfg, params, heads


def bench_prompts(data, target: str, n: int, length: int = 16) -> list[list[int]]:
    """n corpus prompts (seeded apart from the training prompts)."""
    from cpattn.lab.corpus import Corpus

    return Corpus.load(os.path.join(data, target)).sample(n, length, seed=777).tolist()


def acceptance_rows(data, new_tokens: int, n_prompts: int, ks: list[int]) -> list[dict]:
    """Part 1: one row per (target, method, k)."""
    import torch
    from cpattn.engine.classic import generate, speculative_generate

    torch.set_num_threads(1)  # tiny steps: more threads only add overhead
    rows = []
    for tname in PAIRS:
        model, cfg, params, heads = load(data, tname)
        ps = bench_prompts(data, tname, n_prompts)
        ref = generate(model, params, cfg, ps, new_tokens)
        for method, d in heads.items():
            for k in ks:
                out = speculative_generate(model, params, cfg, ps, new_tokens, drafter=d, num_speculative_tokens=k)
                s = out.stats
                rows.append({"target": tname, "method": method, "k": k, "accept len": s.tokens_per_step,
                             "accepted/step": s.accepted / max(s.rows, 1),
                             "per position": " ".join(f"{a:.2f}" for a in s.acceptance_per_position),
                             "accepted/drafted": s.acceptance_rate, "verify steps": s.steps,
                             "plain steps": new_tokens - 1, "equal": bool(torch.equal(out.tokens, ref.tokens))})
    return rows


def seconds_per_token(out, skip: int = 2) -> float:
    """Steady-state decode seconds per token of one run: the mean wall time of a decode step from step
    ``skip + 1`` on, over the tokens a step emits (``stats.emitted / stats.steps``). The first steps are left
    out because a drafter captures its step programs on first use, inside step 1 (the target's verify step
    is captured before decode starts), and step 2 is the first replay.

    >>> from types import SimpleNamespace as NS
    >>> seconds_per_token(NS(facts=NS(step_s=(9.0, 9.0, 0.25, 0.75)), stats=NS(emitted=8, steps=4)))
    0.25
    """
    steps = out.facts.step_s[skip:] or out.facts.step_s
    return statistics.fmean(steps) / (out.stats.emitted / out.stats.steps)


def speed_rank(group, data, target: str, methods: dict, prompts, new_tokens: int, reps: int, backend: str):
    """On every rank: ``reps`` rounds of plain decode and each (method, k), interleaved (round i starts with
    run i); per run the slowest rank's steady-state seconds per token (see :func:`seconds_per_token`).
    Returns {name: [seconds per token]}."""
    import torch
    from cpattn.engine.classic import generate_on_rank, speculative_generate_on_rank

    model, cfg, params, heads = load(data, target)
    torch.set_num_threads(1)
    b = len(prompts)
    runs = {"plain": lambda: speculative_generate_on_rank(group, model, params, cfg, prompts, new_tokens, pcp_size=1,
                                                          graph=backend, capture_sizes=[b])}
    for method, k in methods.items():
        runs[f"{method} k={k}"] = (lambda m=method, kk=k: speculative_generate_on_rank(
            group, model, params, cfg, prompts, new_tokens, pcp_size=1, drafter=heads[m], num_speculative_tokens=kk,
            graph=backend, capture_sizes=[b * (1 + kk)]))
    names = list(runs)
    times = {n: [] for n in names}
    generate_on_rank(group, model, params, cfg, prompts, 2)  # warm up the process
    for n in names:  # warm-up run of each: compiles happen here
        runs[n]()
    for i in range(reps):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            out = runs[n]()
            mine = torch.tensor([seconds_per_token(out)])
            times[n].append(float(group.all_gather(mine).max()))  # the slowest rank's
    return times


def speed_rows(data, new_tokens: int, n_prompts: int, reps: int, backend: str, methods_k: dict,
               timeout_s: float = 300.0) -> list[dict]:
    """Part 2: decode speed of each method against plain decode, one rank and DCP = 2; the speedup pairs the
    runs of one round (:func:`cpattn.bench.harness.paired`: plain / method seconds per token, NaN, never an
    exception, where a time is 0)."""
    rows = []
    for tname, methods in methods_k.items():
        ps = bench_prompts(data, tname, n_prompts)
        for ranks in (1, 2):
            times = harness.ranks(ranks, speed_rank, str(data), tname, methods, ps, new_tokens, reps, backend,
                                  timeout_s=timeout_s, label=f"{tname} decode speed, dcp={ranks}")[0]
            for name, t in times.items():
                speedup = harness.paired(times["plain"], t)
                rows.append({"target": tname, "ranks": f"dcp={ranks}", "run": name,
                             "decode tok/s (best)": harness.safe_div(1.0, min(t)),
                             "ms/token (median)": 1e3 * statistics.median(t),
                             "speedup best": speedup.best, "speedup [low-high]": str(speedup)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print both tables (the payload also as JSON with --json). Exit status 1 when a speculative run's tokens
    differ from plain greedy decoding, else 0."""
    p = harness.parser("cpattn bench drafts", __doc__, quick="fewer prompts, tokens and rounds", timeout=300.0)
    p.add_argument("--data", default=str(DEFAULT_DATA), metavar="DIR",
                   help="trained targets and heads (default: the shipped tests/data/speculative)")
    p.add_argument("--reps", type=positive_int, default=5, metavar="R", help="interleaved rounds (part 2)")
    p.add_argument("--backend", default="inductor", help="graph backend of the captured steps (part 2; default: inductor)")
    args = p.parse_args(argv)
    check_backend(p.prog, "--backend", args.backend)
    missing = [t for t in PAIRS if not os.path.isfile(os.path.join(args.data, t, "config.json"))]
    if missing:
        bad_value(p.prog, "--data", args.data, f"a directory holding the trained targets {', '.join(PAIRS)} "
                  "(cpattn train-target) and their heads", "omit --data for the shipped checkpoints")
    new, n, reps = (24, 4, 2) if args.quick else (64, 8, args.reps)
    ks = [1, 2, 3, 4]
    with harness.Report(args) as out:
        out.progress("part 1: acceptance, one rank")
        acc = acceptance_rows(args.data, new, n, ks)
        out.line(f"acceptance: {n} corpus prompts x {new} tokens, float32, one rank")
        out.line("accept len = tokens per verify step (accepted drafts + the bonus token); per position: the share "
                 "of steps whose drafts 1..j were all accepted")
        out.table(acc, ["target", "method", "k", "accept len", "accepted/step", "per position", "accepted/drafted",
                        "verify steps", "plain steps", "equal"])
        best = {}
        for r in acc:  # each method at its best k on each target
            key = (r["target"], r["method"])
            if key not in best or r["accept len"] > best[key]["accept len"]:
                best[key] = r
        methods_k = {t: {m: best[(t, m)]["k"] for m in ms if (t, m) in best} for t, ms in PAIRS.items()}
        speed = speed_rows(args.data, new, n, reps, args.backend, methods_k, timeout_s=args.timeout)
        out.line(f"\ndecode speed, graph mode ({args.backend}), {reps} interleaved rounds, steady state (decode "
                 "steps 3 on); speedup = plain seconds per token / method seconds per token")
        out.table(speed, ["target", "ranks", "run", "decode tok/s (best)", "ms/token (median)", "speedup best",
                          "speedup [low-high]"])
        out.payload = {"quick": args.quick, "acceptance": acc, "speed": speed, "new_tokens": new, "prompts": n,
                       "reps": reps, "backend": args.backend}
    lost = [f"{r['target']} {r['method']} k={r['k']}" for r in acc if not r["equal"]]
    if lost:
        print(f"cpattn bench drafts: tokens differ from plain greedy decoding: {', '.join(lost)}", file=sys.stderr)
        return 1
    return 0
