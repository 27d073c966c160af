"""Benchmark: speculative decoding acceptance, and TTFT of PCP+DCP vs PCP prefill + P/D KV transfer.

Part 1 (simulated mesh, DCP over 2 ranks, float64 so tokens are exact):
acceptance rate and tokens gained per verification step for n-gram prompt
lookup on a repetitive prompt, for draft models (the target's first 1 or 3
of 4 layers) and for the target as its own drafter (the upper bound),
k = 1..4 (``--quick``: 1 and 3); the
verification steps against plain decode steps, and the decode wall time
ratio measured side by side (noisy: thread collectives on shared cores).

Part 2 (real gloo processes): time to first token, from all ranks starting
together until the decode side holds the prompt's KV in its DCP layout and
knows the first token:

- ``pcp+dcp a2a``: PCP prefill over P ranks writing the DCP layout of the
  same ranks with one owner all-to-all (the fixed-batch composition's hand-off stage,
  :func:`cpattn.engine.driver.composed_on_rank`);
- ``pcp+dcp allgather``: the same with an all-gather of the KV instead;
- ``pcp -> p/d``: PCP prefill on P ranks, then whole blocks sent point to
  point to N = P separate decode ranks (the composition's P/D hand-off,
  :func:`cpattn.engine.driver.composed_on_rank`: with one new token the step
  loop's P/D, what ``generate_on_rank`` runs, hands nothing off).

Run: ``cpattn bench spec --quick`` (under a minute) or with
``--json out.json`` (``--json -``: only JSON on stdout).
"""

from __future__ import annotations

import statistics
import time

from cpattn.bench import harness
from cpattn.bench.harness import safe_div
from cpattn.bench.pool import ttft_model  # noqa: F401 (re-exported: the same small Qwen3 as bench pool's)
from cpattn.config import cli_args as cli


def spec_model(layers: int = 4):
    """A small random Qwen3 (vocab 64, hidden 64, 8/2 heads of 16), float64.

    Its greedy output falls into a repeated token after a few dozen steps:
    the repetition prompt lookup feeds on (a random model does not copy the
    prompt's pattern, a trained one would).
    """
    import torch
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    return cfg, qwen3.init_params(cfg, seed=0, std=0.3, dtype=torch.float64)


def acceptance_rows(new_tokens: int, ks: list[int]) -> list[dict]:
    """Part 1: one row per (drafter, k)."""
    import torch
    from cpattn.drafters.draft_model import ModelDrafter, truncated
    from cpattn.drafters.ngram import NgramDrafter
    from cpattn.models import qwen3
    from cpattn.engine.classic import generate, speculative_generate

    torch.set_num_threads(1)
    cfg, params = spec_model()
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, cfg.vocab_size, (12,), generator=g).tolist()
    prompts = [pattern * 6, torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()]
    generate(qwen3, params, cfg, prompts, 4, dcp_size=2)  # warm-up
    t0 = time.perf_counter()
    plain = generate(qwen3, params, cfg, prompts, new_tokens, dcp_size=2)
    plain_s = time.perf_counter() - t0
    ref = generate(qwen3, params, cfg, prompts, new_tokens)  # one device
    drafters = {"ngram": NgramDrafter(), "draft model (1 of 4 layers)": truncated(qwen3, params, cfg, 1),
                "draft model (3 of 4 layers)": truncated(qwen3, params, cfg, 3),
                "target itself": ModelDrafter(qwen3, params, cfg)}
    rows = []
    for name, d in drafters.items():
        for k in ks:
            t0 = time.perf_counter()
            out = speculative_generate(qwen3, params, cfg, prompts, new_tokens, drafter=d, num_speculative_tokens=k,
                                       dcp_size=2)
            wall = time.perf_counter() - t0
            s = out.stats
            rows.append({"drafter": name, "k": k, "acceptance": s.acceptance_rate, "tokens/step": s.tokens_per_step,
                         "verify steps": s.steps, "plain steps": new_tokens - 1,
                         "steps ratio": safe_div(s.steps, new_tokens - 1), "wall ratio": safe_div(wall, plain_s),
                         "tokens equal": bool(torch.equal(out.tokens, ref.tokens)
                                              and torch.equal(plain.tokens, ref.tokens))})
    return rows


# -- part 2: TTFT on gloo ----------------------------------------------------------------------


def _median_ready(times: list[float]) -> float:
    return statistics.median(times)


def pcp_dcp_rank(group, params, cfg, prompts, block_size, reps):
    """Per exchange: median over reps of this rank's start -> ready time, and its exchange bytes, in the
    fixed-batch composition whose hand-off stage these two schemes are (``driver.composed_on_rank``: the step
    loop has no hand-off stage, its prefill step writes each row to its owner)."""
    import torch
    from cpattn.engine.classic import pcp_dcp_config
    from cpattn.engine.driver import composed_on_rank
    from cpattn.engine.options import Algorithms

    out = {}
    config = pcp_dcp_config("qwen3", cfg, group.size, block_size=block_size, interleave_size=block_size)
    for exchange in ("a2a", "allgather"):
        times, handoff = [], None
        for rep in range(reps + 1):  # the first run warms up
            group.all_reduce(torch.zeros(1))
            t0 = time.perf_counter()
            res = composed_on_rank(group, "qwen3", params, cfg, prompts, 1, prefill=config, decode=config,
                                   prompt_logits=False, algorithms=Algorithms(handoff=exchange))
            if rep:
                times.append(time.perf_counter() - t0)
            handoff = res.facts.handoff
        out[exchange] = {"ready_s": _median_ready(times), "bytes": handoff.bytes_sent}
    return out


