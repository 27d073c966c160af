"""PCP prefill on real gloo ranks vs one rank: exactness, work balance, traffic, time.

Serves both the main job (``cpattn prefill``: small default sizes, checked)
and the benchmark (``cpattn bench pcp``: 16K tokens, 32/8 heads, dim 128,
plus PyTorch's own ring attention on the same inputs). Every rank builds the
same seeded global inputs and takes its shard, so nothing large is pickled.
The one-rank baseline runs on rank 0 inside the same run, interleaved with
the PCP methods (the other ranks wait meanwhile), so every ratio pairs
samples taken side by side.

Usage::

    cpattn prefill                               # 2 ranks, three uneven requests, checked vs one rank
    cpattn prefill --pcp 4 --seq-lens 5000,17 --heads 8 --kv-heads 2
    cpattn bench pcp                             # 16K tokens, P = 2, vs PyTorch's ring attention
    cpattn bench pcp --quick --json -            # 4K tokens; only JSON on stdout
    cpattn bench pcp --seq-lens 8192 --heads 16 --kv-heads 16    # 8K tokens, MHA

``cpattn bench pcp`` also times the demo's whole model (tiny Qwen3) prefilling
one ``--model-prompt-len`` prompt (default 8192) on one rank vs PCP: the
TTFT ratio, side by side.
"""

from __future__ import annotations

import platform
import statistics
from dataclasses import asdict, dataclass

from cpattn.bench import harness
from cpattn.bench.harness import Comparison, Samples
from cpattn.bench.pcp_breakdown import breakdown
from cpattn.bench.pcp_model import model_rank, model_report
from cpattn.config import cli_args as cli

# the default run, and the run the ring targets are stated for (8K tokens, MHA 16 x 128, fp32, P = 2)
FULL_SIZE = dict(pcp=2, seq_lens=(16384,), heads=32, kv_heads=8, head_dim=128)
TARGET_SIZE = dict(pcp=2, seq_lens=(8192,), heads=16, kv_heads=16, head_dim=128)
TARGETS = {"ring_vs_one_rank": 0.53, "ring_vs_torch_ring": 1.0, "model_ttft_vs_one": 0.53}
ONE_RANK_WAIT_S = 1800.0  # collectives' bound: ranks 1.. wait this long at most for rank 0's one-rank run


@dataclass(frozen=True)
class Spec:
    seq_lens: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    reps: int
    seed: int = 0

    def inputs(self):
        import torch

        from cpattn.bench.common import DTYPES
        from cpattn.layout.rows import cu_seqlens  # torch-free parsing: imported where it runs

        g = torch.Generator().manual_seed(self.seed)
        t, dt = sum(self.seq_lens), DTYPES[self.dtype]
        q = torch.randn(t, self.heads, self.head_dim, generator=g).to(dt)
        k = torch.randn(t, self.kv_heads, self.head_dim, generator=g).to(dt)
        v = torch.randn(t, self.kv_heads, self.v_head_dim, generator=g).to(dt)
        cu = torch.tensor(cu_seqlens(self.seq_lens), dtype=torch.int32)
        return q, k, v, cu


def _warm_up(group) -> None:
    """Run every code path once on a tiny batch: kernels, allocator and gloo links are warm."""
    import torch
    from cpattn.layout.pcp import pcp_plan, pcp_shard
    from cpattn.ops import attention_with_lse
    from cpattn.pcp import pcp_prefill

    small = torch.randn(16 * max(group.size, 1), 2, 8)
    plan = pcp_plan([0, small.shape[0]], group.size)
    x = pcp_shard(small, plan, group.rank)
    for method in ("ring", "allgather"):
        pcp_prefill(x, x, x, plan, group=group, method=method)
    cu = torch.tensor([0, small.shape[0]], dtype=torch.int32)
    attention_with_lse(small, small, small, cu, cu, causal=True)


