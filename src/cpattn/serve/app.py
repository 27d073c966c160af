"""The OpenAI-compatible HTTP app (FastAPI) over an :class:`~cpattn.serve.engine_loop.EngineLoop`.

Endpoints:

- ``GET /health``: 200 ``{"status": "ok"}`` while the engine loop runs, 503 once it has failed;
- ``GET /v1/models``: the served model name;
- ``GET /metrics``: Prometheus text: running / waiting requests, KV blocks used / free per rank, steps
  (replayed / eager / PCP), prefix-cache hit and query tokens, preemptions, draft tokens verified /
  accepted, KV-pool tokens / blocks, aborted requests (a P/D engine: each per ``role``, and requests
  handed off), and the TTFT / TPOT histograms of finished requests (:func:`metrics_text`);
- ``POST /v1/completions``: ``prompt`` as a list of token ids, or a list of such lists (one choice
  each); ``max_tokens`` (default 16), ``stop_token_ids`` (vLLM's extra field); ``temperature``
  (default 1.0, OpenAI's; 0 is greedy), ``top_p``, ``top_k`` (0 / -1: off), ``seed`` (the same seed,
  the same tokens), ``logprobs`` N (each choice then carries ``logprobs: {tokens, token_logprobs,
  top_logprobs, text_offset}``, the raw model logprobs of the sampled and the N most likely
  tokens; :mod:`cpattn.engine.sampling`); ``stream``
  (server-sent events: ``data: {...}`` chunks, then ``data: [DONE]``), ``stream_options.include_usage``.
  The embedded models have no tokenizer, so each choice's ``text`` is its generated token ids joined by
  single spaces and ``token_ids`` carries them as integers (vLLM's ``return_token_ids`` shape); in a
  stream each chunk carries the new ids, and the chunks' texts concatenate to the whole text.

Errors are OpenAI's shape, ``{"error": {"message", "type", "code"}}``: 400 for bad input (a text prompt,
token ids outside the vocabulary, ``max_tokens`` past ``max_model_len``, a sampling field out of its
range), 404 for another model name or path, 503 when the engine loop has stopped.

Example
-------
>>> from fastapi.testclient import TestClient  # doctest: +SKIP
>>> client = TestClient(build_app(loop, "cpattn-qwen3"))  # doctest: +SKIP
>>> client.post("/v1/completions", json={"model": "cpattn-qwen3", "prompt": [1, 2, 3],
...                                       "max_tokens": 2}).json()["choices"][0]["token_ids"]  # doctest: +SKIP
[17, 5]
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpattn.engine.llm import SamplingParams
from cpattn.serve.engine_loop import EngineLoop

# fields the OpenAI client may send that this slice does not implement: (field, accepted values, why)
_UNSUPPORTED = (
    ("n", (None, 1), "n > 1 is not implemented; send n=1 (or one prompt per choice)"),
    ("best_of", (None, 1), "best_of > 1 is not implemented; omit it"),
    ("echo", (None, False), "echo is not implemented; omit it"),
    ("suffix", (None,), "suffix is not supported; omit it"),
    ("stop", (None, [], ""), "stop strings need a tokenizer and the embedded model has none; "
                             "pass stop_token_ids=[...] instead"),
)
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "logprobs")  # SamplingParams fields of the body


class BadRequest(Exception):
    """A 400 (or ``status``) with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict:
    """OpenAI's error shape.

    >>> error_body("bad", param="prompt", code=400)["error"]["param"]
    'prompt'
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code or e.status), status_code=e.status)


def parse_prompts(prompt: Any, vocab: int | None = None) -> list[list[int]]:
    """``prompt`` of a completions request -> a list of token-id lists (raises BadRequest).

    >>> parse_prompts([1, 2, 3]), parse_prompts([[1], [2, 3]])
    ([[1, 2, 3]], [[1], [2, 3]])
    >>> parse_prompts("hello")
    Traceback (most recent call last):
    ...
    cpattn.serve.app.BadRequest: prompt: saw a text prompt ('hello'); the embedded model has no tokenizer, so prompts must be token ids: pass prompt=[id, ...] or [[id, ...], ...]
    """
    def ids(p: Any) -> bool:
        return isinstance(p, list) and len(p) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        shown = repr(prompt if isinstance(prompt, str) else prompt[0])[:40]
        raise BadRequest(f"prompt: saw a text prompt ({shown}); the embedded model has no tokenizer, so prompts "
                         "must be token ids: pass prompt=[id, ...] or [[id, ...], ...]", "prompt")
    if ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise BadRequest(f"prompt: saw {json.dumps(prompt)[:60]}; expected a non-empty list of token ids or a "
                     "non-empty list of such lists", "prompt")


def parse_params(body: dict) -> tuple[SamplingParams, bool, bool]:
    """(SamplingParams, stream, include_usage) of a completions request body (raises BadRequest).

    ``temperature`` defaults to OpenAI's 1.0 (the engine API's default is greedy, 0); ``top_k`` 0 or -1
    is the whole vocabulary; ``logprobs`` N (0 .. 20) returns the sampled token's and the N most likely
    tokens' logprobs per token.

    >>> p, stream, usage = parse_params({"max_tokens": 4, "stop_token_ids": [7], "seed": 3})
    >>> p.max_tokens, p.stop_token_ids, p.temperature, p.seed, stream
    (4, (7,), 1.0, 3, False)
    >>> parse_params({"top_p": 1.5})
    Traceback (most recent call last):
    ...
    cpattn.serve.app.BadRequest: top_p: saw 1.5; expected 0 < top_p <= 1 (1 keeps the whole distribution)
    """
    for field, ok, why in _UNSUPPORTED:
        if body.get(field) not in ok:
            raise BadRequest(f"{field}: saw {json.dumps(body[field])}; {why}", field)
    m = body.get("max_tokens", 16)
    if m is None:
        m = 16
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise BadRequest(f"max_tokens: saw {json.dumps(m)}; expected an integer >= 1", "max_tokens")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise BadRequest(f"stop_token_ids: saw {json.dumps(stop)[:60]}; expected a list of token ids",
                         "stop_token_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest(f"stream: saw {json.dumps(stream)}; expected true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest(f"stream_options: saw {json.dumps(opts)}; expected an object", "stream_options")
    given = {f: body[f] for f in _SAMPLING if body.get(f) is not None}
    given.setdefault("temperature", 1.0)  # OpenAI's default
    if isinstance(given.get("logprobs"), int) and not isinstance(given["logprobs"], bool) \
            and given["logprobs"] > MAX_LOGPROBS:
        raise BadRequest(f"logprobs: saw {given['logprobs']}; expected at most {MAX_LOGPROBS} (the server's "
                         "max_logprobs)", "logprobs")
    try:
        params = SamplingParams(max_tokens=m, stop_token_ids=tuple(stop), **given)
    except ValueError as e:  # "SamplingParams.<field>: saw <repr>; expected <what>"
        field, _, want = str(e).removeprefix("SamplingParams.").partition(": saw ")
        want = want.partition("; expected ")[2]
        raise BadRequest(f"{field}: saw {json.dumps(body.get(field))}; expected {want}", field) from None
    return params, bool(stream), bool(opts.get("include_usage"))


def logprobs_body(ids, logprobs, offset: int = 0, lead: bool = False) -> dict | None:
    """A choice's OpenAI completions ``logprobs``: ``tokens`` (each id as it appears in the text),
    ``token_logprobs``, ``top_logprobs`` (the sampled and the N most likely tokens, by the same text),
    ``text_offset`` (each token's start in the choice's whole text, the first at ``offset``);
    None without logprobs. ``lead``: the text so far is not empty (a stream's later chunks).

    >>> logprobs_body([5, 17], [{5: -0.5}, {17: -1.0, 3: -0.7}])["tokens"]
    ['5', ' 17']
    >>> logprobs_body([5, 17], [{5: -0.5}, {17: -1.0, 3: -0.7}], 4, lead=True)["text_offset"]
    [4, 6]
    """
    if logprobs is None:
        return None
    tokens, top, offsets = [], [], []
    for i, (t, lp) in enumerate(zip(ids, logprobs)):
        space = lead or i > 0
        tokens.append(ids_text([t], lead=space))
        top.append({ids_text([k], lead=space): v for k, v in lp.items()})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(ids, logprobs)], "top_logprobs": top,
            "text_offset": offsets}


def ids_text(ids: tuple[int, ...] | list[int], lead: bool = False) -> str:
    """Token ids as text (no tokenizer): joined by single spaces; ``lead`` puts a space before (a stream's
    later chunks, so the chunks concatenate to the whole text).

    >>> ids_text([5, 17]), ids_text([3], lead=True), ids_text([], lead=True)
    ('5 17', ' 3', '')
    """
    text = " ".join(str(t) for t in ids)
    return " " + text if lead and text else text


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


def build_app(loop: EngineLoop, served_model_name: str, max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app serving ``loop``'s engine as ``served_model_name`` (module docstring)."""
    app = FastAPI(title="cpattn serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind,
                                       code=exc.status_code), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse(error_body(f"the engine loop has stopped: {loop.error}", "server_error", code=503),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(loop.stats, loop.aborted, loop), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "cpattn",
                "root": served_model_name, "max_model_len": max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(BadRequest("the request body is not valid JSON; send a JSON object"))
        try:
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            model = body.get("model")
            if model is not None and model != served_model_name:
                raise BadRequest(f"model: saw {json.dumps(model)}; this server serves {served_model_name!r} "
                                 "(GET /v1/models)", "model", status=404, kind="not_found_error",
                                 code="model_not_found")
            prompts = parse_prompts(body.get("prompt"))
            params, stream, include_usage = parse_params(body)
            subs = await _submit(loop, prompts, params)
        except BadRequest as e:
            return _error(e)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_model_name}
        if stream:
            return StreamingResponse(_stream(loop, subs, prompts, head, include_usage), media_type="text/event-stream")
        return await _whole(loop, subs, prompts, head)

    return app


async def _submit(loop: EngineLoop, prompts: list[list[int]], params: SamplingParams) -> list:
    """Hand every prompt to the engine; a ValueError from add_request (vocabulary, max_model_len) is a 400,
    and the prompts already accepted are aborted."""
    aloop = asyncio.get_running_loop()
    subs = [loop.submit(p, params, aloop) for p in prompts]
    bad = None
    for i, s in enumerate(subs):
        try:
            await asyncio.wrap_future(s.request_id)
        except ValueError as e:
            bad = bad or BadRequest(f"prompt{f'[{i}]' if len(prompts) > 1 else ''}: {e}", "prompt")
        except RuntimeError as e:
            bad = bad or BadRequest(str(e), status=503, kind="server_error")
    if bad is not None:
        for s in subs:
            if s.request_id.exception() is None:
                loop.abort(s.request_id.result())
        raise bad
    return subs


async def _next(sub) -> Any:
    item = await sub.outputs.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _finish(reason: str | None) -> str | None:
    return "length" if reason == "length" else ("stop" if reason in ("stop", "abort") else reason)


async def _whole(loop: EngineLoop, subs: list, prompts: list[list[int]], head: dict):
    outs = []
    try:
        for s in subs:
            while not (out := await _next(s)).finished:
                pass
            outs.append(out)
    except Exception as e:  # noqa: BLE001 - the engine failed mid-request
        for s in subs:
            loop.abort(s.request_id.result())
        return JSONResponse(error_body(f"the engine failed: {type(e).__name__}: {e}", "server_error", code=500),
                            status_code=500)
    choices = [{"index": i, "text": ids_text(o.token_ids), "token_ids": list(o.token_ids),
                "logprobs": logprobs_body(o.token_ids, o.logprobs), "finish_reason": _finish(o.finish_reason)}
               for i, o in enumerate(outs)]
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return JSONResponse({**head, "choices": choices,
                         "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})


async def _stream(loop: EngineLoop, subs: list, prompts: list[list[int]], head: dict, include_usage: bool):
    """SSE chunks: each engine output's new token ids as one chunk per choice, then usage (if asked), [DONE].
    A client that goes away (the generator closed or cancelled) aborts its requests."""
    sent = [0] * len(subs)
    chars = [0] * len(subs)  # the text each choice has streamed so far (its logprobs' text_offset)
    done = [False] * len(subs)

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    pending: dict = {}
    try:
        pending = {asyncio.ensure_future(_next(s)): i for i, s in enumerate(subs)}
        while pending:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                i = pending.pop(task)
                try:
                    out = task.result()
                except Exception as e:  # noqa: BLE001
                    yield event(error_body(f"the engine failed: {type(e).__name__}: {e}", "server_error", code=500))
                    return
                new = out.token_ids[sent[i]:]
                reason = _finish(out.finish_reason) if out.finished else None
                if new or reason:
                    text = ids_text(new, lead=sent[i] > 0)
                    lps = None if out.logprobs is None else out.logprobs[sent[i]:]
                    yield event({**head, "choices": [{"index": i, "text": text, "token_ids": list(new),
                                                      "logprobs": logprobs_body(new, lps, chars[i], sent[i] > 0),
                                                      "finish_reason": reason}]})
                    chars[i] += len(text)
                sent[i] = len(out.token_ids)
                if out.finished:
                    done[i] = True
                else:
                    pending[asyncio.ensure_future(_next(subs[i]))] = i
        if include_usage:
            n_in, n_out = sum(len(p) for p in prompts), sum(sent)
            yield event({**head, "choices": [],
                         "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})
        yield "data: [DONE]\n\n"
    finally:
        for task in pending:
            task.cancel()
        for i, s in enumerate(subs):
            if not done[i]:
                loop.abort(s.request_id.result())