def pd_rank(world, params, cfg, prompts, block_size, reps, pcp_size):
    """Median ready time of this rank over reps (decode ranks: KV placed; prefill ranks: prefill done)."""
    from cpattn.engine.classic import pd_configs
    from cpattn.engine.driver import composed_on_rank  # its hand-off: the step loop hands 1 token's run none

    pre, dec = pd_configs("qwen3", cfg, pcp_size=pcp_size, dcp_size=world.size - pcp_size, block_size=block_size)
    times, last = [], None
    for rep in range(reps + 1):
        last = composed_on_rank(world, "qwen3", params, cfg, prompts, 1, prefill=pre, decode=dec)
        if rep:
            times.append(last.facts.prefill_s if last.facts.role == "prefill" else last.facts.ttft_s)
    kind = last.facts.role
    nbytes = last.facts.handoff.bytes_sent if kind == "prefill" else last.facts.handoff.bytes_received
    return {"role": kind, "ready_s": _median_ready(times), "bytes": nbytes}


def ttft_rows(p: int, tokens: int, hidden: int, layers: int, block_size: int, reps: int,
              timeout_s: float = cli.TIMEOUT_S) -> list[dict]:
    """Part 2: TTFT rows (the slowest rank's median)."""
    import torch

    cfg, params = ttft_model(hidden, layers)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (tokens,), generator=g).tolist()]
    both = harness.ranks(p, pcp_dcp_rank, params, cfg, prompts, block_size, reps, timeout_s=timeout_s,
                         label="PCP+DCP prefill, a2a and allgather exchange")
    pd = harness.ranks(2 * p, pd_rank, params, cfg, prompts, block_size, reps, p, timeout_s=timeout_s,
                       label="PCP prefill -> P/D transfer")
    rows = []
    for ex in ("a2a", "allgather"):
        rows.append({"scheme": f"pcp+dcp {ex}", "ranks": p, "ttft_s": max(r[ex]["ready_s"] for r in both),
                     "kv bytes moved": sum(r[ex]["bytes"] for r in both)})
    dec = [r for r in pd if r["role"] == "decode"]
    pre = [r for r in pd if r["role"] == "prefill"]
    rows.append({"scheme": "pcp -> p/d transfer", "ranks": 2 * p, "ttft_s": max(r["ready_s"] for r in dec),
                 "prefill_s": max(r["ready_s"] for r in pre), "kv bytes moved": sum(r["bytes"] for r in dec)})
    base = rows[-1]["ttft_s"]
    for r in rows:
        r["ttft vs p/d"] = safe_div(r["ttft_s"], base)
    return rows


def parser():
    p = harness.parser("cpattn bench spec", __doc__, timeout=True,
                       quick="48 new tokens, k in {1, 3}, a 512-token TTFT prompt (under a minute; else 128, k = 1..4, "
                             "4096)")
    cli.add_parallel(p, pcp=2, helps={"pcp": "P: the PCP ranks of part 2 (and the DCP / decode ranks); part 1 "
                                             "always decodes on 2 simulated DCP ranks"})
    return p


def main(argv=None) -> int:
    """Print both tables (and write the payload with --json); exit status 1 if any run's tokens differ."""
    args = parser().parse_args(argv)
    quick = args.quick
    new_tokens = 48 if quick else 128
    ks = [1, 3] if quick else [1, 2, 3, 4]
    sizes = dict(tokens=512, hidden=128, layers=2, block_size=16, reps=2) if quick else \
        dict(tokens=4096, hidden=256, layers=4, block_size=64, reps=3)
    p = args.prefill_context_parallel_size
    with harness.Report(args) as out:
        out.progress(f"part 1: {len(ks)} k x 4 drafters, {new_tokens} new tokens")
        spec = acceptance_rows(new_tokens, ks)
        out.line(f"speculative decoding, DCP over 2 simulated ranks, {new_tokens} new tokens, 2 requests")
        out.table(spec, ["drafter", "k", "acceptance", "tokens/step", "verify steps", "plain steps", "steps ratio",
                         "wall ratio", "tokens equal"])
        ttft = ttft_rows(p, **sizes, timeout_s=args.timeout)
        out.line(f"\nTTFT on gloo: one prompt of {sizes['tokens']} tokens, hidden {sizes['hidden']}, "
                 f"{sizes['layers']} layers, block = interleave = {sizes['block_size']}")
        out.table(ttft, ["scheme", "ranks", "ttft_s", "prefill_s", "ttft vs p/d", "kv bytes moved"])
        out.payload = {"quick": quick, "speculative": spec, "ttft": ttft, "ttft_sizes": sizes, "pcp": p}
    return 0 if all(r["tokens equal"] for r in spec) else 1


if __name__ == "__main__":
    main()