def _torch_ring(group, q, k, v, rotate: str):
    """PyTorch's private ring attention (load-balanced, causal) on the CPU flash op; one request."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cp.set_rotate_method(rotate)
    out, _lse = cp._templated_ring_attention(
        group.pg, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
    )
    return out[0].transpose(0, 1)


def _ranks(group, spec: Spec, methods: tuple[str, ...], peer: bool):
    """Rank function: the one-rank baseline (rank 0) and every PCP method, timed in interleaved rounds."""
    from cpattn.layout.pcp import pcp_plan, pcp_shard
    from cpattn.ops import attention_with_lse
    from cpattn.pcp import pcp_prefill

    _warm_up(group)
    q_all, k_all, v_all, cu = spec.inputs()
    plan = pcp_plan(cu, group.size)
    s = lambda x: pcp_shard(x, plan, group.rank)  # noqa: E731
    q, k, v = s(q_all), s(k_all), s(v_all)
    one = lambda: attention_with_lse(q_all, k_all, v_all, cu, cu, causal=True)[0]  # noqa: E731
    runs = {"one rank": one if group.rank == 0 else (lambda: None)}
    runs.update({m: (lambda m=m: pcp_prefill(q, k, v, plan, group=group, method=m)) for m in methods})
    if peer and len(spec.seq_lens) == 1 and spec.seq_lens[0] % (2 * group.size) == 0 and spec.head_dim == spec.v_head_dim:
        for rotate in ("alltoall", "allgather"):
            runs[f"torch-ring({rotate})"] = lambda r=rotate: _torch_ring(group, q, k, v, r)
    samples = harness.compare(runs, spec.reps, group=group, warmup=0).samples  # interleaved rounds
    sent = {}
    for m in methods:
        group.stats.reset()
        pcp_prefill(q, k, v, plan, group=group, method=m)
        sent[m] = group.stats.total_sent()
    first = samples[methods[0]].result
    diffs = {name: (s.result.double() - first.double()).abs().max().item() if first.numel() else 0.0
             for name, s in samples.items() if name != "one rank"}
    del q_all, k_all, v_all
    return {"samples": {n: Samples(s.wall, s.cpu) for n, s in samples.items()}, "bytes_sent": sent,
            "diffs": diffs, "out": first, "single": samples["one rank"].result if group.rank == 0 else None}


def run(world_size: int, spec: Spec, methods=("ring", "allgather"), peer=False, progress=True,
        timeout_s: float = cli.TIMEOUT_S) -> dict:
    """One rank vs ``world_size`` gloo ranks (one thread each), interleaved; collect every number."""
    import torch
    from cpattn.layout.pcp import causal_pairs, contiguous_causal_pairs, pcp_plan, pcp_unshard

    # while rank 0 alone runs the one-rank baseline the others wait in a barrier: give collectives room
    ranks = _spawn(world_size, _ranks, spec, tuple(methods), peer, timeout_s=timeout_s, progress=progress,
                   label=f"one-rank baseline and {', '.join(methods)}, {spec.reps} rounds")
    plan = pcp_plan(spec.inputs()[3], world_size)
    out = pcp_unshard([r["out"] for r in ranks], plan)
    single = ranks[0]["single"]
    err = (out.double() - single.double()).abs().max().item()
    scale = single.double().abs().max().item()
    flops = lambda pairs: 4 * pairs * spec.heads * spec.head_dim  # noqa: E731
    zig = [flops(causal_pairs(plan, r)) for r in range(world_size)]
    cont = [flops(contiguous_causal_pairs(list(spec.seq_lens), world_size, r)) for r in range(world_size)]
    samples = ranks[0]["samples"]  # already the slowest rank's, sample by sample
    c = Comparison(samples)
    base = samples["one rank"]
    rows = []
    for name, s in samples.items():
        if name == "one rank":
            continue
        r, rc = c.ratio(name, "one rank"), c.ratio(name, "one rank", clock="cpu")
        rows.append({"method": name, "time_s": s.median, "vs_one_rank": r.median, "vs_one_rank_low": r.low,
                     "vs_one_rank_high": r.high, "vs_one_rank_best": r.best, "cpu_vs_one_rank": rc.median,
                     "cpu_vs_one_rank_low": rc.low, "cpu_vs_one_rank_high": rc.high,
                     "bytes_sent_per_rank": max(x["bytes_sent"][name] for x in ranks) if name in methods else "n/a",
                     f"max|diff| vs {methods[0]}": max(x["diffs"][name] for x in ranks)})
    peers = [n for n in samples if n.startswith("torch-ring")]
    vs_peer = None
    if peers and "ring" in samples:  # the fastest peer on each clock (CPU time: robust to a loaded machine)
        best = min(peers, key=lambda n: samples[n].median)
        best_cpu = min(peers, key=lambda n: statistics.median(samples[n].cpu or samples[n].wall))
        vs_peer = {"peer": best, **c.ratio("ring", best).as_dict(),
                   "cpu": {"peer": best_cpu, **c.ratio("ring", best_cpu, clock="cpu").as_dict()}}
    return {
        "spec": asdict(spec), "world_size": world_size, "single_rank_time_s": base.median,
        "ring_vs_torch_ring": vs_peer,
        "single_rank_samples_s": list(base.wall),
        "max_abs_err_vs_single_rank": err, "output_max_abs": scale,
        "flops_per_rank": zig, "flops_max_over_mean": max(zig) / (sum(zig) / len(zig)),
        "contiguous_flops_max_over_mean": max(cont) / (sum(cont) / len(cont)),
        "rows": rows, "torch": torch.__version__, "machine": platform.machine(),
    }


def report(result: dict) -> str:
    s = result["spec"]
    head = (
        f"PCP prefill: {result['world_size']} gloo ranks (1 thread each) vs 1 rank; requests {list(s['seq_lens'])}, "
        f"heads {s['heads']}/{s['kv_heads']}, dims {s['head_dim']}/{s['v_head_dim']}, {s['dtype']}\n"
        f"exactness: max |out - single rank| = {result['max_abs_err_vs_single_rank']:.3g} "
        f"(outputs up to {result['output_max_abs']:.3g})\n"
        f"attention FLOPs per rank: {[f'{f:.3g}' for f in result['flops_per_rank']]}  max/mean = "
        f"{result['flops_max_over_mean']:.4f} (contiguous split: {result['contiguous_flops_max_over_mean']:.4f})\n"
        f"single rank: {result['single_rank_time_s']:.3f} s (median of {s['reps']}); vs_one_rank = median of "
        f"per-round wall ratios [low, high], best = fastest / fastest; CPU time vs one: the slowest rank's process "
        f"CPU time over one rank's (robust to a loaded machine; excludes time spent waiting)\n"
    )
    first = result["rows"][0]["method"]
    shown = [{**r, "vs one rank [low-high]": f"{r['vs_one_rank']:.3g} [{r['vs_one_rank_low']:.3g}-"
              f"{r['vs_one_rank_high']:.3g}]", "best": r["vs_one_rank_best"],
              "CPU time vs one": f"{r['cpu_vs_one_rank']:.3g} [{r['cpu_vs_one_rank_low']:.3g}-"
              f"{r['cpu_vs_one_rank_high']:.3g}]"} for r in result["rows"]]
    cols = ["method", "time_s", "vs one rank [low-high]", "best", "CPU time vs one", "bytes_sent_per_rank",
            f"max|diff| vs {first}"]
    return head + harness.table(shown, cols)


def _spawn(n: int, fn, *args, timeout_s: float, progress: bool, label: str):
    """``fn`` on ``n`` gloo ranks of one thread (:func:`cpattn.bench.harness.ranks`, its progress line on stderr;
    none under ``--no-progress``); collectives may wait :data:`ONE_RANK_WAIT_S` for rank 0's one-rank run."""
    kw = dict(timeout_s=timeout_s, collective_timeout_s=max(timeout_s, ONE_RANK_WAIT_S))
    if progress:
        return harness.ranks(n, fn, *args, label=label, **kw)
    from cpattn.comm.launch import spawn

    return spawn(n, fn, *args, threads=1, **kw)


