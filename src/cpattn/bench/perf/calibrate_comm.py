"""The communication half of ``cpattn plan calibrate``: gloo's all-to-all and ring exchange on two ranks (wall
and process CPU time), the overlapped ring, a collective reached from host work, and the shares of every rank
busy at once; :func:`comm_part` fits them (used by :func:`cpattn.bench.perf.calibrate.calibrate`).

Example
-------
>>> fn = _host_work(1)
>>> fn() is None
True
"""

from __future__ import annotations

import statistics

import torch

from cpattn.bench.common import measure, ratio


def _host_work(n: int):
    """About ``n`` x 18 us of eager host work (small matmuls and adds), as eager code runs between collectives."""
    x, w = torch.randn(8, 64), torch.randn(64, 64)

    def fn():
        for _ in range(n):
            torch.mm(x, w).add_(1.0)

    return fn


def comm_rank(group, sizes_a2a, sizes_ring, reps, overlap_bytes, quick=False):
    """Rank function: gloo all_to_all_single and ring-exchange times per size (wall and CPU), the
    overlapped ring, collectives reached from host work, and three kernels on every rank vs one."""
    from cpattn.bench.perf.calibrate import _cpu, _paged_case, attention_case

    res = {"a2a": [], "ring": [], "a2a_cpu": [], "ring_cpu": []}
    for nbytes in sizes_a2a:
        x = torch.zeros(max(2, nbytes // 4 // 2 * 2))
        s = measure({"x": lambda: group.all_to_all(x)}, reps, group=group, inner=10, warmup=2)["x"]
        m = x.nbytes * (group.size - 1) / group.size
        res["a2a"].append((m, s.median))
        res["a2a_cpu"].append((m, _cpu(s)))
    for nbytes in sizes_ring:
        x = torch.zeros(nbytes // 4)
        s = measure({"x": lambda: group.ring_exchange(x, x.shape).wait()}, reps, group=group, inner=3, warmup=1)["x"]
        res["ring"].append((x.nbytes, s.median))
        res["ring_cpu"].append((x.nbytes, _cpu(s)))
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
    # a collective reached from ~0.45 ms of host work vs from another collective (8 of each per sample)
    work, msg = _host_work(25), torch.zeros(2, 64)

    def interleaved():
        for _ in range(8):
            work()
            group.all_to_all(msg)

    s = measure({"interleaved": interleaved, "work": lambda: [work() for _ in range(8)],
                 "a2a": lambda: [group.all_to_all(msg) for _ in range(8)]}, reps, group=group, inner=2, warmup=1)
    extra = [(i - w - c) / 8 for i, w, c in zip(s["interleaved"].wall, s["work"].wall, s["a2a"].wall)]
    res["cold"] = {"extra": statistics.median(extra), "work": s["work"].median / 8}
    # every rank busy at once vs rank 0 alone: shared cores, caches and memory bus
    hm_attn, _, _ = attention_case("attention_causal_hm", 1024 if quick else 2048, 2, seed=group.rank)
    paged, _ = _paged_case(2048 if quick else 16384, seed=1 + group.rank)
    big = torch.randn(8 << 20)
    noop = lambda: None  # noqa: E731
    kernels = {"attention": hm_attn, "decode": paged, "copy": lambda: big.clone()}
    runs = {}
    for name, fn in kernels.items():
        runs[name + "_alone"] = fn if group.rank == 0 else noop
        runs[name + "_all"] = fn
    s = measure(runs, reps, group=group, warmup=1)
    res["concurrent"] = {f"{name}{'_cpu' if clock == 'cpu' else ''}":
                         ratio(s[name + "_alone"], s[name + "_all"], clock).median
                         for name in kernels for clock in ("wall", "cpu")}
    return res


def comm_part(quick: bool = False, timeout_s: float = 300.0) -> dict:
    """Fit alpha / beta of gloo's all-to-all and ring exchange (wall and CPU time), the overlap fraction,
    the cold-collective extra and the concurrent shares, on 2 ranks."""
    from cpattn.bench.harness import ranks
    from cpattn.bench.perf.calibrate import fit_alpha_beta

    reps = 3 if quick else 9
    sizes_a2a = [256, 16384, 1 << 20] if quick else [256, 4096, 32768, 262144, 1 << 20, 4 << 20]
    sizes_ring = [1 << 16, 4 << 20] if quick else [1 << 16, 1 << 20, 8 << 20, 32 << 20]
    res = ranks(2, comm_rank, sizes_a2a, sizes_ring, reps, (2 if quick else 8) << 20, quick, timeout_s=timeout_s,
                label="collectives, overlap and shared-core shares")[0]
    o = res["overlap"]
    hidden = (o["compute"] + o["ring"] - o["both"]) / max(min(o["compute"], o["ring"]), 1e-12)
    cold = res["cold"]
    return {"a2a": fit_alpha_beta(res["a2a"]), "ring": fit_alpha_beta(res["ring"]),
            "a2a_cpu": fit_alpha_beta(res["a2a_cpu"]), "ring_cpu": fit_alpha_beta(res["ring_cpu"]),
            "overlap": min(1.0, max(0.0, hidden)), "concurrent": res["concurrent"],
            "cold": max(0.0, cold["extra"]), "cold_gap": cold["work"], "raw": res}
