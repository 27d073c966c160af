"""``cpattn plan calibrate``: fit the CPU profile from microbenchmarks on this machine.

One process (one thread, as every benchmark rank runs) times:

- a fp32 matmul (the "gemm" peak) and a 64 MB copy (memory bandwidth);
- the attention kernel through ``attention_with_lse``: a causal square block,
  an unmasked block (MHA) and an unmasked GQA block (the kernel folds query
  heads into rows), each turned into an achieved fraction of the gemm peak;
- paged decode attention in bf16 (bytes of KV read per second);
- attention on head-major storage (how the PCP ring lays out K/V and q) vs
  token-major (what a caller passes);
- a transposing copy (PCP's head-major packing) and a merge (elementwise);
- the per-op cost of eager dispatch: small aten ops alone, and cpattn's own
  eager code (one step of the demo decode program on one rank, over the
  ops it dispatches: custom-op dispatch and host-side work included); and (unless ``quick``)
  the per-call and per-kernel costs of an inductor-compiled program.

Two gloo ranks then time the collectives the code uses: one
``all_to_all_single`` (cpattn's small-message path on gloo) and the ring
exchange (``batch_isend_irecv``) at several sizes, each fitted to
``alpha + bytes / beta`` by least squares; and a ring exchange running while
the rank computes, giving the fraction of a transfer compute hides on these
cores (``overlap``); and a copy and a matmul on every rank at once vs on one
rank alone (the memory bandwidth and compute each rank keeps when all are
busy: the ranks share this machine's cores and memory).

Every timing is the median of interleaved rounds (:func:`cpattn.bench.common.measure`).
"""

from __future__ import annotations

import time

import torch

from cpattn.bench.common import measure
from cpattn.plan.profiles import CPU_DEFAULT, Link, Profile


