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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpattn.engine.llm import SamplingParams
from cpattn.serve.engine_loop import EngineLoop
from cpattn.serve.metrics import histogram_lines, metrics_text  # noqa: F401 - also importable from here
from cpattn.serve.requests import (MAX_LOGPROBS, BadRequest, error_body, parse_params,  # noqa: F401
                                   parse_prompts)
from cpattn.serve import responses
from cpattn.serve.responses import ids_text, logprobs_body  # noqa: F401


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code or e.status), status_code=e.status)


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
            return StreamingResponse(responses.stream(loop, subs, prompts, head, include_usage),
                                     media_type="text/event-stream")
        return await responses.whole(loop, subs, prompts, head, gone=request.is_disconnected)

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
