"""What the step loop hands back: a request's :class:`RequestOutput` after each step (a step's rows:
:func:`step_outputs`, or :func:`one_token_outputs` for a steady decode step), the engine's
:class:`EngineStats`, and :func:`drain` (submit every prompt, step until all finish).

>>> RequestOutput(0, (1, 2), (7,), True, "length").token_ids
(7,)
>>> EngineStats().blocks_used
0
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: every output token so far; ``finish_reason`` "stop" / "length" /
    "abort" once ``finished``; ``logprobs`` (when its ``SamplingParams.logprobs`` is set, else None):
    per output token so far, ``{token_id: logprob}`` of the sampled token and the N most likely ones,
    from the model's raw logits (before temperature / top-k / top-p, as vLLM's default). With
    ``LLMEngine(return_logits=True)``: ``logits`` [n, V] the raw logits row each output token so far came
    from; with ``return_prompt_logits=True``: ``prompt_logits`` [m, V] the logits of the prompt's last m
    positions, once computed (:mod:`cpattn.engine.returns`). Else None."""

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    logprobs: tuple[dict[int, float], ...] | None = None
    logits: Any = field(default=None, compare=False)  # tensors: not part of ==
    prompt_logits: Any = field(default=None, compare=False)


_new = object.__new__


def request_output(request_id: Hashable, prompt_token_ids: tuple[int, ...], token_ids: tuple[int, ...],
                   finished: bool, finish_reason: str | None, logprobs: tuple | None = None, logits=None,
                   prompt_logits=None) -> RequestOutput:
    """``RequestOutput(...)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
    field): the fields go into the new instance's ``__dict__``, as ``__init__`` leaves them -- the same
    object (equal, hashed, printed, frozen alike). The step loop builds one per row per step.

    >>> request_output(0, (1, 2), (7,), True, "length") == RequestOutput(0, (1, 2), (7,), True, "length")
    True
    """
    o = _new(RequestOutput)
    d = o.__dict__
    d["request_id"], d["prompt_token_ids"], d["token_ids"] = request_id, prompt_token_ids, token_ids
    d["finished"], d["finish_reason"], d["logprobs"] = finished, finish_reason, logprobs
    d["logits"], d["prompt_logits"] = logits, prompt_logits
    return o


def step_outputs(req_ids: Sequence[Hashable], requests: dict, prompts: dict, held: dict,
                 fields=None) -> list[RequestOutput]:
    """The :class:`RequestOutput` of each row of a committed step, in row order.

    requests: the scheduler's (their ``tokens`` hold this step's commit; a request this step finished, or
    one finished earlier, has status "finished"); prompts: ``{req_id: prompt tuple}``; held: ``{req_id:
    output tokens as last returned}`` of unfinished requests, kept here -- a row's tuple is extended by the
    tokens committed since (append-only), a finished request's dropped; fields: ``fields(req_id, finished,
    num_prompt) -> (logprobs, logits, prompt_logits)`` when the engine keeps any of them
    (:meth:`cpattn.engine.returns.Returns.fields`), None when it keeps none.

    >>> from cpattn.engine.step_types import Request
    >>> reqs = {0: Request(0, [1, 2, 7], 2, 4, frozenset(), status="running")}
    >>> held = {}
    >>> [o.token_ids for o in step_outputs([0], reqs, {0: (1, 2)}, held)], held
    ([(7,)], {0: (7,)})
    """
    outs = []
    for rid in req_ids:
        req = requests[rid]
        toks, ids = req.tokens, held.get(rid, ())
        start = req.num_prompt + len(ids)
        if len(toks) == start + 1:  # one token committed (a decode, a prompt's last chunk)
            ids += (toks[-1],)
        elif len(toks) > start:  # accepted drafts, or the first step of a request with tokens already
            ids += tuple(toks[start:])
        finished = req.status == "finished"
        extra = () if fields is None else fields(rid, finished, req.num_prompt)  # (logprobs, logits, prompt)
        if finished:
            held.pop(rid, None)
        else:
            held[rid] = ids
        outs.append(request_output(rid, prompts[rid], ids, finished, req.finish_reason, *extra))
    return outs


def one_token_outputs(step, tokens: Sequence[int], prompts: dict, held: dict) -> list[RequestOutput] | None:
    """:func:`step_outputs` of a step whose every row committed exactly ``tokens[b]`` and none finished (the
    steady decode step), without reading the requests: row b's output tokens are its tuple last returned
    (``held``, kept here) plus ``tokens[b]``, once that tuple is as long as ``step.num_output[b]`` (the
    outputs it had when scheduled); its RequestOutput is built inline (:func:`request_output`'s fields:
    unfinished, nothing else kept). None when a row's held tuple is not that long (never returned yet, or
    ``num_output`` not filled): the caller then runs :func:`step_outputs`, which finishes the rows left
    (those extended here read as up to date).

    >>> from types import SimpleNamespace
    >>> step = SimpleNamespace(req_ids=(0, 1), num_output=(1, 1))
    >>> held = {0: (7,), 1: (8,)}
    >>> [o.token_ids for o in one_token_outputs(step, [5, 6], {0: (1,), 1: (2,)}, held)], held[1]
    ([(7, 5), (8, 6)], (8, 6))
    >>> one_token_outputs(SimpleNamespace(req_ids=(2,), num_output=(1,)), [5], {2: (3,)}, held) is None
    True
    """
    outs = []
    for rid, t, n in zip(step.req_ids, tokens, step.num_output):
        ids = held.get(rid, ())
        if len(ids) != n:
            return None
        held[rid] = ids = ids + (t,)
        o = _new(RequestOutput)
        d = o.__dict__
        d["request_id"], d["prompt_token_ids"], d["token_ids"], d["finished"] = rid, prompts[rid], ids, False
        d["finish_reason"] = d["logprobs"] = d["logits"] = d["prompt_logits"] = None
        outs.append(o)
    return outs if len(outs) == len(step.req_ids) else None


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started (vLLM exposes the same to its metrics).

    steps: steps run (``replayed_steps`` from a captured program, ``eager_steps`` eagerly);
    prefix_hit_tokens / prefix_query_tokens: prompt tokens found cached / looked up;
    preemptions; blocks_used / blocks_free (KV blocks per rank); running / waiting requests;
    bytes_sent: what DCP rank 0 sent in all steps; last_step_bytes: in the last one;
    drafted_tokens / accepted_tokens: draft tokens verified / accepted (speculative decoding);
    pcp_steps: steps whose prefill chunks ran PCP; pool_hit_tokens: prompt tokens fetched from the KV
    pool (the second tier); pool_blocks_stored: pool blocks written; dp_prefill_steps / dp_prefill_tokens:
    steps whose short prefill chunks ran one rank each (elastic CP's data-parallel prefill) and those chunks'
    new tokens.
    """

    steps: int = 0
    replayed_steps: int = 0
    eager_steps: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preemptions: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    running: int = 0
    waiting: int = 0
    bytes_sent: int = 0
    last_step_bytes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    pcp_steps: int = 0
    pool_hit_tokens: int = 0
    pool_blocks_stored: int = 0
    dp_prefill_steps: int = 0
    dp_prefill_tokens: int = 0


def drain(engine, prompts: Sequence[Sequence[int]], params=None) -> list[RequestOutput]:
    """Add every prompt to ``engine`` (anything with add_request / step / has_unfinished), step until all
    finish; the final :class:`RequestOutput` of each, in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[i] for i in ids]
