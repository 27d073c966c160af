"""``cpattn plan calibrate``: fit the CPU profile from microbenchmarks on this machine.

One process (one thread, as every benchmark rank runs) times, in interleaved
rounds and in process CPU time (a job that shares the cores slices the wall
clock, not the CPU time a kernel needs):

- a fp32 matmul (the "gemm" peak), a 64 MB copy (memory bandwidth: a
  fresh buffer, so its first-touch page faults count, as they do for every
  tensor a kernel returns), a transposing copy (PCP's head-major packing)
  and an in-place update of a 64 MB buffer (``lerp_``: no fresh memory, the
  LSE merge's pattern);
- the attention kernel through ``attention_with_lse`` at two sizes each
  (:data:`ATTN_SIZES`): causal on token-major inputs (what a caller passes),
  causal and unmasked on head-major storage (what the PCP ring builds), and
  unmasked GQA (one size); each turned into an achieved fraction of the gemm
  rate *per pair the kernel computes* (:func:`cpattn.plan.costs.flash_tile_pairs`:
  aten's CPU flash kernel computes whole key tiles on the causal diagonal,
  1.5x the exact pairs at 1024 tokens, 1.06x at 8192), kept as a curve over
  size that predictions interpolate (``Profile.curves``);
- paged decode attention in bf16 (bytes of KV read per second);
- the per-op cost of eager dispatch: small aten ops alone, and cpattn's own
  eager code (one step of the demo decode program at ``cpattn bench graph``'s
  default widths, batch 1, on one rank: a group of one, no collectives, over
  the ops it dispatches: custom-op dispatch and host-side work included); and
  (unless ``quick``) the per-call and per-kernel costs of an inductor-compiled
  program.

Two gloo ranks then time the collectives the code uses: one
``all_to_all_single`` (cpattn's small-message path on gloo) and the ring
exchange (``batch_isend_irecv``) at several sizes, each fitted to
``alpha + bytes / beta`` by least squares, in wall time and in process CPU
time (gloo's loopback transfer and its polling are CPU work of the process);
a ring exchange running while the rank computes, giving the fraction of a
transfer compute hides on these cores (``overlap``); a collective reached
from about half a millisecond of host work vs from another collective (the
``cold`` extra of an eager step's collectives); and three kernels on both
ranks at once vs on one rank alone, in both clocks: the attention kernel
(the share of the compute each PCP rank keeps), bf16 paged decode (the share
of the memory bandwidth each DCP rank's decode keeps: the two readers share
one memory bus) and a plain copy.

Every timing is the median of interleaved rounds (:func:`cpattn.bench.common.measure`);
shares are medians of per-round ratios (:func:`cpattn.bench.common.ratio`).
"""

from __future__ import annotations

import statistics
import time

import torch

from cpattn.bench.common import measure
from cpattn.bench.perf.calibrate_comm import _host_work, comm_part, comm_rank  # noqa: F401 (re-exported)
from cpattn.plan.costs import flash_tile_pairs, legacy_pair_factor
from cpattn.plan.profiles import CPU_DEFAULT, LEGACY_ATTN_TOKENS, Link, Profile, interpolate

# (tokens, heads) of the two attention sizes: the long one with fewer heads keeps the rounds short
ATTN_SIZES = {"full": ((1024, 8), (4096, 2)), "quick": ((512, 8), (1024, 4))}


