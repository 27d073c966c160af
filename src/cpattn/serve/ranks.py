"""``cpattn serve`` on real ranks: rank 0 serves HTTP, every rank runs the same engine steps.

The engine is deterministic (:mod:`cpattn.engine.llm`: the scheduler and
block manager are host-side, so every rank's copy makes the same choices
from the same calls), so only what arrives from outside has to travel:
each turn of rank 0's :class:`~cpattn.serve.engine_loop.EngineLoop`, its
:class:`Mirror` sends the engine calls that turn made (``("add", rid,
prompt, params)`` for accepted requests, ``("abort", rid)``) and whether
the loop stops, to every other rank, *before* the turn's step. The other
ranks run :func:`follow`: receive a turn, make the same calls, step when
the engine has unfinished work (rank 0 steps exactly then too), until a
turn says stop. An idle rank 0 still sends an empty turn every
``idle_wait_s`` (0.5 s), so no follower waits out a collective timeout.

A turn is one all-reduce of ``[length, stop]`` (int64; the other ranks
add zeros) and, when it has calls, a second of the calls as JSON (UTF-8
bytes zero-padded to int64 words): request data from clients is never
unpickled. Collectives, not ``Group.send`` / ``recv``: on gloo (2 ranks, 2
loaded cores) an empty turn and one more small all-reduce take 0.24 ms
(median of 300), a turn adding a 2000-token prompt 0.8 ms; sent point to
point (a length, then the body) they took 2.2-5.3 ms and 4.0 ms, a third
of the tiny model's decode step. :func:`params_json` / :func:`params_from` turn a
:class:`~cpattn.engine.sampling.SamplingParams` into JSON and back exactly
(floats by their repr).

Example (the simulated mesh: the same code as gloo ranks)
-------
>>> import cpattn, torch
>>> def rank(g):
...     if g.rank == 0:
...         Mirror(g).send([("add", "req-0", [1, 2], SamplingParams(max_tokens=2, temperature=0.5))], False)
...         return Mirror(g).send([], True)
...     return [receive(g), receive(g)]
>>> out = cpattn.simulate(3, rank)
>>> out[1] == out[2], out[2][1]
(True, {'calls': [], 'stop': True})
>>> out[1][0]["calls"][0][3] == SamplingParams(max_tokens=2, temperature=0.5)
True
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.outputs import RequestOutputKind
from cpattn.engine.sampling import SamplingParams


def params_json(p: SamplingParams) -> dict:
    """A SamplingParams as a JSON-able dict.

    >>> params_json(SamplingParams(max_tokens=3, stop_token_ids=(7,)))["stop_token_ids"]
    [7]
    """
    d = dataclasses.asdict(p)
    d["stop_token_ids"], d["output_kind"] = list(d["stop_token_ids"]), p.output_kind.name
    return d


def params_from(d: dict) -> SamplingParams:
    """The SamplingParams of :func:`params_json`'s dict.

    >>> p = SamplingParams(max_tokens=3, stop_token_ids=(7,), temperature=0.7, top_p=0.9, seed=2**62,
    ...                    output_kind=RequestOutputKind.DELTA)
    >>> params_from(json.loads(json.dumps(params_json(p)))) == p
    True
    """
    return SamplingParams(**{**d, "stop_token_ids": tuple(d["stop_token_ids"]),
                             "output_kind": RequestOutputKind[d.get("output_kind", "CUMULATIVE")]})


def _wire(calls: list[tuple]) -> list[list]:
    out = []
    for c in calls:
        out.append(["add", c[1], list(c[2]), params_json(c[3])] if c[0] == "add" else ["abort", c[1]])
    return out


class Mirror:
    """Rank 0's side: ``send(calls, stop)`` gives one turn to every other rank of ``world`` (module doc)."""

    def __init__(self, world: Group) -> None:
        self.world = world
        self.turns = 0  # turns sent

    def send(self, calls: list[tuple], stop: bool) -> None:
        data = json.dumps(_wire(calls)).encode() if calls else b""
        self.world.all_reduce(torch.tensor([len(data), int(bool(stop))], dtype=torch.int64))
        if data:
            self.world.all_reduce(_words(data))
        self.turns += 1


def _words(data: bytes) -> torch.Tensor:
    """``data`` zero-padded to whole int64 words (an all-reduce with the others' zeros carries it exactly)."""
    return torch.frombuffer(bytearray(data + bytes(-len(data) % 8)), dtype=torch.int64)


def receive(world: Group) -> dict:
    """One turn from rank 0: ``{"calls": [(kind, rid, prompt, SamplingParams) | (kind, rid)], "stop": bool}``."""
    n, stop = world.all_reduce(torch.zeros(2, dtype=torch.int64)).tolist()
    wire = []
    if n:
        words = world.all_reduce(torch.zeros(-(-n // 8), dtype=torch.int64))
        wire = json.loads(words.numpy().tobytes()[:n].decode())
    calls = [("add", c[1], c[2], params_from(c[3])) if c[0] == "add" else ("abort", c[1]) for c in wire]
    return {"calls": calls, "stop": bool(stop)}


def follow(engine: Any, world: Group) -> int:
    """A rank other than 0: make rank 0's engine calls and steps until it stops; returns the steps run.

    A call that rank 0 made but this rank refuses means the ranks diverged: a RuntimeError."""
    steps = 0
    while True:
        turn = receive(world)
        for call in turn["calls"]:
            if call[0] == "add":
                try:
                    engine.add_request(call[2], call[3], request_id=call[1])
                except ValueError as e:
                    raise RuntimeError(f"rank {world.rank}: request {call[1]!r} was accepted by rank 0 but refused "
                                       f"here ({e}); the ranks diverged") from e
            else:
                engine.abort_request(call[1])
        if turn["stop"]:
            return steps
        if engine.has_unfinished():
            engine.step()
            steps += 1
