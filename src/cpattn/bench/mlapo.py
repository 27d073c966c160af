"""Benchmark: MLAPO -- a DeepSeek decode step with and without the fused MLA preprocessing op, side by side.

The model is DeepSeek-V3's attention at one TP-rank's share (hidden 7168,
16 of its 128 query heads, q LoRA 1536, kv LoRA 512, rope 64, nope / v
128) with a small dense MLP, so the preprocessing chain is a visible part
of the step. Per DCP size (1 and 2, gloo processes of one thread), a batch
of requests with ``--context`` cached tokens each decodes one token per
step through the engine's DCP step, four ways, in interleaved rounds
(each sample the slowest rank's):

- eager, unfused: :func:`cpattn.models.deepseek_v3.mla_project` then the
  step writes the latent rows (``mla_preprocess=False``);
- eager, fused: :func:`cpattn.ops.mla_preprocess` projects and writes;
- the same two captured (:class:`cpattn.graphs.DecodeRunner`, graph
  backend ``--graph-backend``, default the CPU compiler).

Ratios are fused / unfused step time: median [low-high] of the per-round
ratios. On the CPU the fused op runs the models' own chain, so the
captured ratio shows what fusing costs or saves in the graph; the gain the
op exists for is the Ascend kernel's (``npu_mla_prolog_v3``), not measured
here. The logits of the fused and unfused steps are compared (bitwise).

Usage::

    cpattn bench mlapo               # context 4096, batch 4, bf16, DCP 1 and 2
    cpattn bench mlapo --quick       # context 512, the eager graph runner, < 60 s
    cpattn bench mlapo --json -      # only JSON on stdout
"""

from __future__ import annotations

import dataclasses

from cpattn.bench import harness
from cpattn.bench.harness import Samples
from cpattn.config import cli_args as cli

VARIANTS = ("eager_unfused", "eager_fused", "graph_unfused", "graph_fused")


def model_config(layers: int):
    """DeepSeek-V3 attention dims at one TP rank's 16 heads, a dense MLP of 1024, vocab 2048."""
    from cpattn.models.deepseek_v3 import DeepseekV3Config

    return DeepseekV3Config.tiny(
        vocab_size=2048, hidden_size=7168, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=16, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0,
        mlp_layer_types=("dense",) * layers)


def step_rank(group, cfg: dict) -> dict:
    """One DCP rank: the four step variants timed in interleaved rounds; the logits of each kept."""
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.engine.decode import decode_step, make_runner
    from cpattn.engine.paged_cache import PagedShard
    from cpattn.models import deepseek_v3

    fam, dtype = deepseek_v3.FAMILY, DTYPES[cfg["dtype"]]
    mcfg = model_config(cfg["layers"])
    params = fam.init_params(mcfg, seed=0, std=0.02, dtype=dtype)
    b, ctx = cfg["batch"], cfg["context"]

    def shard():  # every request holds ctx cached latent rows (random, as if prefilled; the same in every
        gen = torch.Generator().manual_seed(7 + group.rank)  # variant), room for one more
        sh = PagedShard.empty(fam.kv_layouts(mcfg), capacity=[ctx + 1] * b, dcp_size=group.size, block_size=128,
                              interleave_size=1, dtype=dtype)
        for k in sh.k:
            k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        return sh

    tokens = torch.arange(b) * 13 % mcfg.vocab_size
    runs = {}
    for fused in (False, True):
        c = dataclasses.replace(mcfg, mla_preprocess=fused)
        tag = "fused" if fused else "unfused"
        sh = shard()
        batch = {"tokens": tokens, "seq_lens": torch.full((b,), ctx + 1), "block_table": sh.block_table}
        eager_batch = {**batch, "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32)}
        runs[f"eager_{tag}"] = (lambda s=sh, c=c, bb=eager_batch: decode_step(
            {"params": params, "shard": s}, bb, family=fam, cfg=c, group=group, merge="local_ag")[0])
        gs = shard()
        runner = make_runner(group, fam, params, c, gs, num_speculative_tokens=0, max_requests=b, merge="local_ag",
                             capture_sizes=[b], backend=cfg["graph_backend"])
        gbatch = {**batch, "block_table": gs.block_table}
        runs[f"graph_{tag}"] = (lambda r=runner, bb=gbatch: r(bb, [1] * b)[0])
    samples = harness.compare(runs, cfg["reps"], group=group, inner=cfg["inner"], warmup=2).samples
    logits = {k: s.result for k, s in samples.items()}
    return {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()},
            "same_eager": bool(torch.equal(logits["eager_fused"], logits["eager_unfused"])),
            "same_graph": bool(torch.equal(logits["graph_fused"], logits["graph_unfused"]))}


