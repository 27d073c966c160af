"""The answers of ``POST /v1/completions``: a whole JSON body, or server-sent events token by token.

:func:`whole` waits for every choice's last output (a client that disconnects first aborts them);
:func:`stream` sends each engine output's new token ids as one ``data: {...}`` chunk per choice, the
usage (if asked) and ``data: [DONE]``, and aborts the requests of a client that goes away. Without a tokenizer a choice's ``text`` is its token
ids joined by single spaces (:func:`ids_text`); ``logprobs`` is OpenAI's completions shape
(:func:`logprobs_body`).

Example
-------
>>> ids_text([5, 17]), _finish("abort")
('5 17', 'stop')
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import JSONResponse, Response

from cpattn.serve.engine_loop import EngineLoop
from cpattn.serve.requests import error_body

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


async def _next(sub) -> Any:
    item = await sub.outputs.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _finish(reason: str | None) -> str | None:
    return "length" if reason == "length" else ("stop" if reason in ("stop", "abort") else reason)


async def whole(loop: EngineLoop, subs: list, prompts: list[list[int]], head: dict, gone=None,
                poll_s: float = 0.25):
    """The JSON answer once every choice has finished. ``gone``: an async callable (Starlette's
    ``request.is_disconnected``) asked every ``poll_s`` seconds; a client that went away aborts its
    requests (their blocks freed), as a closed stream does."""
    async def collect() -> list:
        outs = []
        for s in subs:
            while not (out := await _next(s)).finished:
                pass
            outs.append(out)
        return outs

    task = asyncio.ensure_future(collect())
    try:
        while not (await asyncio.wait({task}, timeout=None if gone is None else poll_s))[0]:
            if await gone():
                task.cancel()
                for s in subs:
                    loop.abort(s.request_id.result())
                return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        outs = task.result()
    except Exception as e:  # noqa: BLE001 - the engine failed mid-request
        for s in subs:
            loop.abort(s.request_id.result())
        return JSONResponse(error_body(f"the engine failed: {type(e).__name__}: {e}", "server_error", code=500),
                            status_code=500)
    finally:
        task.cancel()  # a no-op once it finished; the handler itself cancelled: stop waiting for outputs
    choices = [{"index": i, "text": ids_text(o.token_ids), "token_ids": list(o.token_ids),
                "logprobs": logprobs_body(o.token_ids, o.logprobs), "finish_reason": _finish(o.finish_reason)}
               for i, o in enumerate(outs)]
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return JSONResponse({**head, "choices": choices,
                         "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})


async def stream(loop: EngineLoop, subs: list, prompts: list[list[int]], head: dict, include_usage: bool):
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
