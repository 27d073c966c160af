"""The performance model: TTFT, TPOT, KV bytes and concurrency of a model on a profile, per (tp, pcp, dcp).

Every op is priced by the roofline of :meth:`Profile.op_time` from exact
FLOP and byte counts (:mod:`cpattn.plan.costs`), every collective by the
alpha + beta cost of the algorithm the code runs, and a transfer the code
overlaps with compute (the PCP ring) costs only what compute does not hide.

Prefill (TTFT of ``batch`` prompts of ``context`` tokens): per layer, each
PCP rank runs the projections and MLP on its ``1/pcp`` of the tokens
(``1/tp`` of the weights), its balanced share of the causal attention pairs,
a TP all-reduce after attention and after a dense MLP, the expert-parallel
dispatch and combine of MoE layers (routed experts spread over all the
engine's devices, whose routed FLOPs every prompt's tokens share, the token
rows split over TP; bytes that leave the node go over the slower fabric),
and the PCP KV exchange: ``ring`` (P-1 steps of one
rank's KV, each step hidden behind that step's attention) or ``allgather``
(one gather, not hidden, as vLLM-Ascend does).

Decode (TPOT with ``batch`` requests of ``context`` cached tokens): per
layer, the weights a step reads (routed experts: those the batch hits), the
KV each device reads (``1/dcp`` of the tokens), the attention FLOPs, two TP
all-reduces and the DCP merge (``dcp_merge``, a name of the one merge
vocabulary, :mod:`cpattn.dcp.layer_merges`: "ag_rs" gathers the query heads
and merges with an LSE all-gather + reduce-scatter; "a2a" gathers and merges
in one all-to-all; "local_a2a" computes the group's heads locally, one
all-to-all; "local_ag" local heads, one all-gather of ``[O | L]``;
"local_fold" local heads, LSE all-gather, merge folded into the TP
all-reduce), plus a launch cost per kernel (graph mode).

Memory (:mod:`cpattn.plan.memory`): weights per device (attention and dense
weights over TP, routed experts over the whole engine, ``tp * pcp * dp``
devices) and one prefill step's activations; the rest of ``mem_util`` of the
device, less a 5% reserve, holds KV. KV per token and device: one layer's
bytes (:meth:`ModelSpec.kv_bytes_per_token_layer`, KV heads over TP,
replicated past ``num_kv_heads``) divided by ``dcp * pcp``. A layout that
does not fit names the term that overflows (``Prediction.overflow``).

Data parallelism (``dp`` > 1): the batch is dealt over the replicas; one
replica's attention, projections and dense work run on ``ceil(batch / dp)``
prompts, and the routed experts of every device serve all of them.

Example
-------
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> p = predict(get_model("deepseek-v3.2"), get_profile("h200"), Layout(8, 1, 8), context=65536, batch=4)
>>> p.kv_bytes_per_token < predict(get_model("deepseek-v3.2"), get_profile("h200"), Layout(8, 1, 1),
...                                context=65536, batch=4).kv_bytes_per_token
True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from cpattn.dcp.layer_merges import PROGRAM_MERGES, layer_merge
from cpattn.plan import v4costs
from cpattn.plan.collectives import comm_time
from cpattn.plan.costs import attention_flops, causal_pairs, collective_time, ep_all_to_all_time, expected_experts
from cpattn.plan.memory import (  # noqa: F401 (re-exported: model.weights_per_device etc. stay importable)
    ACT, activation_bytes, kv_bytes_per_token, kv_heads_per_device, memory_terms, weights_per_device,
)
from cpattn.plan.profiles import Profile
from cpattn.plan.rules import check_layout, layout_space
from cpattn.plan.specs import WEIGHT_BYTES, ModelSpec

DCP_MERGES = PROGRAM_MERGES  # cpattn.dcp.layer_merges: every name prices (a TP output projection follows)
PCP_METHODS = ("ring", "allgather")
KERNELS_PER_LAYER = {"prefill": 24, "decode": 30}  # launches per layer (norms, projections, rope, attention, MLP)


@dataclass(frozen=True)
class Layout:
    """tp: tensor-parallel ranks; pcp: prefill context-parallel ranks (added); dcp: decode context-parallel
    ranks (a share of the TP ranks); dp: attention data-parallel replicas of ``tp * pcp`` devices each that
    share one expert-parallel group (vLLM's ``--data-parallel-size`` with ``--enable-expert-parallel``).
    Devices: ``tp * pcp * dp``, all of them in the expert-parallel group."""

    tp: int
    pcp: int = 1
    dcp: int = 1
    dp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pcp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp} pcp={self.pcp} dcp={self.dcp}" + (f" dp={self.dp}" if self.dp > 1 else "")


@dataclass(frozen=True)
class Options:
    """pcp_method: "ring" or "allgather"; dcp_merge: see module doc; output: tokens generated per request
    (for KV sizing); weights: override the spec's weight dtype; compute_dtype: peak FLOP/s key;
    prefix_hit: fraction of each prompt already cached (prefix caching; only the rest is prefilled);
    max_requests: the scheduler's cap on concurrent requests (vLLM's max_num_seqs);
    allow_pcp_with_dcp: price PCP with DCP in one engine (the engine's opt-in; refused without it);
    max_batched_tokens: tokens one prefill step holds activations for (vLLM's --max-num-batched-tokens)."""

    pcp_method: str = "ring"
    dcp_merge: str = "local_a2a"
    output: int = 1024
    compute_dtype: str = "bf16"
    prefix_hit: float = 0.0
    max_requests: int = 1024
    reserve: float = 0.05
    allow_pcp_with_dcp: bool = False
    max_batched_tokens: int = 8192

    def __post_init__(self):  # an old spelling ("fold") warns and becomes its name ("local_fold")
        object.__setattr__(self, "dcp_merge", layer_merge(self.dcp_merge, DCP_MERGES, what="dcp_merge"))


@dataclass
class Prediction:
    """One layout's numbers (seconds, bytes per device); ``parts``: where the time goes; ``overflow``: the
    memory term that does not fit when ``fits`` is False (:func:`cpattn.plan.memory.memory_terms`).
    ``ttft_s`` is the makespan of the batch's prefill (at batch 1 the request's TTFT); ``ttft_p50_s`` /
    ``ttft_p99_s`` the per-request TTFTs of :func:`request_ttfts`."""

    layout: Layout
    ttft_s: float
    tpot_s: float
    weights_bytes: float
    kv_bytes_per_token: float
    kv_bytes: float
    max_requests: int
    fits: bool
    tokens_per_s_per_device: float
    parts: dict = field(default_factory=dict)
    overflow: str | None = None  # the term that does not fit: "weights", "activations", "KV", "max_requests"
    memory: dict = field(default_factory=dict)  # bytes per device of each term (memory.memory_terms)
    ttft_p50_s: float = 0.0  # per-request TTFT of the batch's requests, median (request_ttfts)
    ttft_p99_s: float = 0.0  # and 99th percentile; ttft_s is the makespan (the last request's TTFT)

    @property
    def makespan_s(self) -> float:
        """The end of the batch's prefill (every request's first token): ``ttft_s``."""
        return self.ttft_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = asdict(self.layout)
        return d


# ----------------------------------------------------------------------------- prefill
def _attn_dims(spec: ModelSpec) -> tuple[int, int]:
    """(Dqk, Dv) of prefill attention (MLA prefills in the expanded multi-head form)."""
    if spec.attention == "gqa":
        return spec.head_dim, spec.head_dim
    return spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim


def _prefill_attention_flops(spec: ModelSpec, new: int, cached: int, layer: int = 0) -> float:
    """One layer, one request of ``new`` tokens after ``cached`` ones, all heads (V4: the ``layer``'s kind)."""
    if spec.attention == "v4":
        return v4costs.prefill_attention_flops(spec, layer, new, cached)
    dqk, dv = _attn_dims(spec)
    full = causal_pairs(new, new + cached)
    if spec.attention != "dsa":
        return attention_flops(full, spec.heads, dqk, dv)
    k = spec.index_topk
    # each query attends min(visible, k) keys; the indexer scores every visible key
    sparse = topk_pairs(new, cached, k)
    return attention_flops(sparse, spec.heads, dqk, dv) + 2.0 * full * spec.index_heads * spec.index_dim


def topk_pairs(new: int, cached: int, k: int) -> int:
    """Exactly ``sum(min(cached + i + 1, k) for i in range(new))``: the keys each of ``new`` queries after
    ``cached`` tokens attends under top-k sparse attention.

    >>> topk_pairs(10, 3, 8) == sum(min(3 + i + 1, 8) for i in range(10)), topk_pairs(5, 20, 8)
    (True, 40)
    """
    if cached >= k:
        return new * k
    m = min(cached + new, k)  # queries that see fewer than k keys attend them all
    return (m * (m + 1) - cached * (cached + 1)) // 2 + (cached + new - m) * k


def _kv_exchange_bytes(spec: ModelSpec, tokens: int, tp: int, layer: int = 0) -> float:
    """Bytes of ``tokens`` tokens' K/V one TP rank holds (what a PCP rank sends per layer and step)."""
    if spec.attention == "v4":
        return v4costs.exchange_bytes(spec, layer, tokens, ACT)
    dqk, dv = _attn_dims(spec)
    if spec.attention == "gqa":
        return tokens * kv_heads_per_device(spec, tp) * (dqk + dv) * ACT
    return tokens * (spec.kv_lora_rank + spec.qk_rope_head_dim + (spec.index_dim if spec.attention == "dsa" else 0)) * ACT


def prefill_time(spec: ModelSpec, prof: Profile, lay: Layout, context: int, batch: int, opts: Options) -> dict:
    """TTFT parts (seconds) for ``batch`` prompts of ``context`` tokens; see the module doc."""
    dt = opts.compute_dtype
    cached = int(context * opts.prefix_hit)
    new = context - cached
    mine = math.ceil(batch / lay.dp)  # prompts one DP replica prefills
    tokens = mine * new / lay.pcp  # per PCP rank
    dpn = prof.devices_per_node
    pcp_link = prof.link(lay.tp * lay.pcp > dpn)
    wb = spec.weight_bytes()
    gemm = attn = comm_tp = comm_pcp = comm_ep = other = 0.0
    for i in range(spec.layers):
        shared, routed = spec.mlp_params(i)
        dense, one = spec.attn_params(i) + shared, (routed // spec.experts if routed else 0)
        flops = 2.0 * tokens * dense / lay.tp + 2.0 * batch * new * spec.experts_per_token * one / lay.devices
        gemm += prof.op_time("gemm", flops=flops, bytes_=wb * (dense / lay.tp + routed / lay.devices), dtype=dt)
        a_flops = mine * _prefill_attention_flops(spec, new, cached, i) / lay.pcp / lay.tp
        kv_bytes = _kv_exchange_bytes(spec, int(mine * (new + cached) / lay.pcp), lay.tp, i)
        a_time = prof.op_time("attention_causal", flops=a_flops, bytes_=kv_bytes, dtype=dt)
        attn += a_time
        if lay.tp > 1:  # after attention, and after a dense MLP (routed experts reduce in the combine)
            comm_tp += (1 if routed else 2) * comm_time(prof, "all_reduce", tokens * spec.hidden * ACT, lay.tp,
                                                                 lay.tp > dpn)
        if routed:  # expert parallel over the engine's devices: dispatch + combine of top-k hidden rows
            sent = tokens / lay.tp * spec.experts_per_token * spec.hidden * ACT
            comm_ep += 2 * ep_all_to_all_time(sent, lay.devices, dpn, prof.links["intra"], prof.link(True))
        if lay.pcp > 1:
            if opts.pcp_method == "ring":  # P-1 steps, each hidden behind 1/P of the layer's attention
                step = collective_time("ring", kv_bytes, lay.pcp, pcp_link)
                comm_pcp += (lay.pcp - 1) * max(0.0, step - pcp_link.overlap * a_time / lay.pcp)
            else:
                comm_pcp += comm_time(prof, "all_gather", kv_bytes, lay.pcp, lay.tp * lay.pcp > dpn)
        other += prof.op_time("elementwise", flops=0.0, bytes_=12 * tokens * spec.hidden * ACT / lay.tp, dtype=dt)
        other += KERNELS_PER_LAYER["prefill"] * prof.launch.get("eager", 0.0)
    head = prof.op_time("gemm", flops=2.0 * mine * spec.vocab * spec.hidden / lay.tp,
                        bytes_=wb * spec.vocab * spec.hidden / lay.tp, dtype=dt)
    parts = {"gemm": gemm, "attention": attn, "tp_comm": comm_tp, "ep_comm": comm_ep, "pcp_comm": comm_pcp,
             "other": other + head}
    return {**parts, "total": sum(parts.values())}


# ----------------------------------------------------------------------------- decode
def _dcp_comm(spec: ModelSpec, lay: Layout, batch: int, prof: Profile, crosses: bool, merge: str) -> float:
    """One decode layer's DCP collectives (the TP all-reduce is priced apart), each as the profile's library
    runs it (:func:`cpattn.plan.collectives.choose`)."""

    def coll(kind, nbytes):
        return comm_time(prof, kind, nbytes, n, crosses)

    n = lay.dcp
    if n == 1:
        return 0.0
    heads = spec.heads / lay.tp  # this rank's heads
    dqk = spec.head_dim if spec.attention in ("gqa", "v4") else spec.kv_lora_rank + spec.qk_rope_head_dim
    dv = spec.head_dim if spec.attention in ("gqa", "v4") else spec.kv_lora_rank
    q_gather = coll("all_gather", batch * heads * dqk * ACT)
    partial = batch * heads * n * (dv + 1) * 4  # fp32 [O | L] of the group's heads
    lse = coll("all_gather", batch * heads * n * 4)
    if merge == "ag_rs":
        return q_gather + lse + coll("reduce_scatter", batch * heads * n * dv * 4)
    if merge == "a2a":
        return q_gather + coll("all_to_all", partial)
    if merge == "local_a2a":
        return coll("all_to_all", partial)
    if merge == "local_ag":
        return coll("all_gather", partial)
    if merge == "local_fold":
        return lse
    raise ValueError(f"dcp_merge must be one of {DCP_MERGES}; got {merge!r}")


def decode_time(spec: ModelSpec, prof: Profile, lay: Layout, context: int, batch: int, opts: Options) -> dict:
    """TPOT parts (seconds) of one step of ``batch`` requests at ``context`` cached tokens.

    The KV is sharded over ``dcp * pcp`` devices; with pcp > 1 (an engine that decodes with its PCP
    group, as vLLM-Ascend's co-located PCP does) every PCP rank runs the step on the same tokens and
    the partials are merged over the PCP group too (one all-gather of ``[O | L]``).
    """
    dt = opts.compute_dtype
    tp, dcp, pcp = lay.tp, lay.dcp, lay.pcp
    everyone, batch = batch, math.ceil(batch / lay.dp)  # all requests; those of one DP replica
    wb = spec.weight_bytes()
    kvb = WEIGHT_BYTES[spec.kv_dtype]
    dpn = prof.devices_per_node

    gemm = attn = comm_tp = comm_cp = comm_ep = other = 0.0
    for i in range(spec.layers):
        shared, routed = spec.mlp_params(i)
        dense, one = spec.attn_params(i) + shared, (routed // spec.experts if routed else 0)
        touched = expected_experts(spec.experts, everyone * spec.experts_per_token) if routed else 0.0
        w_bytes = wb * (dense / tp + touched * one / lay.devices)
        # every PCP rank decodes the same tokens: the expert group of tp * pcp * dp devices serves pcp copies
        flops = 2.0 * batch * dense / tp + 2.0 * everyone * spec.experts_per_token * one / (tp * lay.dp)
        gemm += prof.op_time("gemm", flops=flops, bytes_=w_bytes, dtype=dt)
        shards = dcp * pcp
        local = context / shards  # tokens each device attends
        h_dev = spec.heads / tp
        if spec.attention == "gqa":
            byts = batch * local * 2 * kv_heads_per_device(spec, tp) * spec.head_dim * kvb
            flops = 4.0 * batch * local * h_dev * dcp * spec.head_dim
            dv = spec.head_dim
        elif spec.attention == "v4":  # the window, then the compressed entries sharded over the devices
            keys, scored = v4costs.decode_keys(spec, i, context, shards)
            dv = spec.head_dim
            byts = batch * (keys * spec.head_dim * kvb + scored * (spec.index_dim + 4))
            flops = 2.0 * batch * keys * h_dev * dcp * 2 * dv + 2.0 * batch * scored * spec.index_heads * spec.index_dim
        else:
            dqk, dv = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.kv_lora_rank
            keys = min(spec.index_topk, context) / shards if spec.attention == "dsa" else local
            byts = batch * keys * dqk * kvb
            flops = 2.0 * batch * keys * h_dev * dcp * (dqk + dv)
            if spec.attention == "dsa":
                byts += batch * local * (spec.index_dim + 4)
                flops += 2.0 * batch * local * spec.index_heads * spec.index_dim
        attn += prof.op_time("decode_attention", flops=flops, bytes_=byts, dtype=dt)
        if tp > 1:
            comm_tp += (1 if routed else 2) * comm_time(prof, "all_reduce", batch * spec.hidden * ACT, tp, tp > dpn)
        if routed:
            sent = batch / tp * spec.experts_per_token * spec.hidden * ACT
            comm_ep += 2 * ep_all_to_all_time(sent, lay.devices, dpn, prof.links["intra"], prof.link(True))
        comm_cp += _dcp_comm(spec, lay, batch, prof, tp > dpn, opts.dcp_merge)
        if pcp > 1:
            comm_cp += comm_time(prof, "all_gather", batch * h_dev * (dv + 1) * 4, pcp, tp * pcp > dpn)
        other += KERNELS_PER_LAYER["decode"] * prof.launch.get("graph", 0.0)
    head = prof.op_time("gemm", flops=2.0 * batch * spec.vocab * spec.hidden / tp,
                        bytes_=wb * spec.vocab * spec.hidden / tp, dtype=dt)
    parts = {"gemm": gemm, "attention": attn, "tp_comm": comm_tp, "ep_comm": comm_ep, "cp_comm": comm_cp,
             "other": other + head}
    return {**parts, "total": sum(parts.values())}


# ----------------------------------------------------------------------------- one layout, every layout
def predict(spec: ModelSpec, prof: Profile, lay: Layout, *, context: int, batch: int,
            opts: Options = Options()) -> Prediction:
    """TTFT, TPOT, KV bytes and concurrency of ``spec`` on ``prof`` with layout ``lay`` (module doc).

    A layout the engine refuses (:func:`cpattn.plan.rules.check_layout`, i.e. ``EngineConfig.create``)
    raises its :class:`~cpattn.config.ConfigError` (a ``ValueError``) naming each rule and its fix.
    """
    check_layout(spec, lay, opts.allow_pcp_with_dcp)
    mem = memory_terms(spec, prof, lay, context, batch, opts)
    max_req = mem["max_requests"]
    pre = prefill_time(spec, prof, lay, context, batch, opts)
    dec = decode_time(spec, prof, lay, context, batch, opts)
    at_max = decode_time(spec, prof, lay, context, max_req, opts)["total"] if max_req else math.inf
    tput = max_req / at_max / lay.devices if max_req else 0.0
    ttfts = request_ttfts(pre["total"], batch, context - int(context * opts.prefix_hit), opts.max_batched_tokens,
                          lay.dp)
    return Prediction(lay, pre["total"], dec["total"], mem["weights"], mem["kv_bytes_per_token"], mem["KV"],
                      max_req, mem["overflow"] is None, tput, {"prefill": pre, "decode": dec},
                      overflow=mem["overflow"], memory=mem, ttft_p50_s=percentile(ttfts, 0.5),
                      ttft_p99_s=percentile(ttfts, 0.99))


def request_ttfts(makespan: float, batch: int, new_tokens: int, max_batched_tokens: int, dp: int = 1) -> list[float]:
    """Each request's TTFT when ``batch`` requests arrive together and the engine prefills them first come,
    first served: a step holds ``max(1, max_batched_tokens // new_tokens)`` prompts per DP replica, so the
    requests finish in groups of that many times ``dp``, evenly over the ``makespan`` (the batched prefill).

    >>> request_ttfts(8.0, 4, 65536, 8192)  # long prompts: one after another
    [2.0, 4.0, 6.0, 8.0]
    >>> request_ttfts(1.0, 4, 1024, 8192)  # eight short prompts fit one step: all at the end
    [1.0, 1.0, 1.0, 1.0]
    """
    group = max(1, max_batched_tokens // max(1, new_tokens)) * dp
    groups = math.ceil(batch / group)
    return [makespan * (k // group + 1) / groups for k in range(batch)]


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 1) of ``xs``.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile(list(range(1, 101)), 0.99)
    (2.0, 99)
    """
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def layouts(spec: ModelSpec, devices: int, opts: Options = Options()) -> list[Layout]:
    """Every (tp, pcp, dcp) with ``tp * pcp == devices`` that ``EngineConfig.create`` accepts for the model
    (:func:`cpattn.plan.rules.layout_space`; its refusals carry each rule and fix)."""
    return layout_space(spec, devices, opts.allow_pcp_with_dcp)[0]


def recommend(preds: list[Prediction], objective: str = "ttft", tolerance: float = 0.02, **kw):
    """The layout to pick for ``objective`` and why (:func:`cpattn.plan.objective.recommend`)."""
    from cpattn.plan.objective import recommend as _recommend

    return _recommend(preds, objective, tolerance, **kw)
