"""What the step loop hands back: a request's :class:`RequestOutput` after each step (a step's rows:
:func:`step_outputs`, or :func:`one_token_outputs` for a steady decode step), in the request's
:class:`RequestOutputKind` (vLLM's three: every token so far, the new ones, or the final output only), the
engine's :class:`EngineStats`, and :func:`drain` (submit every prompt, step until all finish).

>>> RequestOutput(0, (1, 2), (7,), True, "length").token_ids
(7,)
>>> EngineStats().blocks_used
0
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RequestOutputKind(Enum):
    """What a request's :class:`RequestOutput` carries after a step (``SamplingParams.output_kind``, vLLM's enum):
    CUMULATIVE every output token so far (the default), DELTA only the tokens new since its last output (a
    streaming server's choice), FINAL_ONLY nothing until it finishes, then every token (vLLM's offline
    ``LLM.generate``; no per-step objects at all: the cheapest for the host).

    >>> RequestOutputKind["DELTA"].value
    1
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


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
                 fields=None, kinds: dict | None = None) -> list[RequestOutput]:
    """The :class:`RequestOutput` of each row of a committed step, in row order.

    requests: the scheduler's (their ``tokens`` hold this step's commit; a request this step finished, or
    one finished earlier, has status "finished"); prompts: ``{req_id: prompt tuple}``; held: ``{req_id:
    output tokens as last returned}`` of unfinished requests, kept here -- a row's tuple is extended by the
    tokens committed since (append-only), a finished request's dropped; fields: ``fields(req_id, finished,
    num_prompt) -> (logprobs, logits, prompt_logits)`` when the engine keeps any of them
    (:meth:`cpattn.engine.returns.Returns.fields`), None when it keeps none; kinds: ``{req_id: kind}`` of
    the unfinished requests whose :class:`RequestOutputKind` is not CUMULATIVE (None: none; a finished row's
    entry is dropped here): a DELTA row returns the
    tokens committed since its last output (and their logprobs / logits rows), only when there are some or it
    finished (``held`` keeps its count of tokens returned); a FINAL_ONLY row returns nothing until it finishes.

    >>> from cpattn.engine.step_types import Request
    >>> reqs = {0: Request(0, [1, 2, 7], 2, 4, frozenset(), status="running")}
    >>> held = {}
    >>> [o.token_ids for o in step_outputs([0], reqs, {0: (1, 2)}, held)], held
    ([(7,)], {0: (7,)})
    """
    outs = []
    for rid in req_ids:
        req = requests[rid]
        if kinds is not None and rid in kinds:
            o = _other_kind(kinds.pop(rid) if req.status == "finished" else kinds[rid], req, prompts[rid], held, fields)
            if o is not None:
                outs.append(o)
            continue
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


def _other_kind(kind: RequestOutputKind, req, prompt: tuple, held: dict, fields) -> RequestOutput | None:
    """A DELTA or FINAL_ONLY row's output of this step (:func:`step_outputs`), or None when it has none."""
    finished = req.status == "finished"
    if kind is FINAL_ONLY and not finished:
        return None
    sent = held.pop(req.req_id, 0) if finished else held.get(req.req_id, 0)
    new = tuple(req.tokens[req.num_prompt + sent:])
    if not new and not finished:
        return None
    if not finished:
        held[req.req_id] = sent + len(new)
    lp, logits, prompt_logits = (None, None, None) if fields is None else fields(req.req_id, finished, req.num_prompt)
    k = len(new)
    if kind is DELTA:  # this output's rows only
        lp = None if lp is None else lp[len(lp) - k:]
        logits = None if logits is None else logits[logits.shape[0] - k:]
    return request_output(req.req_id, prompt, new, finished, req.finish_reason, lp, logits, prompt_logits)


def one_token_outputs(step, tokens: Sequence[int], prompts: dict, held: dict,
                      kinds: dict | None = None) -> list[RequestOutput] | None:
    """:func:`step_outputs` of a step whose every row committed exactly ``tokens[b]`` and none finished (the
    steady decode step), without reading the requests: row b's output tokens are its tuple last returned
    (``held``, kept here) plus ``tokens[b]``, once that tuple is as long as ``step.num_output[b]`` (the
    outputs it had when scheduled); its RequestOutput is built inline (:func:`request_output`'s fields:
    unfinished, nothing else kept). None when a row's held tuple is not that long (never returned yet, or
    ``num_output`` not filled): the caller then runs :func:`step_outputs`, which finishes the rows left
    (those extended here read as up to date). ``kinds`` as in :func:`step_outputs`: a FINAL_ONLY row has no
    output, a DELTA row's is ``(tokens[b],)``.

    >>> from types import SimpleNamespace
    >>> step = SimpleNamespace(req_ids=(0, 1), num_output=(1, 1))
    >>> held = {0: (7,), 1: (8,)}
    >>> [o.token_ids for o in one_token_outputs(step, [5, 6], {0: (1,), 1: (2,)}, held)], held[1]
    ([(7, 5), (8, 6)], (8, 6))
    >>> one_token_outputs(SimpleNamespace(req_ids=(2,), num_output=(1,)), [5], {2: (3,)}, held) is None
    True
    """
    if len(step.num_output) != len(step.req_ids):
        return None
    if kinds is None:  # all CUMULATIVE: held tuples as long as the outputs scheduled
        if any(len(held.get(rid, ())) != n for rid, n in zip(step.req_ids, step.num_output)):
            return None
    elif any((held.get(rid, 0) if kinds.get(rid) is DELTA else len(held.get(rid, ()))) != n
             for rid, n in zip(step.req_ids, step.num_output) if kinds.get(rid) is not FINAL_ONLY):
        return None
    outs = []
    for rid, t in zip(step.req_ids, tokens):
        kind = None if kinds is None else kinds.get(rid)
        if kind is FINAL_ONLY:
            continue
        if kind is DELTA:
            held[rid], ids = held.get(rid, 0) + 1, (t,)
        else:
            held[rid] = ids = held.get(rid, ()) + (t,)
        o = _new(RequestOutput)
        d = o.__dict__
        d["request_id"], d["prompt_token_ids"], d["token_ids"], d["finished"] = rid, prompts[rid], ids, False
        d["finish_reason"] = d["logprobs"] = d["logits"] = d["prompt_logits"] = None
        outs.append(o)
    return outs


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
