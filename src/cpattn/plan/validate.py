"""Validation on this machine: the model's predicted ratios of ``cpattn bench pcp / dcp / graph`` vs measured.

Each predictor prices exactly the calls the benchmark makes, with a
calibrated CPU profile (:mod:`cpattn.plan.calibrate`):

- ``bench pcp`` (ring vs one rank): the one-rank causal call on token-major
  inputs vs, on each rank, the head-major packing of q and K/V, the causal
  step-0 call, the later unmasked calls (kv_a only, or q_b only), the LSE
  merges and the ring exchange (kv_a alone where no later rank needs kv_b),
  hidden behind step 0's compute by the measured overlap; while every rank
  computes each keeps the measured share of the cores. Slowest rank / one.
- ``bench dcp`` (whole DCP step vs one rank): paged decode over 1/N of the
  KV, each rank keeping the measured share of the memory bandwidth while all
  stream, plus the variant's collectives (gloo: one all-to-all each).
- ``bench graph`` (eager / graph-captured step): the eager step is its aten
  ops (counted by tracing one step) at the measured dispatch cost plus the
  collectives; the captured step is the kernels inductor would emit (every
  op that is not pointwise, plus one per run of pointwise ops) at the
  measured compiled-kernel cost, plus one compiled call, the same
  collectives and the runner's copies into its static buffers.

:func:`table` puts predictions next to measured ratios (from the benchmarks'
``--json`` output) with the relative error. On a machine other jobs load,
wall-clock ratios measure the load as much as the code; the benchmarks
also report process CPU time, and ``dedicated=True`` predicts that ratio
(each rank on cores of its own, no waits).

Example
-------
>>> from cpattn.plan.profiles import CPU_DEFAULT
>>> r = predict_pcp(CPU_DEFAULT, seq=4096, heads=16, kv_heads=16, head_dim=128)
>>> 0.4 < r["ratio"] < 0.8 and sorted(r["ranks"][0]) == sorted(r["ranks"][1])
True
"""

from __future__ import annotations

from cpattn.plan.costs import attention_flops, causal_pairs, collective_time
from cpattn.plan.profiles import Profile


def _attn(prof: Profile, lq: int, lk: int, causal: bool, heads: int, kv_heads: int, d: int, *,
          head_major: bool) -> float:
    """One attention_with_lse call of one request (fp32)."""
    kind = ("attention_causal_hm" if head_major else "attention_causal") if causal else \
        ("attention_gqa" if heads != kv_heads else "attention")
    flops = attention_flops(causal_pairs(lq, lk, causal), heads, d, d)
    return prof.op_time(kind, flops=flops, bytes_=0.0, dtype="fp32")


def _copy(prof: Profile, nbytes: float, kind: str = "elementwise") -> float:
    """A copy of ``nbytes`` (read + write)."""
    return prof.op_time(kind, flops=0.0, bytes_=2 * nbytes, dtype="fp32")


