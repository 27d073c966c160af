"""The JSON flags of ``cpattn serve`` (vLLM's spelling): ``--compilation-config``, ``--speculative-config``,
``--kv-transfer-config``, and the ``--kv-pool`` spec of P/D's connector.

Each is an argparse ``type``: the JSON text -> a plain dict of what the
engine takes, or :class:`argparse.ArgumentTypeError` with one line naming
the key, the value seen and what is accepted (the parser turns it into
``cpattn serve: error: argument --compilation-config: ...``, exit 2). No
torch is imported.

Example
-------
>>> compilation_config('{"cudagraph_mode": "FULL_DECODE_ONLY"}')
{'graph_mode': 'FULL_DECODE_ONLY', 'capture_sizes': None, 'graph_backend': 'auto'}
>>> speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
{'method': 'ngram', 'num_speculative_tokens': 2, 'max_ngram': 3, 'min_ngram': 1}
>>> kv_transfer_config('{"kv_connector": "CpattnPoolConnector", "kv_role": "kv_both"}')
{'kv_connector': 'CpattnPoolConnector', 'kv_role': 'kv_both'}
"""

from __future__ import annotations

import argparse
import json

GRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")  # of vLLM's cudagraph modes, the ones the step loop runs
VLLM_ONLY_MODES = ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "backend")
SPEC_METHODS = ("ngram", "mtp")  # ngram for any model; mtp from the --model checkpoint's own MTP module
TRAINED_METHODS = ("eagle3", "dspark", "draft_model", "medusa", "eagle", "suffix")
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def _object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        example = '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
        raise argparse.ArgumentTypeError(f"saw {text!r}, which is not JSON ({e.msg} at column {e.colno}); "
                                         f"rule: a JSON object, e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"saw {text!r}, a JSON {type(value).__name__}; rule: a JSON object of keys")
    return value


def _unknown(value: dict, known: tuple[str, ...]) -> None:
    bad = sorted(set(value) - set(known))
    if bad:
        raise argparse.ArgumentTypeError(f"saw key {bad[0]!r}; rule: the keys cpattn serve reads are "
                                         f"{', '.join(known)}; fix: drop {bad[0]!r}")


def _int(value: dict, key: str, default: int | None, low: int) -> int | None:
    v = value.get(key, default)
    if v is None and default is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise argparse.ArgumentTypeError(f"saw {key}={json.dumps(v)}; rule: an integer >= {low}")
    return v


def compilation_config(text: str) -> dict:
    """``--compilation-config JSON`` -> ``{"graph_mode", "capture_sizes", "graph_backend"}`` for the engine.

    Keys: ``cudagraph_mode`` ("NONE" or "FULL_DECODE_ONLY": captured uniform decode steps, every other
    step eager), ``cudagraph_capture_sizes`` (a list of query-token counts; default: the engine's
    buckets), ``backend`` (a cpattn graph backend; default "auto").

    >>> compilation_config('{"cudagraph_mode": "none", "cudagraph_capture_sizes": [1, 2, 4]}')["capture_sizes"]
    (1, 2, 4)
    >>> compilation_config('{"cudagraph_mode": "PIECEWISE"}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw cudagraph_mode="PIECEWISE"; rule: one of NONE, FULL_DECODE_ONLY (the step loop ...
    """
    value = _object(text)
    _unknown(value, COMPILATION_KEYS)
    mode = value.get("cudagraph_mode", "NONE")
    if not isinstance(mode, str) or mode.upper() not in GRAPH_MODES:
        why = " (the step loop captures whole uniform decode steps only; PIECEWISE / FULL are vLLM's)" \
            if isinstance(mode, str) and mode.upper() in VLLM_ONLY_MODES else ""
        raise argparse.ArgumentTypeError(f"saw cudagraph_mode={json.dumps(mode)}; rule: one of "
                                         f"{', '.join(GRAPH_MODES)}{why}; fix: use \"FULL_DECODE_ONLY\"")
    sizes = value.get("cudagraph_capture_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)):
        raise argparse.ArgumentTypeError(f"saw cudagraph_capture_sizes={json.dumps(sizes)}; rule: a non-empty list "
                                         "of integers >= 1 (query tokens per captured step)")
    backend = value.get("backend", "auto")
    from cpattn.config.cli_args import GRAPH_BACKENDS

    if backend not in GRAPH_BACKENDS:
        raise argparse.ArgumentTypeError(f"saw backend={json.dumps(backend)}; rule: one of {', '.join(GRAPH_BACKENDS)}")
    return {"graph_mode": mode.upper(), "capture_sizes": None if sizes is None else tuple(sizes),
            "graph_backend": backend}


def speculative_config(text: str) -> dict:
    """``--speculative-config JSON`` -> ``{"method", "num_speculative_tokens", "max_ngram", "min_ngram"}``.

    ``method`` "ngram" (prompt lookup: drafts copied from the request's own history, vLLM's
    ``prompt_lookup_max`` / ``prompt_lookup_min``, default 3 / 1) or "mtp" (the MTP module of the
    ``--model`` checkpoint: DeepSeek's ``model.layers.{N}``, Qwen3-Next / Qwen3.5's ``mtp.*``), with
    ``num_speculative_tokens`` k >= 1. Methods that need a separate trained head or draft model (eagle3,
    dspark, draft_model) are refused: the server loads no second checkpoint yet.

    >>> speculative_config('{"method": "mtp", "num_speculative_tokens": 1}')["method"]
    'mtp'
    >>> speculative_config('{"method": "eagle3", "num_speculative_tokens": 1}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw method="eagle3"; rule: cpattn serve builds a drafter for method ngram, mtp only ...
    """
    value = _object(text)
    _unknown(value, SPEC_KEYS)
    method = value.get("method")
    if not isinstance(method, str) or method.lower() not in SPEC_METHODS:
        trained = isinstance(method, str) and method.lower() in TRAINED_METHODS
        why = (" (it needs a trained head or draft model, which cpattn serve does not load yet; cpattn bench "
               "drafts runs them)") if trained else ""
        raise argparse.ArgumentTypeError(f"saw method={json.dumps(method)}; rule: cpattn serve builds a drafter for "
                                         f"method {', '.join(SPEC_METHODS)} only{why}; fix: use "
                                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 2}'")
    if "num_speculative_tokens" not in value:
        raise argparse.ArgumentTypeError("saw no num_speculative_tokens; rule: the number of drafts per step, an "
                                         "integer >= 1; fix: add \"num_speculative_tokens\": 2")
    k = _int(value, "num_speculative_tokens", None, 1)
    hi = _int(value, "prompt_lookup_max", 3, 1)
    lo = _int(value, "prompt_lookup_min", 1, 1)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"saw prompt_lookup_min={lo} > prompt_lookup_max={hi}; rule: min <= max")
    return {"method": method.lower(), "num_speculative_tokens": k, "max_ngram": hi, "min_ngram": lo}


KV_CONNECTORS = ("CpattnPoolConnector",)  # the KV pool between the two roles (one server or two)
VLLM_CONNECTORS = ("NixlConnector", "MooncakeConnector", "MooncakeConnectorV1", "LMCacheConnectorV1",
                   "P2pNcclConnector", "SharedStorageConnector", "MultiConnector", "OffloadingConnector")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
KV_TRANSFER_KEYS = ("kv_connector", "kv_role")
PCP_POLICIES = ("always", "elastic")


def pcp_min_tokens(text: str) -> int | str:
    """``--pcp-min-tokens``: an integer >= 0, or ``measure`` (timed on the server's ranks at start-up,
    :mod:`cpattn.engine.elastic_measure`).

    >>> pcp_min_tokens("512"), pcp_min_tokens("measure")
    (512, 'measure')
    """
    if text == "measure":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: an integer >= 0, or 'measure'")
    return n


def kv_transfer_config(text: str) -> dict:
    """``--kv-transfer-config JSON`` (vLLM's shape) -> ``{"kv_connector", "kv_role"}``.

    ``kv_connector`` "CpattnPoolConnector" (the KV pool of ``--kv-pool``; default) and ``kv_role``:
    "kv_both", this server runs both roles (:class:`cpattn.engine.pd_engine.PDEngine`), the prefill role
    on ``--pcp`` ranks and the decode role on ``--dcp`` ranks; "kv_producer", a prefill server that stores
    every request's KV blocks in the pool (send it each request with ``max_tokens`` 1); "kv_consumer", a
    decode server that fetches a prompt's blocks from the pool before computing the rest (vLLM's
    two-server P/D; the two share ``--kv-pool lmdb:DIR`` or ``mooncake:HOST:PORT``).

    >>> kv_transfer_config('{"kv_role": "kv_producer"}')
    {'kv_connector': 'CpattnPoolConnector', 'kv_role': 'kv_producer'}
    >>> kv_transfer_config('{"kv_role": "both"}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw kv_role="both"; rule: one of kv_both (...), kv_producer, kv_consumer ...
    """
    value = _object(text)
    _unknown(value, KV_TRANSFER_KEYS)
    conn = value.get("kv_connector", KV_CONNECTORS[0])
    if conn not in KV_CONNECTORS:
        why = " (a vLLM connector between vLLM processes)" if conn in VLLM_CONNECTORS else ""
        raise argparse.ArgumentTypeError(f"saw kv_connector={json.dumps(conn)}{why}; rule: one of "
                                         f"{', '.join(KV_CONNECTORS)} (the KV pool of --kv-pool); fix: "
                                         '"kv_connector": "CpattnPoolConnector"')
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise argparse.ArgumentTypeError(f"saw kv_role={json.dumps(role)}; rule: one of kv_both (one server runs "
                                         "the prefill role on --pcp ranks and the decode role on --dcp ranks), "
                                         "kv_producer, kv_consumer (a prefill server and a decode server sharing "
                                         "--kv-pool); fix: \"kv_role\": \"kv_both\"")
    return {"kv_connector": conn, "kv_role": role}


def kv_pool(text: str) -> str:
    """``--kv-pool SPEC``: P/D's connector store, "memory" (in-process, the default), "lmdb:DIR" or
    "mooncake:HOST:PORT" (checked without opening it).

    >>> kv_pool("memory"), kv_pool("lmdb:/tmp/cpattn-pool")
    ('memory', 'lmdb:/tmp/cpattn-pool')
    >>> kv_pool("redis:x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw 'redis:x'; rule: memory, lmdb:DIR or mooncake:HOST:PORT (expected ...)
    """
    if text == "memory":
        return text
    from cpattn.pool.spec import pool_spec_problem

    why = pool_spec_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: memory, lmdb:DIR or mooncake:HOST:PORT ({why})")
    return text
