"""``GET /metrics``: the engine's counters and the request-latency histograms in Prometheus' text format.

:func:`metrics_text` renders an :class:`~cpattn.engine.outputs.EngineStats` (or a P/D engine's
``PDStats``, each counter per ``role``), the aborted-request count and the TTFT / TPOT
:class:`~cpattn.serve.engine_loop.Histogram` objects of the engine loop; the names are vLLM's
under the ``cpattn_`` prefix.

Example
-------
>>> from cpattn.engine.llm import EngineStats
>>> "cpattn_steps_total 3" in metrics_text(EngineStats(steps=3), 0).splitlines()
True
"""

from __future__ import annotations

from typing import Any

_METRICS = (  # (name, Prometheus type, help, EngineStats field)
    ("cpattn_running_requests", "gauge", "requests running (scheduled into steps)", "running"),
    ("cpattn_waiting_requests", "gauge", "requests waiting for their first step", "waiting"),
    ("cpattn_kv_blocks_used", "gauge", "KV-cache blocks in use, per DCP rank", "blocks_used"),
    ("cpattn_kv_blocks_free", "gauge", "KV-cache blocks free, per DCP rank", "blocks_free"),
    ("cpattn_steps_total", "counter", "engine steps run", "steps"),
    ("cpattn_replayed_steps_total", "counter", "steps replayed from a captured program", "replayed_steps"),
    ("cpattn_eager_steps_total", "counter", "steps run eagerly", "eager_steps"),
    ("cpattn_pcp_steps_total", "counter", "steps whose prefill chunks ran PCP (elastic: only the long chunks)",
     "pcp_steps"),
    ("cpattn_prefix_hit_tokens_total", "counter", "prompt tokens found in the prefix cache", "prefix_hit_tokens"),
    ("cpattn_prefix_query_tokens_total", "counter", "prompt tokens looked up in the prefix cache",
     "prefix_query_tokens"),
    ("cpattn_preemptions_total", "counter", "requests preempted (blocks reclaimed, recomputed later)", "preemptions"),
    ("cpattn_spec_decode_num_draft_tokens_total", "counter", "draft tokens verified (speculative decoding)",
     "drafted_tokens"),
    ("cpattn_spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted", "accepted_tokens"),
    ("cpattn_kv_pool_hit_tokens_total", "counter", "prompt tokens fetched from the KV pool", "pool_hit_tokens"),
    ("cpattn_kv_pool_blocks_stored_total", "counter", "KV blocks stored in the KV pool", "pool_blocks_stored"),
)
_HISTOGRAMS = (  # (name, help, EngineLoop attribute): vLLM's names under this file's prefix
    ("cpattn_time_to_first_token_seconds", "seconds from a request's acceptance to its first token "
                                           "(finished requests)", "ttft"),
    ("cpattn_time_per_output_token_seconds", "mean seconds per output token after the first (finished "
                                             "requests of >= 2 tokens)", "tpot"),
)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def histogram_lines(name: str, text: str, snapshot: tuple) -> list[str]:
    """Prometheus text of one histogram: ``_bucket{le=...}`` (cumulative, ending at +Inf), ``_sum``, ``_count``.

    >>> histogram_lines("t", "x", ((0.1, 1.0), (1, 2), 3.55, 3))[2:]
    ['t_bucket{le="0.1"} 1', 't_bucket{le="1.0"} 2', 't_bucket{le="+Inf"} 3', 't_sum 3.55', 't_count 3']
    """
    bounds, cum, total, count = snapshot
    lines = [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{_le(b)}"}} {c}' for b, c in zip(bounds, cum)]
    return lines + [f'{name}_bucket{{le="+Inf"}} {count}', f"{name}_sum {total!r}", f"{name}_count {count}"]


def metrics_text(stats: Any, aborted: int, histograms: Any = None) -> str:
    """The engine's counters in Prometheus' text format; a P/D engine's ``PDStats`` gives each counter per
    role (``{role="prefill"}`` / ``{role="decode"}``) and ``cpattn_handed_off_requests_total``;
    ``histograms``: an object with ``ttft`` / ``tpot`` :class:`~cpattn.serve.engine_loop.Histogram` objects
    (the :class:`~cpattn.serve.engine_loop.EngineLoop`).

    >>> from cpattn.engine.llm import EngineStats
    >>> print(metrics_text(EngineStats(running=2, blocks_used=5), 1).splitlines()[2])
    cpattn_running_requests 2
    >>> from cpattn.engine.pd_engine import PDStats
    >>> [ln for ln in metrics_text(PDStats(EngineStats(steps=3), EngineStats(steps=4), 1), 0).splitlines()
    ...  if ln.startswith("cpattn_steps_total")]
    ['cpattn_steps_total{role="prefill"} 3', 'cpattn_steps_total{role="decode"} 4']
    """
    roles = [("", stats)] if not hasattr(stats, "handed_off") else \
        [('{role="prefill"}', stats.prefill), ('{role="decode"}', stats.decode)]
    lines = []
    for name, kind, text, field in _METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{label} {getattr(s, field)}" for label, s in roles]
    if hasattr(stats, "handed_off"):
        lines += ["# HELP cpattn_handed_off_requests_total requests the prefill role handed to the decode role",
                  "# TYPE cpattn_handed_off_requests_total counter",
                  f"cpattn_handed_off_requests_total {stats.handed_off}"]
    lines += ["# HELP cpattn_aborted_requests_total requests aborted because their client went away",
              "# TYPE cpattn_aborted_requests_total counter", f"cpattn_aborted_requests_total {aborted}"]
    for name, text, attr in _HISTOGRAMS if histograms is not None else ():
        lines += histogram_lines(name, text, getattr(histograms, attr).snapshot())
    return "\n".join(lines) + "\n"