def predict_pcp(prof: Profile, *, seq: int, heads: int, kv_heads: int, head_dim: int, pcp: int = 2,
                dedicated: bool = False) -> dict:
    """Ring vs one rank for one request of ``seq`` tokens, fp32 (``cpattn bench pcp``); see module doc.

    ``dedicated``: as on cores of its own per rank (no share lost to the other rank, no exposed wait):
    what the benchmark's CPU-time ratio measures.
    """
    from cpattn.pcp import _needs_b

    d, p = head_dim, pcp
    one = _attn(prof, seq, seq, True, heads, kv_heads, d, head_major=False)
    share = 1.0 if dedicated else prof.efficiency.get("concurrent_compute", 1.0)
    ring_link = prof.links.get("ring", prof.links["intra"])
    tok = 4 * kv_heads * 2 * d  # K and V bytes per token
    t_r, na = seq // p, seq // (2 * p)
    ranks = []
    for r in range(p):
        parts = {"q head-major copy": _copy(prof, t_r * heads * d * 4, "transpose"),
                 "K/V packing": _copy(prof, t_r * tok, "transpose")}
        if not _needs_b(r, 0, p):
            parts["K/V packing"] += _copy(prof, na * tok)
        step0 = _attn(prof, t_r, t_r, True, heads, kv_heads, d, head_major=True) / share
        later, merge, exposed = 0.0, 0.0, 0.0
        src = r
        for s in range(1, p):
            prev = src
            src = (r - s) % p
            n_recv = t_r if _needs_b(src, s - 1, p) else na
            comm = collective_time("ring", n_recv * tok, p, ring_link)
            hide = step0 if s == 1 else later / max(s - 1, 1)
            exposed += 0.0 if dedicated else max(0.0, comm - ring_link.overlap * hide)
            del prev
            if src < r:  # every local query, kv_a of src
                later += _attn(prof, t_r, na, False, heads, kv_heads, d, head_major=True) / share
                rows = t_r
            else:  # q_b, all of src
                later += _attn(prof, t_r - na, t_r, False, heads, kv_heads, d, head_major=True) / share
                rows = t_r - na
            merge += _copy(prof, 3 * rows * heads * d * 4)
        parts.update({"step 0 (causal)": step0, "later steps": later, "merges": merge, "exposed transfer": exposed})
        ranks.append(parts)
    worst = max(sum(r.values()) for r in ranks)
    return {"one_rank_s": one, "ranks": ranks, "ring_s": worst, "ratio": worst / one}


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
                head_dim: int = 128, dcp: int = 2, kv_bytes: int = 2, dedicated: bool = False) -> dict:
    """Whole DCP decode step vs one rank (``cpattn bench dcp``): ratios per variant (``dedicated``: see
    :func:`predict_pcp`; the collectives' waits then drop out too)."""
    kv = batch * context * kv_heads * head_dim * 2 * kv_bytes
    one = prof.op_time("decode_attention", flops=0.0, bytes_=kv, dtype="bf16")
    share = 1.0 if dedicated else prof.efficiency.get("concurrent_bandwidth", 1.0)
    mine = prof.op_time("decode_attention", flops=0.0, bytes_=kv / dcp, dtype="bf16") / share
    link = prof.links.get("a2a", prof.links["intra"])
    hl = heads // dcp
    q = batch * hl * head_dim * kv_bytes
    part = batch * heads * (head_dim + 1) * 4
    comm = {
        "ag_rs": collective_time("all_gather", q, dcp, link, "a2a")
        + collective_time("all_gather", batch * heads * 4, dcp, link, "a2a")
        + collective_time("reduce_scatter", batch * heads * head_dim * 4, dcp, link, "a2a"),
        "a2a": collective_time("all_gather", q, dcp, link, "a2a") + collective_time("all_to_all", part, dcp, link, "a2a"),
        "local_a2a": collective_time("all_to_all", part, dcp, link, "a2a"),
    }
    if dedicated:
        comm = {k: 0.0 for k in comm}
    return {"one_rank_s": one, "attention_s": mine, "comm_s": comm,
            "ratio": {k: (mine + c) / one for k, c in comm.items()}}