def _cpu(s) -> float:
    """Median process CPU seconds of one :class:`~cpattn.bench.common.Samples`."""
    return statistics.median(s.cpu)


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``t = alpha + bytes / beta`` over (bytes, seconds) points, least squares in *relative* error
    (weights 1 / t^2); alpha >= 0, beta > 0.

    Timings spread over three decades of size; a plain fit lets the largest messages' noise set the
    intercept (a 10% wobble at 4 MB moves alpha by more than alpha itself), a relative fit lets every
    size count alike, so alpha comes from the small messages and beta from the large ones.

    >>> a, b = fit_alpha_beta([(0, 1e-4), (1e6, 1.1e-3), (2e6, 2.1e-3)])
    >>> round(a * 1e6), round(b / 1e9, 2)
    (100, 1.0)
    >>> a, _ = fit_alpha_beta([(256, 5e-4), (4096, 5e-4), (4e6, 6e-3), (8e6, 1.3e-2)])  # small messages: 500 us
    >>> round(a * 1e6)  # (a plain least-squares fit: 361)
    496
    """
    w = [1.0 / max(y, 1e-12) ** 2 for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


# ----------------------------------------------------------------------------- one process
def attention_case(kind: str, t: int, heads: int, seed: int = 0):
    """(call, processed FLOPs, size) of one ``attention_with_lse`` block of calibration case ``kind``.

    kind: "attention_causal" (causal t x t, token-major q / k / v), "attention_causal_hm" (the same on
    head-major storage), "attention" (unmasked t/2 x t, head-major), "attention_gqa" (as "attention"
    with heads / 4 KV heads). FLOPs count the pairs the kernel computes
    (:func:`~cpattn.plan.costs.flash_tile_pairs`); size is ``sqrt(lq * lk)``, the key of
    ``Profile.curves``.

    >>> call, flops, size = attention_case("attention", 64, 2)
    >>> call()[0].shape, flops, size
    (torch.Size([32, 2, 128]), 2097152.0, 45.254833995939045)
    """
    from cpattn.ops import attention_with_lse
    from cpattn.plan.costs import attention_flops

    g = torch.Generator().manual_seed(seed)
    causal = kind.startswith("attention_causal")
    head_major = kind != "attention_causal"
    kv_heads = max(1, heads // 4) if kind == "attention_gqa" else heads
    lq = t if causal else t // 2

    def make(n, h):
        x = torch.randn(n, h, 128, generator=g)
        return x.transpose(0, 1).contiguous().transpose(0, 1) if head_major else x

    q, k, v = make(lq, heads), make(t, kv_heads), make(t, kv_heads)
    cq, ck = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32)
    flops = attention_flops(flash_tile_pairs(lq, t, causal), heads, 128, 128)
    return (lambda: attention_with_lse(q, k, v, cq, ck, causal=causal)), flops, (lq * t) ** 0.5


def _paged_case(ctx: int, seed: int = 1):
    """(call, KV bytes read) of bf16 paged decode: batch 2, GQA 32 / 8 heads x 128, block 128."""
    from cpattn.ops.paged import paged_attention_with_lse

    b, hq, hkv, d, bs = 2, 32, 8, 128, 128
    nb = b * ctx // bs
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    vc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    table = torch.arange(nb).view(b, -1)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    req, lens = torch.arange(b), torch.full((b,), ctx, dtype=torch.int32)
    return (lambda: paged_attention_with_lse(q, kc, vc, table, req, lens)), b * ctx * hkv * d * 2 * 2


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

    s = measure({"ops": ops, "views": views}, reps, warmup=1)
    return _cpu(s["ops"]) / 100, _cpu(s["views"]) / 150


# the demo program's widths in `cpattn bench graph` (its defaults), 2 layers, one request
def _eager_program_op_cost(reps: int, view_cost: float, context: int = 128) -> float:
    """Seconds per aten op of cpattn's eager code: one eager decode step of the demo program at
    ``cpattn bench graph``'s widths (2 layers, batch 1, ``context`` cached tokens) on one rank (a group of
    one: no collectives), less its views, over the number of ops it dispatches (traced)."""
    from cpattn.comm.sim import SimMesh
    from cpattn.plan.opcount import count_ops, demo_step

    step, state, batch = demo_step(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32, context=context, batch=1,
                                   dcp=1, group=SimMesh(1).groups()[0])
    ops = count_ops(lambda: step(state, batch))
    sec = _cpu(measure({"f": lambda: step(state, batch)}, reps, inner=5, warmup=1)["f"])
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
    per_kernel = max((_cpu(s["long"]) - _cpu(s["short"])) / 32, 0.0)
    return max(_cpu(s["short"]) - 8 * per_kernel, 0.0), per_kernel


ATTN_KINDS = ("attention_causal", "attention_causal_hm", "attention", "attention_gqa")


def compute_part(quick: bool = False) -> dict:
    """The single-process microbenchmarks (module doc); rates in FLOP/s and bytes/s, costs in seconds,
    ``curves``: attention kind -> [[size, achieved fraction of the gemm rate per computed pair], ...]."""
    reps = 3 if quick else 5
    a = torch.randn(512, 512)
    big, acc = torch.randn(16 << 20), torch.randn(16 << 20)
    t3 = torch.randn(2048, 16, 128)
    fns = {"gemm": lambda: [a @ a for _ in range(4)], "copy": lambda: big.clone(),
           "transpose": lambda: t3.transpose(0, 1).contiguous(), "update": lambda: acc.lerp_(big, 0.5)}
    work = {}
    for i, (t, h) in enumerate(ATTN_SIZES["quick" if quick else "full"]):
        for kind in ATTN_KINDS:
            if kind == "attention_gqa" and i:  # GQA at one size (the validated PCP case is MHA)
                continue
            fns[(kind, i)], flops, size = attention_case(kind, t, h)
            work[(kind, i)] = (flops, size)
    paged, kv_bytes = _paged_case(1024 if quick else 8192)
    fns["paged"] = paged
    s = measure(fns, reps, warmup=1)
    gemm = 4 * 2 * 512**3 / _cpu(s["gemm"])
    curves = {}
    for (kind, i), (flops, size) in work.items():
        curves.setdefault(kind, []).append([size, flops / _cpu(s[(kind, i)]) / gemm])
    out = {"gemm": gemm, "copy_bw": 2 * big.nbytes / _cpu(s["copy"]),
           "transpose_bw": 2 * t3.nbytes / _cpu(s["transpose"]), "update_bw": 3 * big.nbytes / _cpu(s["update"]),
           "decode_attention_bw": kv_bytes / _cpu(s["paged"]), "curves": curves}
    out["simple_op"], out["eager_view"] = _eager_op_cost(reps)
    out["eager_op"] = _eager_program_op_cost(reps, out["eager_view"])
    out["graph_call"], out["graph_kernel"] = (None, None) if quick else _graph_costs(reps)
    return out


# ----------------------------------------------------------------------------- two gloo ranks
def exact_pair_rate(kind: str, curve: list[list[float]]) -> float:
    """``efficiency[kind]`` from a measured curve (rate per *computed* pair by size): the rate per *exact*
    pair at :data:`~cpattn.plan.profiles.LEGACY_ATTN_TOKENS`, what that key has always meant (the model's
    attention costs and profiles without curves read it so).

    >>> round(exact_pair_rate("attention_causal", [[1024, 0.8], [4096, 0.8]]), 3)  # 2048^2 causal: 1.25x computed
    0.64
    >>> exact_pair_rate("attention", [[1024, 0.8], [4096, 0.8]])
    0.8
    """
    return interpolate(curve, LEGACY_ATTN_TOKENS) / legacy_pair_factor(kind)


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
    curves = c["curves"]
    conc = m["concurrent"]
    eff = {"gemm": 1.0, **{k: exact_pair_rate(k, pts) for k, pts in curves.items()},
           "decode_attention": c["decode_attention_bw"] / c["copy_bw"],
           "transpose": c["transpose_bw"] / c["copy_bw"], "update": c["update_bw"] / c["copy_bw"], "elementwise": 1.0,
           "concurrent_compute": min(1.0, conc["attention"]), "concurrent_compute_cpu": min(1.0, conc["attention_cpu"]),
           "concurrent_decode": min(1.0, conc["decode"]), "concurrent_decode_cpu": min(1.0, conc["decode_cpu"]),
           "concurrent_bandwidth": min(1.0, conc["copy"]), "concurrent_bandwidth_cpu": min(1.0, conc["copy_cpu"])}
    a2a, ring, a2a_cpu, ring_cpu = m["a2a"], m["ring"], m["a2a_cpu"], m["ring_cpu"]
    a2a_link = Link(a2a[0], a2a[1], cpu_alpha=a2a_cpu[0], cpu_beta=a2a_cpu[1], cold=m["cold"], cold_gap=m["cold_gap"])
    launch = {"eager": c["eager_op"], "view": c["eager_view"], "simple_op": c["simple_op"],
              "graph": c["graph_kernel"] if c["graph_kernel"] is not None else CPU_DEFAULT.launch["graph"],
              "graph_call": c["graph_call"] if c["graph_call"] is not None else CPU_DEFAULT.launch["graph_call"]}
    when = time.strftime("%Y-%m-%d %H:%M")
    sizes = ATTN_SIZES["quick" if quick else "full"]
    return Profile(
        name="cpu", device=f"this machine's CPU (calibrated {when}), one thread per rank, gloo over loopback",
        flops={"fp32": gemm, "bf16": gemm, "fp16": gemm}, mem_bw=c["copy_bw"], mem_bytes=CPU_DEFAULT.mem_bytes,
        devices_per_node=2,
        links={"intra": a2a_link, "a2a": a2a_link,
               "ring": Link(ring[0], ring[1], overlap=m["overlap"], cpu_alpha=ring_cpu[0], cpu_beta=ring_cpu[1]),
               "native": Link(ring[0], ring[1])},
        efficiency=eff, launch=launch, curves=curves,
        sources={"all": f"cpattn plan calibrate{' --quick' if quick else ''} on {when}, {time.time() - t0:.0f} s; "
                        f"process CPU-time medians of interleaved rounds (one process), wall and CPU medians (two "
                        f"gloo ranks); collectives fitted over {len(m['raw']['a2a'])} + {len(m['raw']['ring'])} sizes; "
                        f"attention at {sizes[0][0]} x {sizes[0][1]} heads and {sizes[1][0]} x {sizes[1][1]} heads "
                        f"(tokens x heads), per pair the kernel computes",
                 "raw": str({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items() if k != "curves"})},
    )


def summary(p: Profile) -> str:
    """The calibrated numbers of a CPU profile, a few lines (older profiles print what they have).

    >>> from cpattn.plan.profiles import CPU_DEFAULT
    >>> print(summary(CPU_DEFAULT).splitlines()[1])  # doctest: +ELLIPSIS
      gemm 40.0 GFLOP/s; copy 6.00 GB/s; ...
    """
    e, ln, la = p.efficiency, p.links, p.launch

    def curve(kind):
        pts = sorted(p.curves.get(kind) or [])
        if not pts:
            return f"{e.get(kind, 0):.2f}"
        return " -> ".join(f"{eff:.2f} @{size:.0f}" for size, eff in pts)

    def pct(key):
        return f"{e[key]:.0%}" if key in e else "n/a"

    a2a, ring = ln["a2a"], ln["ring"]
    lines = [
        f"CPU profile: {p.device}",
        f"  gemm {p.flops['fp32'] / 1e9:.1f} GFLOP/s; copy {p.mem_bw / 1e9:.2f} GB/s; transposing copy "
        f"{e.get('transpose', 0):.2f} of copy; in-place update {e.get('update', 0):.2f} of copy; bf16 paged decode "
        f"{e['decode_attention']:.2f} of copy bandwidth",
        f"  attention, fraction of gemm per computed pair{' (by size sqrt(lq*lk))' if p.curves else ''}: causal "
        f"token-major {curve('attention_causal')}; causal head-major {curve('attention_causal_hm')}; unmasked "
        f"{curve('attention')}; GQA-folded {curve('attention_gqa')}",
        f"  gloo all-to-all: alpha {a2a.alpha * 1e6:.0f} us, beta {a2a.beta / 1e9:.2f} GB/s; ring exchange: alpha "
        f"{ring.alpha * 1e6:.0f} us, beta {ring.beta / 1e9:.2f} GB/s, {ring.overlap:.0%} hidden behind compute",
    ]
    if a2a.cpu_alpha or a2a.cpu_beta or ring.cpu_beta:
        lines.append(
            f"  process CPU time of a transfer: all-to-all {a2a.cpu_alpha * 1e6:.0f} us + bytes / "
            f"{a2a.cpu_beta / 1e9:.2f} GB/s; ring exchange {ring.cpu_alpha * 1e6:.0f} us + bytes / "
            f"{ring.cpu_beta / 1e9:.2f} GB/s")
    if a2a.cold_gap:
        lines.append(f"  a collective reached from {a2a.cold_gap * 1e6:.0f} us of host work costs "
                     f"{a2a.cold * 1e6:.0f} us more than one right after another")
    lines.append(
        f"  with both ranks busy each keeps (wall / CPU time): attention {pct('concurrent_compute')} / "
        f"{pct('concurrent_compute_cpu')}, bf16 paged decode {pct('concurrent_decode')} / "
        f"{pct('concurrent_decode_cpu')}, copy {pct('concurrent_bandwidth')} / {pct('concurrent_bandwidth_cpu')}")
    lines.append(
        f"  eager op {la['eager'] * 1e6:.1f} us (demo program), small aten op "
        f"{la.get('simple_op', 0) * 1e6:.1f} us, view {la.get('view', 0) * 1e6:.1f} us; compiled program "
        f"{la.get('graph_call', 0) * 1e6:.0f} us per call + {la['graph'] * 1e6:.1f} us per kernel")
    return "\n".join(lines)