def parser(prog: str, doc_defaults: dict, quick: str | None = None):
    """The flags of ``cpattn prefill`` and ``cpattn bench pcp`` (``quick``: ``--quick``'s help, bench only)."""
    if quick is not None:
        p = harness.parser(prog, __doc__, quick=quick, timeout=True)
    else:
        p = cli.parser(prog, __doc__)
        cli.add_json(p)
        cli.add_timeout(p)
    cli.add_parallel(p, pcp=doc_defaults["pcp"],
                     helps={"pcp": "PCP ranks: gloo processes, one thread each"})
    p.add_argument("--seq-lens", type=cli.int_list, default=",".join(map(str, doc_defaults["seq_lens"])), metavar="N,N,...",
                   help="new-token count of each request, comma-separated")
    p.add_argument("--heads", type=cli.positive_int, default=doc_defaults["heads"], help="query heads")
    p.add_argument("--kv-heads", type=cli.positive_int, default=doc_defaults["kv_heads"],
                   help="key/value heads (a divisor of --heads)")
    p.add_argument("--head-dim", type=cli.positive_int, default=128, help="query/key head dim")
    p.add_argument("--v-head-dim", type=cli.positive_int, default=None,
                   help="value head dim (default: --head-dim; MLA: 576 / 512)")
    p.add_argument("--method", choices=["ring", "allgather", "both"], default="both", help="PCP schedule(s) to run")
    cli.add_dtype(p)
    p.add_argument("--reps", type=cli.positive_int, default=doc_defaults["reps"],
                   help="interleaved timing rounds (each: one rank, then every method)")
    cli.add_progress(p)
    return p


