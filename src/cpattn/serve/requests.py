"""What a ``POST /v1/completions`` body asks for: prompts as token ids and the engine's SamplingParams.

:func:`parse_prompts` and :func:`parse_params` read the body's fields (OpenAI's names, and vLLM's
``stop_token_ids`` / ``top_k``) and raise :class:`BadRequest` -- a 400 in OpenAI's error shape
(:func:`error_body`) naming the field, the value seen and what is accepted -- for anything else:
fields this server does not implement (``n`` > 1, ``best_of``, ``echo``, ``suffix``, ``stop``
strings without a tokenizer), a text prompt, a sampling field out of its range.

Example
-------
>>> parse_prompts([[1, 2], [3]])
[[1, 2], [3]]
>>> parse_params({"max_tokens": 2, "temperature": 0})[0].greedy
True
"""

from __future__ import annotations

import json
from typing import Any

from cpattn.engine.sampling import SamplingParams

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


def parse_prompts(prompt: Any, vocab: int | None = None) -> list[list[int]]:
    """``prompt`` of a completions request -> a list of token-id lists (raises BadRequest).

    >>> parse_prompts([1, 2, 3]), parse_prompts([[1], [2, 3]])
    ([[1, 2, 3]], [[1], [2, 3]])
    >>> parse_prompts("hello")
    Traceback (most recent call last):
    ...
    cpattn.serve.requests.BadRequest: prompt: saw a text prompt ('hello'); the embedded model has no tokenizer, so prompts must be token ids: pass prompt=[id, ...] or [[id, ...], ...]
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
    cpattn.serve.requests.BadRequest: top_p: saw 1.5; expected 0 < top_p <= 1 (1 keeps the whole distribution)
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
