"""The model of this machine's benchmarks: predicted ratios of ``cpattn bench pcp / dcp / graph``.

Each predictor prices exactly the calls the benchmark makes, with a
calibrated CPU profile (:mod:`cpattn.bench.perf.calibrate` fits it), for one of the two
clocks the benchmarks report: ``wall`` (the slowest rank's wall time) or
``cpu`` (the slowest rank's process CPU time, which a job sharing the cores
does not inflate by time slicing):

- ``bench pcp`` (ring vs one rank): the one-rank causal call on token-major
  inputs vs, on each rank, the head-major packing of q and K/V, the causal
  step-0 call, the later unmasked calls (kv_a only, or q_b only), the LSE
  merges and the ring exchange. Every attention call costs the pairs aten's
  flash kernel computes (:func:`~cpattn.plan.costs.flash_tile_pairs`) at the
  calibrated rate for its size. While both ranks compute, each keeps the
  calibrated share of the attention rate (in the clock asked for). Wall:
  the transfer not hidden by the measured overlap; CPU: the process CPU
  time gloo spends moving the bytes. Slowest rank / one rank.
- ``bench dcp`` (whole DCP step vs one rank): paged decode over 1/N of the
  KV, each rank keeping the calibrated share of its bandwidth while both
  ranks decode, plus the variant's collectives (gloo: one all-to-all each;
  their wall time, or their process CPU time).
- ``bench graph`` (eager / graph-captured step, wall): the ops of rank 0's
  step, traced with its real collectives answered locally
  (:class:`cpattn.plan.opcount.EchoGroup`);
  eager: ops at the calibrated per-op cost of cpattn's eager code, the
  collectives, and the extra each collective costs when reached from host
  work (``Link.cold_cost``); graph: one compiled call, the kernels inductor
  would emit (every op that is not pointwise, plus one per run of pointwise
  ops) at the calibrated per-kernel cost, the same collectives and the
  runner's copies into its static buffers.

:func:`profile_gaps` names what an older profile lacks and what stands in
for it. The experiment that puts these predictions next to measured ratios
(``cpattn plan validate``) is benchmark-side: :mod:`cpattn.bench.perf.validate`;
:func:`cpattn.plan.breakeven.bench_break_even` and the engine's elastic CP
read :func:`predict_pcp`.

Example
-------
>>> from cpattn.plan.profiles import CPU_DEFAULT
>>> r = predict_pcp(CPU_DEFAULT, seq=4096, heads=16, kv_heads=16, head_dim=128)
>>> 0.4 < r["ratio"] < 0.8 and sorted(r["ranks"][0]) == sorted(r["ranks"][1])
True
"""

from __future__ import annotations

from cpattn.plan.costs import attention_flops, causal_pairs, collective_time, flash_tile_pairs, legacy_pair_factor
from cpattn.plan.opcount import graph_program_ops
from cpattn.plan.profiles import LEGACY_ATTN_TOKENS, Link, Profile

CLOCKS = ("wall", "cpu")


def _check_clock(clock: str) -> None:
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}; got {clock!r}")


def concurrent_share(prof: Profile, what: str, clock: str = "wall") -> float:
    """The share of its rate a rank keeps while the other rank runs the same kind of work.

    what: "compute" (the attention kernel), "decode" (bf16 paged decode) or "bandwidth" (a copy).
    Profiles calibrated before a key was measured fall back: a CPU-time share to the wall share,
    "decode" to "bandwidth", anything else to 1 (see :func:`profile_gaps`).

    >>> from cpattn.plan.profiles import CPU_DEFAULT
    >>> concurrent_share(CPU_DEFAULT, "decode", "cpu")  # the default has only the copy's wall share
    0.9
    """
    _check_clock(clock)
    e = prof.efficiency
    keys = [f"concurrent_{what}"]
    if clock == "cpu":
        keys.insert(0, f"concurrent_{what}_cpu")
    if what == "decode":
        keys += ["concurrent_bandwidth_cpu"] * (clock == "cpu") + ["concurrent_bandwidth"]
    return next((e[k] for k in keys if k in e), 1.0)


