"""Device memory of one layout: weights, activations and KV per device, and which term overflows.

Usable memory is ``mem_util`` of the device less ``reserve`` (5%). Three
terms fill it, per device:

- **weights**: attention, dense MLP, shared experts, embedding and lm_head
  over TP; routed experts over all the engine's ``tp * pcp * dp`` devices;
- **activations**: the live tensors of one prefill forward step (chunked
  prefill: at most ``max_batched_tokens`` tokens a step, vLLM's
  ``--max-num-batched-tokens``, spread over the PCP ranks): the residual
  stream and its normed copy (``2 * hidden``), plus the wider of the
  attention block (this rank's query, key, value and output heads) and the
  MLP block (gate and up of the dense MLP, or of the shared experts plus
  the top-k dispatch and combine rows), in bf16; plus the last tokens'
  logits in fp32. An estimate: a real engine's peak depends on its kernels
  and allocator;
- **KV**: ``kv_bytes_per_token * (context + output)`` per request, the
  requests of one DP replica on each of its devices.

:func:`memory_terms` names the first term that does not fit (``weights``
alone too large; then weights + activations; then the batch's KV) and the
bytes it lacks; :mod:`cpattn.plan.fits` finds the smallest change that fits.

Example
-------
>>> from cpattn.plan.model import Layout, Options
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> m = memory_terms(get_model("glm-5"), get_profile("h200"), Layout(8), 131072, 1, Options())
>>> m["overflow"], round(m["weights"] / 1e9), round(m["usable"] / 1e9)
('weights', 186, 120)
"""

from __future__ import annotations

import math

ACT = 2  # bytes of an activation element (bf16)
TERMS = ("weights", "activations", "KV")


def weights_per_device(spec, lay) -> float:
    """Weight bytes on one device: attention, dense MLP, shared experts, embedding and lm_head over TP;
    routed experts over all the engine's devices (``tp * pcp * dp``)."""
    wb = spec.weight_bytes()
    routed = sum(spec.mlp_params(i)[1] for i in range(spec.layers))
    rest = spec.total_params() - routed
    return wb * (rest / lay.tp + routed / lay.devices)


def kv_heads_per_device(spec, tp: int) -> int:
    """GQA KV heads a TP rank holds (at least one: replicated past ``num_kv_heads``)."""
    return max(1, math.ceil(spec.kv_heads / tp)) if spec.attention == "gqa" else 1


def kv_bytes_per_token(spec, lay) -> float:
    """KV bytes one token costs on one device, all layers (sharded over DCP and PCP)."""
    per_layer = spec.kv_bytes_per_token_layer(kv_heads_per_device(spec, lay.tp))
    return spec.layers * per_layer / (lay.dcp * lay.pcp)


def activation_bytes(spec, lay, context: int, batch: int, max_batched_tokens: int) -> float:
    """Peak activation bytes of one prefill step on one device (module doc).

    >>> from cpattn.plan.model import Layout
    >>> from cpattn.plan.specs import get_model
    >>> r1 = get_model("deepseek-r1")
    >>> round(activation_bytes(r1, Layout(8), 131072, 1, 8192) / 1e9, 2)  # 8192 x (2 x 7168 + 15104) x 2 B
    0.48
    >>> # chunked: four prompts hold one step's tokens too (only the four last tokens' logits are added)
    >>> activation_bytes(r1, Layout(8), 131072, 4, 8192) - activation_bytes(r1, Layout(8), 131072, 1, 8192)
    193920.0
    """
    tokens = min(math.ceil(batch / lay.dp) * context, max_batched_tokens) / lay.pcp
    h = spec.heads / lay.tp
    if spec.attention == "gqa":
        attn = h * spec.head_dim * 2 + 2 * kv_heads_per_device(spec, lay.tp) * spec.head_dim
    else:  # MLA prefill runs the expanded heads: q and k of nope + rope, v and the output of v_head_dim
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        attn = h * (2 * qk + 2 * spec.v_head_dim)
    dense = 3 * spec.intermediate / lay.tp
    moe = (3 * spec.shared_experts * spec.moe_intermediate / lay.tp
           + 2 * spec.experts_per_token * spec.hidden / lay.tp) if spec.experts else 0.0
    per_token = 2 * spec.hidden + max(attn, dense, moe)
    logits = math.ceil(batch / lay.dp) * spec.vocab / lay.tp * 4
    return tokens * per_token * ACT + logits


def memory_terms(spec, prof, lay, context: int, batch: int, opts) -> dict:
    """Bytes per device of each term, ``usable``, ``kv_capacity`` (what weights and activations leave),
    ``max_requests`` (whole requests that fit, all DP replicas, capped by ``opts.max_requests``),
    ``overflow`` (the first term of :data:`TERMS` that does not fit, or None) and ``short`` (bytes it lacks)."""
    usable = prof.mem_bytes * (prof.mem_util - opts.reserve)
    w = weights_per_device(spec, lay)
    act = activation_bytes(spec, lay, context, batch, opts.max_batched_tokens)
    per_tok = kv_bytes_per_token(spec, lay)
    per_req = per_tok * (context + opts.output)
    kv = per_req * math.ceil(batch / lay.dp)
    capacity = usable - w - act
    max_req = lay.dp * max(0, int(capacity // per_req)) if per_req > 0 else 0  # each replica holds its own
    max_req = min(max_req, opts.max_requests)
    overflow, short = None, 0.0
    for term, used in (("weights", w), ("activations", w + act), ("KV", w + act + kv)):
        if used > usable:
            overflow, short = term, used - usable
            break
    if overflow is None and max_req < batch:  # the scheduler's cap, not memory
        overflow, short = "max_requests", 0.0
    return {"weights": w, "activations": act, "KV": kv, "usable": usable, "kv_capacity": capacity,
            "kv_bytes_per_token": per_tok, "max_requests": max_req, "overflow": overflow, "short": short}