def _validate(prog: str, a) -> None:
    if a.heads % a.kv_heads:
        divs = [d for d in range(1, a.heads + 1) if a.heads % d == 0]
        cli.bad_value(prog, "--kv-heads", f"{a.kv_heads} with --heads {a.heads}",
                      "--heads is a multiple of --kv-heads (each KV head serves a whole group of query heads)",
                      f"use --kv-heads in {divs}")
    cli.check_engine(prog, pcp_size=a.prefill_context_parallel_size, attention="gqa",
                     num_attention_heads=a.heads, num_kv_heads=a.kv_heads)


def _spec(a) -> Spec:
    return Spec(a.seq_lens, a.heads, a.kv_heads, a.head_dim, a.v_head_dim or a.head_dim, a.dtype, a.reps)


def _methods(a) -> tuple[str, ...]:
    return ("ring", "allgather") if a.method == "both" else (a.method,)


def prefill_main(argv=None) -> int:
    """``cpattn prefill``: the main job. Checks PCP against one rank and prints the numbers; 1 if not exact."""
    prog = "cpattn prefill"
    a = parser(prog, dict(pcp=2, seq_lens=(3072, 1000, 37), heads=8, kv_heads=2, reps=1)).parse_args(argv)
    _validate(prog, a)
    with harness.Report(a) as out:
        result = run(a.prefill_context_parallel_size, _spec(a), _methods(a), peer=False,
                     progress=not a.no_progress, timeout_s=a.timeout)
        out.line(report(result))
        tol = 1e-4 if a.dtype in ("float32", "float64") else 5e-2
        ok = result["max_abs_err_vs_single_rank"] <= tol * max(1.0, result["output_max_abs"])
        result["exact"] = ok
        out.line(f"\nexact vs single rank (tolerance {tol:g}): {'yes' if ok else 'NO'}")
        out.payload = result
    return 0 if ok else 1


def _targets_apply(a) -> bool:
    return ((a.prefill_context_parallel_size, a.seq_lens, a.heads, a.kv_heads, a.head_dim) == tuple(TARGET_SIZE.values())
            and a.dtype == "float32")