def profile_gaps(prof: Profile) -> list[str]:
    """What a (pre-curve) profile lacks that the validation uses, and what stands in for it.

    >>> from cpattn.plan.profiles import CPU_DEFAULT
    >>> len(profile_gaps(CPU_DEFAULT)) > 3
    True
    """
    e, out = prof.efficiency, []
    for kind in ("attention_causal", "attention_causal_hm", "attention"):
        if kind not in prof.curves:
            out.append(f"{kind}: one size only (assumed {LEGACY_ATTN_TOKENS} tokens), scaled to other sizes by "
                       "the flash kernel's computed pairs")
    for what in ("compute", "decode", "bandwidth"):
        if f"concurrent_{what}_cpu" not in e:
            out.append(f"concurrent_{what}_cpu: not measured; using {concurrent_share(prof, what, 'cpu'):.2f}")
    if "concurrent_decode" not in e:
        out.append(f"concurrent_decode: not measured; using the copy's {concurrent_share(prof, 'decode'):.2f}")
    if "update" not in e:
        out.append("update (the in-place LSE merge): not measured; priced at the copy bandwidth")
    ring, a2a = prof.links.get("ring", prof.links["intra"]), prof.links.get("a2a", prof.links["intra"])
    if ring.cpu_beta <= 0:
        out.append("ring exchange CPU time: not measured; using its wall time")
    if a2a.cpu_alpha <= 0 and a2a.cpu_beta <= 0:
        out.append("all-to-all CPU time: not measured; using 0")
    if a2a.cold_gap <= 0:
        out.append("collective reached from host work: not measured; no extra")
    return out


def _attn(prof: Profile, lq: int, lk: int, causal: bool, heads: int, kv_heads: int, d: int, *,
          head_major: bool) -> float:
    """One attention_with_lse call of one request (fp32): the pairs the flash kernel computes at the
    profile's rate for this size (its curve), or, for a one-size profile, the rate it measured at
    :data:`LEGACY_ATTN_TOKENS` converted to computed pairs."""
    kind = ("attention_causal_hm" if head_major else "attention_causal") if causal else \
        ("attention_gqa" if heads != kv_heads else "attention")
    flops = attention_flops(flash_tile_pairs(lq, lk, causal), heads, d, d)
    if kind in prof.curves:
        return prof.op_time(kind, flops=flops, bytes_=0.0, dtype="fp32", size=(lq * lk) ** 0.5)
    return prof.op_time(kind, flops=flops / legacy_pair_factor(kind), bytes_=0.0, dtype="fp32")


def _copy(prof: Profile, nbytes: float, kind: str = "elementwise") -> float:
    """A copy of ``nbytes`` (read + write)."""
    return prof.op_time(kind, flops=0.0, bytes_=2 * nbytes, dtype="fp32")


def predict_pcp(prof: Profile, *, seq: int, heads: int, kv_heads: int, head_dim: int, pcp: int = 2,
                clock: str = "wall") -> dict:
    """Ring vs one rank for one request of ``seq`` tokens, fp32 (``cpattn bench pcp``); see module doc.

    Returns one_rank_s, ranks (per rank: seconds per piece, before the share of the shared cores),
    share, ring_s (slowest rank) and ratio.
    """
    from cpattn.pcp import _needs_b

    _check_clock(clock)
    d, p = head_dim, pcp
    one = _attn(prof, seq, seq, True, heads, kv_heads, d, head_major=False)
    share = concurrent_share(prof, "compute", clock)
    bw_share = concurrent_share(prof, "bandwidth", clock)
    ring_link = prof.links.get("ring", prof.links["intra"])
    tok = 4 * kv_heads * 2 * d  # K and V bytes per token
    t_r, na = seq // p, seq // (2 * p)
    ranks, totals = [], []
    for r in range(p):
        parts = {"q head-major copy": _copy(prof, t_r * heads * d * 4, "transpose"),
                 "K/V packing": _copy(prof, t_r * tok, "transpose")}
        if not _needs_b(r, 0, p):
            parts["K/V packing"] += _copy(prof, na * tok)
        step0 = _attn(prof, t_r, t_r, True, heads, kv_heads, d, head_major=True)
        later = merge = transfer = 0.0
        for s in range(1, p):
            src = (r - s) % p
            n_recv = t_r if _needs_b(src, s - 1, p) else na
            nbytes = n_recv * tok
            if clock == "cpu":  # what moving the bytes costs the process (the wait itself costs no CPU)
                transfer += ring_link.cpu_time(nbytes) if ring_link.cpu_beta > 0 else ring_link.time(nbytes)
            else:  # the wait compute does not hide
                hide = (step0 if s == 1 else later / max(s - 1, 1)) / share
                transfer += max(0.0, ring_link.time(nbytes) - ring_link.overlap * hide)
            if src < r:  # every local query, kv_a of src
                later += _attn(prof, t_r, na, False, heads, kv_heads, d, head_major=True)
                rows = t_r
            else:  # q_b, all of src
                later += _attn(prof, t_r - na, t_r, False, heads, kv_heads, d, head_major=True)
                rows = t_r - na
            merge += prof.op_time("update", flops=0.0, bytes_=3 * rows * heads * d * 4, dtype="fp32")  # in place
        parts.update({"step 0 (causal)": step0, "later steps": later, "merges": merge, "transfer": transfer})
        copies = parts["q head-major copy"] + parts["K/V packing"] + merge
        totals.append((step0 + later) / share + copies / bw_share + transfer)
        ranks.append(parts)
    worst = max(totals)
    return {"one_rank_s": one, "ranks": ranks, "share": share, "ring_s": worst, "ratio": worst / one}