def _parser():
    p = harness.parser("cpattn bench mlapo", __doc__, timeout=900.0,
                       quick="context 512, batch 2, 3 rounds, the eager graph runner (no compiler), < 60 s")
    p.add_argument("--context", type=cli.positive_int, default=4096, help="cached tokens per request")
    p.add_argument("--batch", type=cli.positive_int, default=4, help="decode requests")
    p.add_argument("--layers", type=cli.positive_int, default=2, help="decoder layers")
    p.add_argument("--dcp-sizes", type=cli.int_list, default="1,2", metavar="N,...",
                   help="DCP sizes to run (gloo processes, one thread each)")
    cli.add_dtype(p, default="bfloat16", help="weights, activations and KV cache")
    p.add_argument("--graph-backend", default="cpu", metavar="NAME",
                   help="graph backend of the captured steps (cpattn.graphs.backends(): cpu, aot_eager, eager)")
    p.add_argument("--reps", type=cli.positive_int, default=5, help="interleaved timing rounds")
    return p


def main(argv=None) -> int:
    """Run the MLAPO benchmark and print the fused / unfused step-time ratios."""
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.batch, args.reps, args.graph_backend = 512, 2, min(args.reps, 3), "eager"
    cli.check_backend(p.prog, "--graph-backend", args.graph_backend)
    for n in args.dcp_sizes:  # the model's 16 heads and one latent KV head: any DCP size dividing 16
        cli.check_engine(p.prog, {"dcp_size": "--dcp-sizes", "tp_size": "--dcp-sizes"}, tp_size=n, dcp_size=n,
                         attention="mla", num_attention_heads=16, num_kv_heads=1, tp_splits_kv_heads=False,
                         block_size=128, cp_kv_cache_interleave_size=1)
    cfg = dict(context=args.context, batch=args.batch, layers=args.layers, dtype=args.dtype, reps=args.reps,
               inner=3, graph_backend=args.graph_backend)
    rows, shown = [], []
    with harness.Report(args) as out:
        for n in args.dcp_sizes:
            res = harness.ranks(n, step_rank, cfg, timeout_s=args.timeout, label=f"DCP {n}, four step variants")[0]
            s = res["samples"]
            for mode in ("eager", "graph"):
                x = harness.Comparison(s).ratio(f"{mode}_fused", f"{mode}_unfused")
                same = res[f"same_{mode}"]
                shown.append({"dcp": n, "mode": mode, "unfused ms": 1e3 * s[f"{mode}_unfused"].median,
                              "fused ms": 1e3 * s[f"{mode}_fused"].median, "x fused/unfused": str(x),
                              "bitwise": same})
                rows.append({"dcp": n, "mode": mode, "unfused_ms": s[f"{mode}_unfused"].as_dict(),
                             "fused_ms": s[f"{mode}_fused"].as_dict(), "fused_over_unfused": x.as_dict(),
                             "bitwise_equal_logits": same})
        out.line(f"MLAPO: DeepSeek-V3 attention at 16 heads (hidden 7168, q LoRA 1536, kv LoRA 512 + rope 64), "
                 f"{args.layers} layers, batch {args.batch}, context {args.context}, {args.dtype}; graph backend "
                 f"{args.graph_backend}; {args.reps} interleaved rounds of {cfg['inner']} steps (slowest rank). "
                 "x = fused / unfused step time: median [low-high] of per-round ratios")
        out.table(shown, ["dcp", "mode", "unfused ms", "fused ms", "x fused/unfused", "bitwise"])
        out.line(f"({out.elapsed:.0f} s)")
        out.payload = {"config": cfg, "rows": rows}
    return 0 if all(r["bitwise_equal_logits"] for r in rows) else 1
