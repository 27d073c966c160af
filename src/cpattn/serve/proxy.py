"""A tiny disaggregated-prefill proxy: one OpenAI endpoint in front of a producer and a consumer server.

vLLM's two-server P/D flow, for ``cpattn serve`` servers started with
``--kv-transfer-config '{"kv_connector": "CpattnPoolConnector", "kv_role": "kv_producer"}'`` and
``... "kv_consumer"`` on the same ``--kv-pool lmdb:DIR`` (or ``mooncake:HOST:PORT``). Each
``POST /v1/completions`` goes first to the producer with ``max_tokens`` 1 (not streamed: it prefills
and stores the prompt's KV blocks in the pool), then unchanged to the consumer (it fetches the
blocks and decodes), whose answer -- JSON or server-sent events, relayed chunk by chunk -- is the
client's. A producer error (400, 404, ...) is returned as it is, and nothing reaches the consumer.
``GET /v1/models``, ``/health`` and ``/metrics`` are the consumer's. A client that goes away while
the consumer answers (a closed stream; a plain request, noticed within 0.25 s) ends the proxy's
connection to the consumer, which then aborts the request.

Usage::

    python -m cpattn.serve.proxy --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200 --port 8000

Listens on 127.0.0.1 unless ``--host`` says otherwise; the upstream servers are plain HTTP
addresses (``HOST:PORT``). A bad flag is one line on stderr, exit 2.

Example
-------
>>> address("127.0.0.1:8100")
('127.0.0.1', 8100)
>>> prefill_body({"prompt": [1, 2], "max_tokens": 9, "stream": True, "stream_options": {}})
{'prompt': [1, 2], 'max_tokens': 1, 'stream': False}
"""

import argparse  # no `from __future__ import annotations`: FastAPI reads the handlers' annotations

import asyncio
import http.client
import json
import sys

PROG = "python -m cpattn.serve.proxy"
TIMEOUT_S = 600.0  # one upstream request (a long prefill on CPU takes minutes)
POLL_S = 0.25  # how often a waiting non-streamed request asks whether its client is still there


def address(text: str) -> tuple[str, int]:
    """argparse type: ``HOST:PORT`` -> (host, port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: HOST:PORT of a cpattn serve server, e.g. "
                                         "127.0.0.1:8100")
    return host, int(port)


def prefill_body(body: dict) -> dict:
    """The producer's request: the client's, for one token, not streamed."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    return {**out, "max_tokens": 1, "stream": False}


def _open(addr, method: str, path: str, body=None):
    conn = http.client.HTTPConnection(*addr, timeout=TIMEOUT_S)
    conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
    return conn, conn.getresponse()


def _whole(addr, method: str, path: str, body=None):
    conn, resp = _open(addr, method, path, body)
    try:
        return resp.status, resp.getheader("Content-Type", "application/json"), resp.read()
    finally:
        conn.close()


def _hang_up(conn) -> None:
    """End an upstream connection now, waking the thread blocked reading it."""
    import socket

    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass


async def _ask(addr, body: bytes, gone):
    """POST ``body`` to ``addr``'s /v1/completions in a thread: (status, content type, bytes), or None once
    ``gone()`` (asked every ``POLL_S``) says the client left -- the connection is then ended at once."""
    conn = http.client.HTTPConnection(*addr, timeout=TIMEOUT_S)

    def ask():
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()  # a non-streamed answer's headers come with its body, at the end
        return resp.status, resp.getheader("Content-Type", "application/json"), resp.read()

    task = asyncio.ensure_future(asyncio.to_thread(ask))
    try:
        while not (await asyncio.wait({task}, timeout=POLL_S))[0]:
            if await gone():
                _hang_up(conn)
                return None
        return task.result()
    finally:
        if not task.done():
            task.add_done_callback(lambda t: t.exception())  # the hung-up thread's error: expected, dropped
        conn.close()


async def _events(conn, resp):
    """The consumer's event stream, line by line; done, or the client gone (the generator closed): the
    connection ends, and the consumer aborts the request."""
    try:
        while chunk := await asyncio.to_thread(resp.readline):
            yield chunk
    finally:
        _hang_up(conn)
        conn.close()


def build_proxy(prefill: tuple[str, int], decode: tuple[str, int]):
    """The FastAPI app of the proxy (module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI(title="cpattn serve proxy", docs_url=None, redoc_url=None, openapi_url=None)

    def relay(path: str):
        async def get() -> Response:
            status, kind, data = await asyncio.to_thread(_whole, decode, "GET", path)
            return Response(data, status_code=status, media_type=kind)
        return get

    for path in ("/health", "/metrics", "/v1/models"):
        app.add_api_route(path, relay(path), methods=["GET"])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        gone = request.is_disconnected
        if not isinstance(body, dict):  # not a JSON object: the producer's 400 says so
            got = await _ask(prefill, raw, gone)
        else:
            got = await _ask(prefill, json.dumps(prefill_body(body)).encode(), gone)
            if got is not None and got[0] == 200:  # prefilled: now the whole request, to the consumer
                if not body.get("stream"):
                    got = await _ask(decode, raw, gone)
                else:
                    conn, resp = await asyncio.to_thread(_open, decode, "POST", "/v1/completions", raw)
                    return StreamingResponse(_events(conn, resp), status_code=resp.status,
                                             media_type=resp.getheader("Content-Type", "text/event-stream"))
        if got is None:  # the client went away
            return Response(status_code=499)
        return Response(got[2], status_code=got[0], media_type=got[1])

    return app


def parser() -> argparse.ArgumentParser:
    from cpattn.config import cli_args as cli

    p = cli.parser(PROG, __doc__)
    p.add_argument("--prefill", type=address, required=True, metavar="HOST:PORT",
                   help="the kv_producer server (each request goes there first, for one token)")
    p.add_argument("--decode", type=address, required=True, metavar="HOST:PORT",
                   help="the kv_consumer server (its answer is the client's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning")
    return p


def main(argv=None) -> int:
    """Serve the proxy until SIGINT / SIGTERM (exit 0)."""
    a = parser().parse_args(argv)
    import uvicorn

    from cpattn.serve.run import _Server

    print(f"{PROG}: prefill {a.prefill[0]}:{a.prefill[1]} -> decode {a.decode[0]}:{a.decode[1]} on "
          f"http://{a.host}:{a.port}/v1 ; Ctrl-C stops it", file=sys.stderr, flush=True)
    server = _Server(uvicorn.Config(build_proxy(a.prefill, a.decode), host=a.host, port=a.port,
                                    log_level=a.log_level, access_log=False))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
