"""Text prompts and text outputs for a ``--model DIR`` that carries a ``tokenizer.json``.

The app (:mod:`cpattn.serve.app`) speaks token ids. :class:`TextMiddleware`
wraps it (ASGI) when the checkpoint has a tokenizer (``tokenizers``' file
format, what ``AutoTokenizer`` saves as ``tokenizer.json``):

- a ``POST /v1/completions`` whose ``prompt`` is a string or a list of
  strings has them encoded (no special tokens added) before the app sees the
  body; token-id prompts pass unchanged;
- every choice's ``text`` in the answer becomes the decoded text of its
  ``token_ids``; in a stream each chunk's ``text`` is what its tokens add to
  the text so far (decode of all ids minus decode of the earlier ones), so
  the chunks concatenate to the whole text.

Everything else (errors, other paths) passes through untouched.

Example
-------
>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
>>> tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
>>> encode_prompts(tok, "a b b"), encode_prompts(tok, ["b", "a a"]), encode_prompts(tok, [0, 1])
([0, 1, 1], [[1], [0, 0]], [0, 1])
>>> Incremental(tok).add([0, 1]), Incremental(tok).add([])
('a b', '')
"""

from __future__ import annotations

import json
import os
from typing import Any

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(model_dir: str):
    """The ``tokenizers.Tokenizer`` of ``model_dir/tokenizer.json``; None when there is no such file.
    Raises ValueError naming the file when it cannot be read."""
    path = os.path.join(model_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{path} needs the tokenizers package, which is not installed; pip install tokenizers") \
            from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises its own Exception type for a bad file
        raise ValueError(f"{path} is not a readable tokenizers file ({str(e)[:120]})") from None


def encode_prompts(tokenizer: Any, prompt: Any) -> Any:
    """A text prompt (or list of them) as token ids; anything else unchanged (the app checks it)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False).ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p, add_special_tokens=False).ids for p in prompt]
    return prompt


class Incremental:
    """One choice's detokenizer in a stream: ``add(new_ids)`` returns the text they add."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def add(self, new: list[int]) -> str:
        if not new:
            return ""
        self.ids += list(new)
        text = self.tokenizer.decode(self.ids)
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta


class TextMiddleware:
    """ASGI middleware: text prompts in, text out, for ``/v1/completions`` (module docstring)."""

    def __init__(self, app: Any, tokenizer: Any) -> None:
        self.app, self.tokenizer = app, tokenizer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != "/v1/completions":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([msg], receive), send)
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            obj = json.loads(body)
            if isinstance(obj, dict) and "prompt" in obj:
                obj["prompt"] = encode_prompts(self.tokenizer, obj["prompt"])
                body = json.dumps(obj).encode()
        except (ValueError, UnicodeDecodeError):  # not JSON: the app answers its 400
            pass
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                       _Rewriter(send, self.tokenizer).send)


def _replay(first: list[dict], receive):
    queue = list(first)

    async def replayed():
        return queue.pop(0) if queue else await receive()

    return replayed


class _Rewriter:
    """The response side: JSON answers rewritten whole, server-sent events chunk by chunk."""

    def __init__(self, send, tokenizer) -> None:
        self._send, self.tokenizer = send, tokenizer
        self.start: dict | None = None
        self.stream = False
        self.buffer = b""
        self.choices: dict[int, Incremental] = {}

    async def send(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            ctype = dict((k.lower(), v) for k, v in msg.get("headers", [])).get(b"content-type", b"")
            self.stream = ctype.startswith(b"text/event-stream")
            if self.stream:
                return await self._send(msg)
            self.start = msg
            return None
        if msg["type"] != "http.response.body":
            return await self._send(msg)
        self.buffer += msg.get("body", b"")
        more = msg.get("more_body", False)
        if self.stream:
            events, _, self.buffer = self.buffer.rpartition(b"\n\n")
            out = b"".join(self._event(e) + b"\n\n" for e in events.split(b"\n\n")) if events else b""
            if not more and self.buffer:
                out, self.buffer = out + self.buffer, b""
            return await self._send({**msg, "body": out})
        if more:
            return None
        body = self._whole(self.buffer)
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self._send({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        return await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _whole(self, body: bytes) -> bytes:
        try:
            obj = json.loads(body)
        except ValueError:
            return body
        for c in obj.get("choices", []) if isinstance(obj, dict) else []:
            if isinstance(c, dict) and isinstance(c.get("token_ids"), list):
                c["text"] = self.tokenizer.decode(c["token_ids"])
        return json.dumps(obj).encode()

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        for c in obj.get("choices", []) if isinstance(obj, dict) else []:
            if isinstance(c, dict) and isinstance(c.get("token_ids"), list):
                inc = self.choices.setdefault(c.get("index", 0), Incremental(self.tokenizer))
                c["text"] = inc.add(c["token_ids"])
        return b"data: " + json.dumps(obj).encode()