def _median(fn, reps: int, inner: int = 1) -> float:
    return measure({"f": fn}, reps, inner=inner, warmup=1)["f"].median


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + bytes / beta`` over (bytes, seconds) points; alpha >= 0, beta > 0.

    >>> a, b = fit_alpha_beta([(0, 1e-4), (1e6, 1.1e-3), (2e6, 2.1e-3)])
    >>> round(a * 1e6), round(b / 1e9, 2)
    (100, 1.0)
    """
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


# ----------------------------------------------------------------------------- one process
def _attention_rate(t: int, heads: int, kv_heads: int, causal: bool, reps: int, head_major: bool = True) -> float:
    """Achieved FLOP/s of attention_with_lse on one block (pairs counted exactly); ``head_major``: q, k, v
    stored head by head (as the PCP ring lays them out), else token-major (as a caller passes them)."""
    from cpattn.ops import attention_with_lse
    from cpattn.plan.costs import attention_flops, causal_pairs

    g = torch.Generator().manual_seed(0)
    lq = t if causal else t // 2

    def make(n, h):
        x = torch.randn(n, h, 128, generator=g)
        return x.transpose(0, 1).contiguous().transpose(0, 1) if head_major else x

    q, k, v = make(lq, heads), make(t, kv_heads), make(t, kv_heads)
    cq, ck = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32)
    sec = _median(lambda: attention_with_lse(q, k, v, cq, ck, causal=causal), reps)
    return attention_flops(causal_pairs(lq, t, causal), heads, 128, 128) / sec


def _paged_rate(ctx: int, reps: int) -> float:
    """KV bytes per second read by bf16 paged decode (batch 2, GQA 32 / 8 heads x 128, block 128)."""
    from cpattn.ops.paged import paged_attention_with_lse

    b, hq, hkv, d, bs = 2, 32, 8, 128, 128
    nb = b * ctx // bs
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    vc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    table = torch.arange(nb).view(b, -1)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    req, lens = torch.arange(b), torch.full((b,), ctx, dtype=torch.int32)
    sec = _median(lambda: paged_attention_with_lse(q, kc, vc, table, req, lens), reps)
    return b * ctx * hkv * d * 2 * 2 / sec


def _eager_op_cost(reps: int) -> tuple[float, float]:
    """Seconds per small aten op dispatched eagerly (a mix of pointwise, index and matmul ops), and per view."""
    x = torch.randn(8, 64)
    w = torch.randn(64, 64)
    idx = torch.tensor([0, 3, 5])

    def ops():
        for _ in range(20):
            y = x + 1.0
            y = y * x
            y = torch.mm(y, w)
            y = y.index_select(0, idx)
            torch.cat([y, y])

    def views():
        for _ in range(50):
            x.view(64, 8).transpose(0, 1)[1:]

    return _median(ops, reps) / 100, _median(views, reps) / 150


def _eager_program_op_cost(reps: int, view_cost: float) -> float:
    """Seconds per aten op of cpattn's eager code: one eager step of the demo decode program on one rank
    (no collectives: a group of one), over the number of ops it dispatches (traced)."""
    from cpattn.comm.sim import SimMesh
    from cpattn.graphs import demo_program as dp
    from cpattn.plan.validate import count_ops

    cfg = dp.ProgramConfig(num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                           max_blocks=4, num_blocks=16)
    state = dp.init_state(cfg, dp.init_params(cfg), poison=0.0)
    step = dp.make_step(cfg, SimMesh(1).groups()[0])
    batch = {"x": torch.randn(4, cfg.hidden), "seq_lens": torch.full((4,), 40),
             "block_table": torch.arange(16).view(4, 4), "cu_seqlens_q": torch.arange(5, dtype=torch.int32)}
    ops = count_ops(lambda: step(state, batch))
    sec = _median(lambda: step(state, batch), reps, inner=5)
    return max(sec - ops["views"] * view_cost, 0.0) / ops["ops"]


def _graph_costs(reps: int) -> tuple[float, float]:
    """(seconds per call, seconds per kernel) of an inductor-compiled program: chains of 8 and 40 tiny
    matmuls (each its own kernel), fitted to ``call + kernels * per_kernel``."""
    w = torch.randn(16, 16)

    def chain(n):
        def fn(x):
            for _ in range(n):
                x = torch.mm(x, w)
            return x

        return torch.compile(fn, backend="inductor", fullgraph=True)

    x = torch.randn(4, 16)
    short, long = chain(8), chain(40)
    short(x), long(x)
    s = measure({"short": lambda: short(x), "long": lambda: long(x)}, reps, inner=20, warmup=1)
    per_kernel = max((s["long"].median - s["short"].median) / 32, 0.0)
    return max(s["short"].median - 8 * per_kernel, 0.0), per_kernel


def compute_part(quick: bool = False) -> dict:
    """The single-process microbenchmarks (module doc); rates in FLOP/s and bytes/s, costs in seconds."""
    reps = 3 if quick else 5
    a = torch.randn(512, 512)
    gemm = 2 * 512**3 / _median(lambda: a @ a, reps, inner=4)
    big = torch.randn(16 << 20)
    copy_bw = 2 * big.nbytes / _median(lambda: big.clone(), reps)
    t3 = torch.randn(2048, 16, 128)
    trans_bw = 2 * t3.nbytes / _median(lambda: t3.transpose(0, 1).contiguous(), reps)
    t = 512 if quick else 2048
    out = {
        "gemm": gemm, "copy_bw": copy_bw, "transpose_bw": trans_bw,
        "attention_causal": _attention_rate(t, 8, 8, True, reps, head_major=False),
        "attention_causal_hm": _attention_rate(t, 8, 8, True, reps),
        "attention": _attention_rate(t, 8, 8, False, reps),
        "attention_gqa": _attention_rate(t, 8, 2, False, reps),
        "decode_attention_bw": _paged_rate(1024 if quick else 8192, reps),
    }
    out["simple_op"], out["eager_view"] = _eager_op_cost(reps)
    out["eager_op"] = _eager_program_op_cost(reps, out["eager_view"])
    out["graph_call"], out["graph_kernel"] = (None, None) if quick else _graph_costs(reps)
    return out


# ----------------------------------------------------------------------------- two gloo ranks
def comm_rank(group, sizes_a2a, sizes_ring, reps, overlap_bytes):
    """Rank function: gloo all_to_all_single and ring-exchange times per size, and the overlapped ring."""
    res = {"a2a": [], "ring": []}
    for nbytes in sizes_a2a:
        x = torch.zeros(max(2, nbytes // 4 // 2 * 2))
        s = measure({"x": lambda: group.all_to_all(x)}, reps, group=group, inner=10, warmup=2)["x"]
        res["a2a"].append((x.nbytes * (group.size - 1) / group.size, s.median))
    for nbytes in sizes_ring:
        x = torch.zeros(nbytes // 4)
        s = measure({"x": lambda: group.ring_exchange(x, x.shape).wait()}, reps, group=group, inner=3, warmup=1)["x"]
        res["ring"].append((x.nbytes, s.median))
    a = torch.randn(384, 384)
    x = torch.zeros(overlap_bytes // 4)

    def compute():
        for _ in range(40):
            a @ a

    def both():
        pending = group.ring_exchange(x, x.shape)
        compute()
        pending.wait()

    s = measure({"compute": compute, "ring": lambda: group.ring_exchange(x, x.shape).wait(), "both": both}, reps,
                group=group, warmup=1)
    res["overlap"] = {k: v.median for k, v in s.items()}
    # every rank busy at once vs rank 0 alone: shared memory bandwidth and shared cores
    big = torch.randn(8 << 20)
    noop = lambda: None  # noqa: E731
    runs = {"copy_alone": (lambda: big.clone()) if group.rank == 0 else noop, "copy_all": lambda: big.clone(),
            "mm_alone": compute if group.rank == 0 else noop, "mm_all": compute}
    s = measure(runs, reps, group=group, warmup=1)
    res["concurrent"] = {"bandwidth": s["copy_alone"].median / s["copy_all"].median,
                         "compute": s["mm_alone"].median / s["mm_all"].median}
    return res


def comm_part(quick: bool = False, timeout_s: float = 300.0) -> dict:
    """Fit alpha / beta of gloo's all-to-all and ring exchange, and the overlap fraction, on 2 ranks."""
    from cpattn.comm.launch import spawn

    reps = 3 if quick else 9
    sizes_a2a = [256, 16384, 1 << 20] if quick else [256, 4096, 32768, 262144, 1 << 20, 4 << 20]
    sizes_ring = [1 << 16, 4 << 20] if quick else [1 << 16, 1 << 20, 8 << 20, 32 << 20]
    res = spawn(2, comm_rank, sizes_a2a, sizes_ring, reps, (2 if quick else 8) << 20, threads=1,
                timeout_s=timeout_s)[0]
    a2a = fit_alpha_beta(res["a2a"])
    ring = fit_alpha_beta(res["ring"])
    o = res["overlap"]
    hidden = (o["compute"] + o["ring"] - o["both"]) / max(min(o["compute"], o["ring"]), 1e-12)
    return {"a2a": a2a, "ring": ring, "overlap": min(1.0, max(0.0, hidden)), "concurrent": res["concurrent"],
            "raw": res}