def bench_main(argv=None) -> int:
    """``cpattn bench pcp``: 16K-token causal GQA prefill, ours (ring, all-gather) vs PyTorch's ring attention."""
    prog = "cpattn bench pcp"
    p = parser(prog, dict(pcp=FULL_SIZE["pcp"], seq_lens=FULL_SIZE["seq_lens"], heads=FULL_SIZE["heads"],
                          kv_heads=FULL_SIZE["kv_heads"], reps=3),
               quick="4K tokens instead of 16K, 2K-token model prompt (the targets apply to the full-size run only)")
    p.add_argument("--model-prompt-len", type=cli.nonnegative_int, default=8192,
                   help="tokens of the demo model's prompt for the whole-model TTFT part (0: skip it)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip timing the pieces of a ring rank's work one by one (P = 2, one request)")
    a = p.parse_args(argv)
    if a.quick:
        a.seq_lens = (4096,)
        a.model_prompt_len = min(a.model_prompt_len, 2048)
    _validate(prog, a)
    with harness.Report(a) as out:
        result = run(a.prefill_context_parallel_size, _spec(a), _methods(a), peer=True,
                     progress=not a.no_progress, timeout_s=a.timeout)
        out.line(report(result))
        ring = next((r for r in result["rows"] if r["method"] == "ring"), None)
        peer = result["ring_vs_torch_ring"]
        if ring and peer:
            line = (f"\nring vs one rank: {ring['vs_one_rank']:.3f}x [{ring['vs_one_rank_low']:.3f}-"
                    f"{ring['vs_one_rank_high']:.3f}]; ring vs {peer['peer']}: {peer['median']:.3f}x "
                    f"[{peer['low']:.3f}-{peer['high']:.3f}]; in CPU time: ring vs one rank {ring['cpu_vs_one_rank']:.3f}x "
                    f"[{ring['cpu_vs_one_rank_low']:.3f}-{ring['cpu_vs_one_rank_high']:.3f}], ring vs "
                    f"{peer['cpu']['peer']}: {peer['cpu']['median']:.3f}x [{peer['cpu']['low']:.3f}-"
                    f"{peer['cpu']['high']:.3f}] (median [low-high] of per-round ratios)")
            if _targets_apply(a):
                line += f"; targets: <= {TARGETS['ring_vs_one_rank']} and <= {TARGETS['ring_vs_torch_ring']}"
            else:
                line += (f"\n(the targets <= {TARGETS['ring_vs_one_rank']}x one rank and "
                         f"<= {TARGETS['ring_vs_torch_ring']}x PyTorch's ring are for the run "
                         f"--seq-lens {TARGET_SIZE['seq_lens'][0]} --heads {TARGET_SIZE['heads']} --kv-heads "
                         f"{TARGET_SIZE['kv_heads']}: P = {TARGET_SIZE['pcp']}, head dim {TARGET_SIZE['head_dim']}, fp32)")
            out.line(line)
            result["targets_apply"] = _targets_apply(a)
        if a.breakdown and len(a.seq_lens) == 1 and a.prefill_context_parallel_size == 2:
            result["breakdown"] = breakdown(_spec(a), a.reps)
            out.line("\nwhere a P = 2 ring rank's time goes (one process, each piece alone, CPU ms, best of "
                     f"{a.reps} interleaved rounds; of one rank = piece / the one-rank call):")
            out.table(result["breakdown"], ["piece", "cpu_ms", "of_one_rank"])
            for r in range(2):
                tot = sum(x["of_one_rank"] for x in result["breakdown"] if x["piece"].startswith(f"rank {r}"))
                out.line(f"rank {r}: the pieces sum to {tot:.3f} of one rank (before the transfer and the other "
                         "rank's load on the shared cores)")
        if a.model_prompt_len:
            method = _methods(a)[0]
            res = _spawn(a.prefill_context_parallel_size, model_rank, a.model_prompt_len, a.reps, method,
                         timeout_s=a.timeout, progress=not a.no_progress,
                         label=f"the demo model's {a.model_prompt_len}-token prefill, one rank vs PCP")[0]
            result["model"] = model_report(res, a.model_prompt_len, a.prefill_context_parallel_size, method)
            out.line(f"target: <= {TARGETS['model_ttft_vs_one']} of one rank at 8192 tokens")
        out.payload = result
    return 0
