"""Benchmark: the KV pool -- store / load time per block, and TTFT of a request whose prefix is pooled.

Part 1 (:func:`cpattn.bench.pool_blocks.run_bench`): per backend and block size,
milliseconds per block to store and to load, best of interleaved samples
with the spread (median / best - 1), and MB/s.

Part 2, the engine: one prompt of ``--prompt-len`` tokens is prefilled cold
(its whole blocks go to the pool), then a prompt sharing its first 7/8 (in
whole blocks) is prefilled warm, on one rank and on PCP = 2 gloo ranks (one
engine, DCP 1: rank 1 computes its share of each chunk and holds no KV), for
each backend, through ``driver.generate_on_rank``: the step loop, the pool its
prefix cache's second tier (:mod:`cpattn.engine.step_on_rank`). Cold and warm
runs alternate over ``--reps`` rounds, each round with a fresh model name (so a
round's cold run finds nothing). Reported: TTFT cold and warm (best and
spread), their ratio, the blocks the warm run found, bytes stored per rank
(each DCP rank stores the blocks it holds), and the time the warm run spent
fetching its prefix from the pool (``load_ms``: lookups and loads at admission)
vs the time the cold run spent storing (``store_ms``: reading its whole blocks
out of the cache and writing them), both measured around the pool connector's
tier (:class:`~cpattn.engine.step_on_rank_hooks.TimedPool`), slowest rank's,
best round. The step loop stores in the step that computed the blocks, so the
cold TTFT includes ``store_ms`` and the warm one ``load_ms`` (and the store
of its new tail): the prefix's recompute is about cold - warm + load - store.

Run: ``cpattn bench pool --quick`` (under a minute) or ``cpattn bench pool``.
"""

from __future__ import annotations

import os
import tempfile

from cpattn.bench import harness
from cpattn.config import cli_args as cli

BLOCK = 16


def ttft_model(hidden: int, layers: int):
    """A small random Qwen3 (8 query / 2 KV heads) in float32."""
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                 head_dim=hidden // 8)
    return cfg, qwen3.init_params(cfg, seed=0, std=0.05)


def pool_rank(group, params, cfg, prompts: dict, spec: str, reps: int, pcp: int) -> list[dict]:
    """Per round: cold then warm TTFT on this rank (the slowest rank's is taken by the caller), pool facts
    (``generate_on_rank``'s: the step loop's pool connector, its fetch and store seconds timed)."""
    import torch
    from cpattn.engine import driver
    from cpattn.engine.pooling import PoolSpec

    pre, dec = driver.engine_configs("qwen3", cfg, pcp_size=pcp, dcp_size=1, block_size=BLOCK,
                                     interleave_size=BLOCK)
    out = []
    for rep in range(reps + 1):  # round 0 warms kernels, links and the store up; it is not reported
        row = {}
        pool = PoolSpec(spec, model=f"bench-{pcp}-{rep}")
        for name in ("cold", "warm"):
            group.all_reduce(torch.zeros(1))
            gen = driver.generate_on_rank(group, "qwen3", params, cfg, prompts[name], 1, prefill=pre, decode=dec,
                                          prompt_logits=False, pool=pool)
            f = gen.facts
            row[name] = {"ttft_s": f.ttft_s, "load_s": f.pool.load_s, "store_s": f.pool.store_s,
                         "hit_blocks": sum(f.pool.hit_blocks), "bytes_stored": f.pool.bytes_stored}
        if rep:
            out.append(row)
    return out