def calibrate(quick: bool = False, timeout_s: float = 300.0) -> Profile:
    """Measure this machine and return its CPU :class:`Profile` (see module doc)."""
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every benchmark rank runs
    try:
        c = compute_part(quick)
    finally:
        torch.set_num_threads(threads)
    m = comm_part(quick, timeout_s)
    gemm = c["gemm"]
    eff = {"gemm": 1.0, "attention_causal": c["attention_causal"] / gemm,
           "attention_causal_hm": c["attention_causal_hm"] / gemm, "attention": c["attention"] / gemm,
           "attention_gqa": c["attention_gqa"] / gemm, "decode_attention": c["decode_attention_bw"] / c["copy_bw"],
           "transpose": c["transpose_bw"] / c["copy_bw"], "elementwise": 1.0,
           "concurrent_bandwidth": min(1.0, m["concurrent"]["bandwidth"]),
           "concurrent_compute": min(1.0, m["concurrent"]["compute"])}
    a2a, ring = m["a2a"], m["ring"]
    launch = {"eager": c["eager_op"], "view": c["eager_view"],
              "graph": c["graph_kernel"] if c["graph_kernel"] is not None else CPU_DEFAULT.launch["graph"],
              "graph_call": c["graph_call"] if c["graph_call"] is not None else CPU_DEFAULT.launch["graph_call"]}
    when = time.strftime("%Y-%m-%d %H:%M")
    return Profile(
        name="cpu", device=f"this machine's CPU (calibrated {when}), one thread per rank, gloo over loopback",
        flops={"fp32": gemm, "bf16": gemm, "fp16": gemm}, mem_bw=c["copy_bw"], mem_bytes=CPU_DEFAULT.mem_bytes,
        devices_per_node=2,
        links={"intra": Link(a2a[0], a2a[1]), "a2a": Link(a2a[0], a2a[1]),
               "ring": Link(ring[0], ring[1], overlap=m["overlap"]), "native": Link(ring[0], ring[1])},
        efficiency=eff, launch=launch,
        sources={"all": f"cpattn plan calibrate{' --quick' if quick else ''} on {when}, {time.time() - t0:.0f} s; "
                        f"medians of interleaved rounds; collectives fitted over "
                        f"{len(m['raw']['a2a'])} + {len(m['raw']['ring'])} sizes",
                 "raw": str({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()})},
    )


def summary(p: Profile) -> str:
    """A few lines describing a calibrated profile."""
    e, ln = p.efficiency, p.links
    return "\n".join([
        f"CPU profile: {p.device}",
        f"  gemm {p.flops['fp32'] / 1e9:.1f} GFLOP/s; copy {p.mem_bw / 1e9:.2f} GB/s; attention causal "
        f"{e['attention_causal']:.2f}, unmasked {e['attention']:.2f}, GQA-folded {e.get('attention_gqa', 0):.2f} "
        f"of gemm; bf16 paged decode {e['decode_attention']:.2f} of copy bandwidth",
        f"  gloo all-to-all: alpha {ln['a2a'].alpha * 1e6:.0f} us, beta {ln['a2a'].beta / 1e9:.2f} GB/s; ring "
        f"exchange: alpha {ln['ring'].alpha * 1e6:.0f} us, beta {ln['ring'].beta / 1e9:.2f} GB/s, "
        f"{ln['ring'].overlap:.0%} hidden behind compute",
        f"  with every rank busy each keeps {e.get('concurrent_bandwidth', 1):.0%} of the memory bandwidth and "
        f"{e.get('concurrent_compute', 1):.0%} of the compute rate",
        f"  eager op {p.launch['eager'] * 1e6:.1f} us, view {p.launch.get('view', 0) * 1e6:.1f} us; compiled program "
        f"{p.launch.get('graph_call', 0) * 1e6:.0f} us per call + {p.launch['graph'] * 1e6:.1f} us per kernel",
    ])