def count_ops(fn) -> dict:
    """Aten ops one call of ``fn`` dispatches: {"ops", "views", "kernels"} (kernels: what a fusing
    compiler would launch: each op that is not pointwise, plus one per run of pointwise ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seq: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tags = getattr(func, "tags", ())
            if torch.Tag.view_copy in tags or func._opname in ("view", "_unsafe_view", "transpose", "t", "select",
                                                               "slice", "unsqueeze", "squeeze", "expand", "permute",
                                                               "as_strided", "alias", "detach", "reshape", "unbind",
                                                               "split", "chunk", "narrow", "movedim", "lift_fresh"):
                seq.append("view")
            elif torch.Tag.pointwise in tags:
                seq.append("pointwise")
            else:
                seq.append("other")
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    kernels, prev = 0, None
    for kind in seq:
        if kind == "other" or (kind == "pointwise" and prev != "pointwise"):
            kernels += 1
        if kind != "view":
            prev = kind
    return {"ops": sum(k != "view" for k in seq), "views": seq.count("view"), "kernels": kernels}


def graph_program_ops(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2, head_dim: int = 32,
                      context: int = 256, batch: int = 8, dcp: int = 2, merge: str = "ag_rs") -> dict:
    """Ops of one eager step of the demo program (``cpattn bench graph``'s), traced on a one-rank group
    with this rank's share of the heads and KV (collectives are priced apart)."""
    import torch

    from cpattn.comm.sim import SimMesh
    from cpattn.graphs import demo_program as dp

    local = -(-(context + 1) // dcp)
    mb = -(-local // 16) + 1
    cfg = dp.ProgramConfig(num_layers=layers, hidden=hidden, num_heads=heads // dcp, num_kv_heads=kv_heads,
                           head_dim=head_dim, block_size=16, interleave_size=1, max_blocks=mb, num_blocks=batch * mb,
                           merge="ag_rs")
    state = dp.init_state(cfg, dp.init_params(cfg), poison=0.0)
    g = SimMesh(1).groups()[0]
    step = dp.make_step(cfg, g)
    batch_in = {"x": torch.randn(batch, hidden), "seq_lens": torch.full((batch,), local),
                "block_table": torch.arange(batch * mb).view(batch, mb),
                "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32)}
    step(state, batch_in)
    return count_ops(lambda: step(state, batch_in))


def predict_graph(prof: Profile, *, layers: int = 4, batches=(1, 8, 32), dcp: int = 2, merge: str = "ag_rs",
                  **program) -> dict:
    """Eager / graph-captured speedup of the demo program's decode step per batch (``cpattn bench graph``)."""
    link = prof.links.get("a2a", prof.links["intra"])
    hidden, heads, d = program.get("hidden", 256), program.get("heads", 8), program.get("head_dim", 32)
    out = {}
    for b in batches:
        ops = graph_program_ops(layers=layers, batch=b, dcp=dcp, merge=merge, **program)
        hl = heads // dcp
        per_layer = {  # gloo: every collective is one all-to-all
            "ag_rs": [("all_gather", b * hl * d * 4), ("all_gather", b * heads * 4),
                      ("reduce_scatter", b * heads * d * 4), ("all_reduce", b * hidden * 4)],
            "a2a": [("all_gather", b * hl * d * 4), ("all_to_all", b * heads * (d + 1) * 4),
                    ("all_reduce", b * hidden * 4)],
            "local_a2a": [("all_to_all", b * heads * (d + 1) * 4), ("all_reduce", b * hidden * 4)],
            "fold": [("all_gather", b * heads * 4), ("all_reduce", b * hidden * 4)],
        }[merge]
        comm = layers * sum(collective_time(k, n, dcp, link, "a2a") for k, n in per_layer)
        eager = ops["ops"] * prof.launch["eager"] + ops["views"] * prof.launch.get("view", 0.0) + comm
        copies = 4 * prof.launch["eager"]  # the runner copies the batch into its static buffers
        graph = prof.launch.get("graph_call", 0.0) + ops["kernels"] * prof.launch["graph"] + comm + copies
        out[b] = {"eager_s": eager, "graph_s": graph, "comm_s": comm, "ops": ops, "speedup": eager / graph}
    return out


# ----------------------------------------------------------------------------- measured values, table
def measured_pcp(result: dict, clock: str = "wall") -> float | None:
    """ring / one rank (median of per-round ratios, wall or CPU time) from ``cpattn bench pcp --json``."""
    row = next((r for r in result.get("rows", []) if r["method"] == "ring"), None)
    return None if row is None else row["cpu_vs_one_rank" if clock == "cpu" else "vs_one_rank"]


def measured_dcp(result: dict, context: int, clock: str = "wall") -> dict:
    """Whole-step DCP / one rank per variant (median of per-round ratios) from ``cpattn bench dcp --json``."""
    out, tail = {}, f"_{clock}_ms"
    for r in result.get("rows", []):
        m = r.get("metric", "")
        if r.get("context") == context and m.startswith("step_") and m.endswith(tail):
            out[m[len("step_"):-len(tail)]] = r["ratio"]["median"]
    return out


def measured_graph(result: dict) -> dict:
    """Eager / graph speedup per batch (median of per-round ratios) from ``cpattn bench graph --json``."""
    rows = result["cpu"][0]["rows"]
    return {r["batch"]: r["speedup"] for r in rows}


def table(pairs: list[tuple[str, float, float | None]]) -> list[dict]:
    """Rows of (what, predicted, measured) with the relative error |p - m| / m (None when not measured)."""
    rows = []
    for what, pred, meas in pairs:
        err = None if meas is None or meas <= 0 else abs(pred - meas) / meas
        rows.append({"what": what, "predicted": pred, "measured": meas, "error": err,
                     "within_15%": None if err is None else err <= 0.15})
    return rows