def ring_pairs(seq: int, pcp: int) -> list[int]:
    """Query-key pairs each rank computes in the ring schedule :func:`predict_pcp` prices (one request).

    Equal to the library's own count, :func:`cpattn.layout.pcp.causal_pairs` (a test checks it).

    >>> ring_pairs(16, 2)
    [68, 68]
    """
    t_r, na = seq // pcp, seq // (2 * pcp)
    out = []
    for r in range(pcp):
        total = causal_pairs(t_r, t_r)
        for s in range(1, pcp):
            src = (r - s) % pcp
            total += causal_pairs(t_r, na, False) if src < r else causal_pairs(t_r - na, t_r, False)
        out.append(total)
    return out


def predict_dcp(prof: Profile, *, context: int, batch: int = 4, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128, dcp: int = 2, kv_bytes: int = 2, clock: str = "wall") -> dict:
    """Whole DCP decode step vs one rank (``cpattn bench dcp``): ratios per variant; see module doc.

    >>> from cpattn.plan.profiles import CPU_DEFAULT
    >>> r = predict_dcp(CPU_DEFAULT, context=65536, clock="cpu")
    >>> round(r["ratio"]["local_a2a"], 3)  # half the KV at the default's 90% bandwidth share
    0.556
    """
    _check_clock(clock)
    kv = batch * context * kv_heads * head_dim * 2 * kv_bytes
    one = prof.op_time("decode_attention", flops=0.0, bytes_=kv, dtype="bf16")
    share = concurrent_share(prof, "decode", clock)
    mine = prof.op_time("decode_attention", flops=0.0, bytes_=kv / dcp, dtype="bf16") / share
    link = prof.links.get("a2a", prof.links["intra"])
    hl = heads // dcp
    q = batch * hl * head_dim * kv_bytes
    part = batch * heads * (head_dim + 1) * 4
    per = {  # (collective, bytes) of each variant; gloo: every collective is one all-to-all
        "ag_rs": [("all_gather", q), ("all_gather", batch * heads * 4), ("reduce_scatter", batch * heads * head_dim * 4)],
        "a2a": [("all_gather", q), ("all_to_all", part)],
        "local_a2a": [("all_to_all", part)],
    }

    def cost(kind, nbytes):
        if dcp <= 1:
            return 0.0
        if clock == "wall":
            return collective_time(kind, nbytes, dcp, link, "a2a")
        return link.cpu_time(collective_time(kind, nbytes, dcp, Link(0.0, 1.0), "a2a"))  # CPU of the bytes moved

    comm = {k: sum(cost(kind, n) for kind, n in v) for k, v in per.items()}
    return {"one_rank_s": one, "attention_s": mine, "share": share, "comm_s": comm,
            "ratio": {k: (mine + c) / one for k, c in comm.items()}}


def predict_graph(prof: Profile, *, layers: int = 4, batches=(1, 8, 32), dcp: int = 2, merge: str = "ag_rs",
                  **program) -> dict:
    """Eager / graph-captured speedup of the demo program's decode step per batch (``cpattn bench graph``,
    wall clock); see module doc. Per batch: eager_s, graph_s, comm_s, cold_s (the eager collectives'
    extra), ops (:func:`graph_program_ops`) and speedup."""
    link = prof.links.get("a2a", prof.links["intra"])
    share = concurrent_share(prof, "compute", "wall")
    la = prof.launch
    out = {}
    for b in batches:
        ops = graph_program_ops(layers=layers, batch=b, dcp=dcp, merge=merge, **program)
        n_coll = len(ops["collectives"])
        comm = sum(collective_time(k, n, dcp, link, "a2a") for k, n in ops["collectives"])
        host = (ops["ops"] * la["eager"] + ops["views"] * la.get("view", 0.0)) / share
        cold = n_coll * link.cold_cost(host / max(n_coll, 1))
        eager = host + comm + cold
        copies = 4 * la["eager"]  # the runner copies the batch into its static buffers
        kernels = (la.get("graph_call", 0.0) + ops["kernels"] * la["graph"]) / share
        graph = kernels + comm + n_coll * link.cold_cost(kernels / max(n_coll, 1)) + copies
        out[b] = {"eager_s": eager, "graph_s": graph, "comm_s": comm, "cold_s": cold, "ops": ops,
                  "speedup": eager / graph}
    return out
