"""Prefill / decode disaggregation: a PCP prefill engine, a DCP decode engine, the KV moved between them.

:func:`predict_pd` prices one P/D split: the prefill engine's per-request
TTFT (its own layout, PCP welcome), the transfer of each request's whole KV
cache from the prefill engine's devices to the decode engine's over the
fabric between nodes, and the decode engine's TPOT and concurrency (its
layout, DCP welcome). Both engines go through the engine's own rules with
their P/D fields (``kv_transfer="pd"``, the producer / consumer role, the
interleave size equal to the block size: whole blocks move), so a decode
engine with PCP is refused as the engine refuses it.

Transfer: the request's KV, every layer (GQA: every KV head; MLA / DSA:
the latent and the indexer key), ``alpha + bytes / (n * beta)`` on the
profile's "inter" link with ``n`` the shards moving at once (the fewer of
the prefill engine's and the decode engine's distinct KV shards: PCP x
KV-head groups over TP on one side, DCP x KV-head groups on the other), not
overlapped with the prefill (a layer-wise connector would hide part of it).

Example
-------
>>> from cpattn.plan.model import Layout
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> r = predict_pd(get_model("deepseek-r1"), get_profile("h200"), Layout(1, 8), Layout(8, 1, 8),
...                context=131072, batch=1)
>>> r["devices"], r["transfer_s"] > 0, r["ttft_p99_s"] > r["prefill"].ttft_p99_s
(16, True, True)
"""

from __future__ import annotations

from cpattn.config import ConfigError
from cpattn.plan.model import Layout, Options, predict
from cpattn.plan.rules import layout_problems

BLOCK = 128  # the P/D pair's block size (the engine's default), and so its interleave size


def pd_problems(spec, prefill: Layout, decode: Layout, allow_pcp_with_dcp: bool = False) -> list[str]:
    """The engine's problems of each side with its P/D fields (prefixed ``prefill`` / ``decode``)."""
    pd = dict(kv_transfer="pd", block_size=BLOCK, cp_kv_cache_interleave_size=BLOCK)
    return ([f"prefill {p}" for p in layout_problems(spec, prefill, allow_pcp_with_dcp, kv_role="kv_producer", **pd)]
            + [f"decode {p}" for p in layout_problems(spec, decode, allow_pcp_with_dcp, kv_role="kv_consumer", **pd)])


def _shards(spec, lay: Layout, context_parallel: int) -> int:
    groups = min(lay.tp, spec.kv_heads) if spec.attention == "gqa" else 1
    return context_parallel * groups * lay.dp


def transfer_time(spec, prof, prefill: Layout, decode: Layout, context: int) -> float:
    """Seconds to move one request's KV of ``context`` tokens from the prefill to the decode engine."""
    nbytes = context * spec.layers * spec.kv_bytes_per_token_layer()
    link = prof.link(True)
    n = max(1, min(_shards(spec, prefill, prefill.pcp), _shards(spec, decode, decode.dcp)))
    return link.alpha + nbytes / (n * link.beta)


def predict_pd(spec, prof, prefill: Layout, decode: Layout, *, context: int, batch: int,
               opts: Options = Options()) -> dict:
    """One P/D split (module doc): ``prefill`` / ``decode`` predictions, ``transfer_s``, per-request
    ``ttft_p50_s`` / ``ttft_p99_s`` (prefill plus transfer), ``tpot_s``, ``devices`` and output
    ``tokens_per_s_per_device`` (the decode engine's throughput over both engines' devices). Raises the
    engine's :class:`~cpattn.config.ConfigError` for a side it refuses."""
    found = pd_problems(spec, prefill, decode, opts.allow_pcp_with_dcp)
    if found:
        raise ConfigError(f"P/D split {prefill} / {decode} for {spec.name}", found)
    p = predict(spec, prof, prefill, context=context, batch=batch, opts=opts)
    d = predict(spec, prof, decode, context=context, batch=batch, opts=opts)
    x = transfer_time(spec, prof, prefill, decode, context)
    devices = prefill.devices + decode.devices
    return {"prefill": p, "decode": d, "transfer_s": x, "ttft_p50_s": p.ttft_p50_s + x,
            "ttft_p99_s": p.ttft_p99_s + x, "tpot_s": d.tpot_s, "devices": devices, "fits": p.fits and d.fits,
            "tokens_per_s_per_device": d.tokens_per_s_per_device * decode.devices / devices}