def ttft_rows(specs: dict[str, str], prompt_len: int, hidden: int, layers: int, reps: int,
              timeout_s: float) -> list[dict]:
    import torch

    cfg, params = ttft_model(hidden, layers)
    g = torch.Generator().manual_seed(1)
    cold = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    keep = prompt_len * 7 // 8 // BLOCK * BLOCK
    warm = cold[:keep] + torch.randint(0, cfg.vocab_size, (prompt_len - keep,), generator=g).tolist()
    rows = []
    for backend, spec in specs.items():
        for pcp in (1, 2):
            per_rank = harness.ranks(pcp, pool_rank, params, cfg, {"cold": [cold], "warm": [warm]}, spec, reps, pcp,
                                     timeout_s=timeout_s, label=f"{backend}, cold vs warm TTFT")
            cold_t, warm_t = ([max(r[i][k]["ttft_s"] for r in per_rank) for i in range(reps)]  # slowest rank's
                              for k in ("cold", "warm"))
            x = harness.paired(cold_t, warm_t)  # cold / warm per round
            first = per_rank[0][0]
            rows.append({
                "backend": backend, "ranks": pcp, "prompt": prompt_len, "shared": keep,
                "hit_blocks": first["warm"]["hit_blocks"],
                "cold_ms": 1e3 * min(cold_t), "warm_ms": 1e3 * min(warm_t),
                "cold/warm": x.median, "ratio_min": x.low, "ratio_max": x.high,
                "load_ms": 1e3 * min(max(r[i]["warm"]["load_s"] for r in per_rank) for i in range(reps)),
                "store_ms": 1e3 * min(max(r[i]["cold"]["store_s"] for r in per_rank) for i in range(reps)),
                "stored_bytes_per_rank": max(r[0]["cold"]["bytes_stored"] for r in per_rank),
            })
    return rows


TTFT_COLUMNS = ["backend", "ranks", "prompt", "shared", "hit_blocks", "cold_ms", "warm_ms", "cold/warm", "ratio_min",
                "ratio_max", "load_ms", "store_ms", "stored_bytes_per_rank"]


def parser():
    p = harness.parser("cpattn bench pool", __doc__, timeout=True,
                       quick="part 1 at one block size with few blocks; part 2 with a 1024-token prompt and 2 rounds")
    p.add_argument("--backends", default="lmdb,mooncake", help="comma list of lmdb, mooncake")
    p.add_argument("--prompt-len", type=cli.positive_int, default=4096, help="tokens of the cold prompt (part 2)")
    p.add_argument("--reps", type=cli.positive_int, default=3, help="cold/warm rounds (part 2)")
    return p


def main(argv=None) -> int:
    """Print both tables (and write them with --json)."""
    a = parser().parse_args(argv)
    names = [b for b in a.backends.split(",") if b]
    bad = [b for b in names if b not in ("lmdb", "mooncake")]
    if bad or not names:
        cli.bad_value("cpattn bench pool", "--backends", repr(a.backends), "a comma list of lmdb, mooncake",
                      "e.g. --backends lmdb")
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's client logs every connection at INFO level
    prompt_len = 1024 if a.quick else a.prompt_len
    reps = 2 if a.quick else a.reps
    from cpattn.bench.pool_blocks import bench_stores, run_bench, table as block_table

    with tempfile.TemporaryDirectory() as tmp, bench_stores(names, tmp) as (pools, specs), harness.Report(a) as out:
        out.progress("part 1: store / load per block")
        blocks = run_bench(pools, block_sizes=(16,) if a.quick else (16, 64, 128), num_layers=61, row_width=576,
                           blocks=2 if a.quick else 8, samples=2 if a.quick else 5)
        out.line("store / load per block (bf16, 61 layers x 576 columns per token: DeepSeek-V3's latent rows)")
        out.line(block_table(blocks))
        ttft = ttft_rows(specs, prompt_len, hidden=128 if a.quick else 256, layers=2 if a.quick else 4, reps=reps,
                         timeout_s=a.timeout)
        out.line(f"\nTTFT of a {prompt_len}-token prompt, cold vs warm (its first 7/8 pooled), block {BLOCK}; "
                 f"best of {reps} interleaved rounds, ratio median [min..max]")
        out.table(ttft, TTFT_COLUMNS)
        out.payload = {"blocks": blocks, "ttft": ttft, "quick": a.quick}
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
