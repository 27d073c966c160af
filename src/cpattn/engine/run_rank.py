"""One per-rank composition of the step loop: ``run_rank(world, ...)`` on every rank, simulated or gloo.

The same function runs on every rank of a world: ``cpattn.simulate(n, run_rank, ...)``
runs it on threads, and ``cpattn.comm.launch.spawn`` (or torchrun) runs it in processes.
Both give the same tokens. The layout decides each rank's role:

- **colocated** (``pd=False``): one :class:`~cpattn.engine.llm.LLMEngine` over the whole world.
  Its KV is sharded over the world's ranks (DCP). With ``pcp_size = world.size`` the prompt
  chunks run PCP over the same ranks, and ``dcp_size`` may then be smaller: DCP over the first
  ``dcp_size`` ranks (the demo's ``--pcp 2 --dcp 1``).
- **P/D** (``pd=True``, ``world.size = pcp_size + dcp_size``): ranks ``0 .. P-1`` are the producer
  engine, which prefills with PCP and stops at the first token. Ranks ``P ..`` are the consumer
  engine, which decodes with DCP. The KV goes through the KV connector
  (:mod:`cpattn.engine.connector`). By default that is the P/D connector: each producer rank sends
  the whole blocks it holds to their consumer ranks over ``world``. With ``kv_pool`` it is a store
  every rank opens (a :class:`~cpattn.engine.pooling.PoolSpec`: LMDB or Mooncake; on the simulated
  mesh an open in-process pool works too), or both composed. This is
  :class:`~cpattn.engine.pd_engine.PDEngine` spread over a world.

One world step runs in this order:

1. Every rank adds this step's arrivals. The list is the same on every rank; the producer, or
   the colocated engine, takes them.
2. The producer ranks step. A pool connector stores each rank's whole blocks, then they meet at
   a barrier. The P/D connector stages the whole blocks of the requests that finished.
3. Producer rank 0 tells every other rank which requests finished their prefill, their first
   tokens and the blocks a pool holds of them: a count, then ``[n, 3]`` rows. Then each producer
   rank sends its blocks of those requests, except the ones the pool holds, to their consumer
   ranks (:func:`~cpattn.engine.connector_pd.producer_hand_off`).
4. The consumer ranks receive them, add those requests and step. A consumer that samples a
   different first token is a ``RuntimeError``.
5. An all-reduce over the world of "work left" ends the loop on every rank in the same step.

Each rank returns ``{arrival index: RequestOutput}`` for the requests its role finished.

Example
-------
>>> import cpattn
>>> from cpattn.models import qwen3
>>> from cpattn.engine.pd_engine import memory_pool
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> arrivals = [Arrival(list(range(1, 12)), SamplingParams(max_tokens=3)), Arrival([4, 5], SamplingParams(max_tokens=2), 1)]
>>> colocated = cpattn.simulate(2, run_rank, "qwen3", params, cfg, arrivals, block_size=4)
>>> pool = memory_pool("qwen3", cfg, params, 4)
>>> pd = cpattn.simulate(3, run_rank, "qwen3", params, cfg, arrivals, pd=True, pcp_size=2, dcp_size=1,
...                      block_size=4, kv_pool=pool)
>>> direct = cpattn.simulate(3, run_rank, "qwen3", params, cfg, arrivals, pd=True, pcp_size=2, block_size=4)
>>> [o.token_ids for o in colocated[0].values()] == [o.token_ids for o in pd[2].values()], pd[0]
(True, {})
>>> [o.token_ids for o in direct[2].values()] == [o.token_ids for o in pd[2].values()]
True
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import GuideCompatWarning, SchedulerConfig
from cpattn.engine.connector import from_args as connector_args
from cpattn.engine.connector_pd import GroupLink, PDConnector, consumer_hand_off, producer_hand_off
from cpattn.engine.llm import LLMEngine, RequestOutput, SamplingParams
from cpattn.engine.pd_engine import check_first, hands_off, hidden_carrier, producer_hidden
from cpattn.models.family import get_family
from cpattn.dcp.layer_merges import ENGINE_MERGE


@dataclass(frozen=True)
class Arrival:
    """A request of a schedule: its prompt token ids and params, arriving at world step ``step``."""

    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()
    step: int = 0


def _seeded(arrivals: Sequence[Arrival], seed: int) -> list[SamplingParams]:
    """Each arrival's params, with a seed drawn from ``seed`` where it has none (the same on every rank)."""
    rng = random.Random(seed)
    out = []
    for a in arrivals:
        draw = rng.randrange(2**63)
        out.append(dataclasses.replace(a.params, seed=draw) if getattr(a.params, "seed", 0) is None else a.params)
    return out


def run_rank(world: Group, model, params: dict, cfg: Any, arrivals: Sequence[Arrival], *, pd: bool = False,
             pcp_size: int = 1, dcp_size: int | None = None, block_size: int = 16, interleave_size: int = 1,
             scheduler: SchedulerConfig | None = None, kv_pool=None, graph_mode: str = "NONE",
             graph_backend: str = "auto", capture_sizes=None, num_blocks: int | None = None, poison: bool = False,
             seed: int = 0, on_step: Callable[[str, LLMEngine, list[RequestOutput]], None] | None = None,
             max_steps: int = 100_000, merge: str = ENGINE_MERGE,
             before_step: Callable[[str, LLMEngine], None] | None = None,
             kv_connector=None, return_logits: bool = False,
             return_prompt_logits: bool = False, drafter=None,
             num_speculative_tokens: int = 0, algorithms=None,
             on_start: Callable[[str, LLMEngine], None] | None = None) -> dict[int, RequestOutput]:
    """The step loop on this rank of ``world`` (module doc): ``{arrival index: final RequestOutput}`` of
    the requests this rank's role finished.

    Arguments
    ---------
    world: this rank's group (every rank calls with the same arguments).
    model, params, cfg: a family (or its name), its weights, its config.
    arrivals: the schedule (:class:`Arrival` or ``(prompt, params, step)`` tuples).
    pd: P/D roles; pcp_size: the producer's ranks (colocated: PCP chunks over the first ``pcp_size``
        ranks, 1 .. ``world.size``);
        dcp_size: the consumer's ranks (colocated: ``world.size``, the default; fewer with ``pcp_size =
        world.size``: the decodes run DCP over the world's first ``dcp_size`` ranks, the others hold no KV,
        :mod:`cpattn.engine.runner_wide`).
    block_size, interleave_size (P/D: ``block_size``), scheduler, num_blocks, poison: per engine, as
        :class:`~cpattn.engine.llm.LLMEngine`. kv_pool: the prefix cache's second tier (P/D: the
        connector both roles open). kv_connector: any :class:`~cpattn.engine.connector.KVConnector`
        instead; P/D without either: :class:`~cpattn.engine.connector_pd.PDConnector`, blocks sent
        producer rank to consumer rank over ``world`` (``PoolConnector(pool) + PDConnector()``: the
        blocks found in the pool are not sent).
    graph_mode / graph_backend / capture_sizes: the decoding engine's capture; merge: its DCP merge
        (:data:`cpattn.engine.paged_cache.STEP_MERGES`). algorithms: every engine's (colocated, P/D producer and
        consumer: :class:`~cpattn.engine.llm.LLMEngine`'s ``algorithms``; None: the runners' own choices).
    seed: draws the seed of each arrival that brings none. on_step: called after each step of this
        rank's engine with (role: "colocated" / "prefill" / "decode", engine, the step's outputs); it may
        stop a request (``engine.abort_request``): the request's output of that step is then its final one
        (``finished``, ``finish_reason="abort"``), and a producer does not hand it off.
    before_step: called with (role, engine) once the step's requests are added, just before the engine
        steps (a step's time is from here to ``on_step``; every rank of a role calls both hooks each step,
        so a hook may run a collective over its role's ranks, e.g. a barrier). on_start: called once with (role,
        engine) on every rank, its engine built, before the first step (a collective over ``world`` may run
        there: a start line for timings).
    return_logits / return_prompt_logits: every engine's (:class:`~cpattn.engine.llm.LLMEngine`, opt-in); under
        P/D the prompt logits stay on the producer ranks (their outputs are handed off, not returned).
    drafter / num_speculative_tokens: speculative decoding on the colocated engine, or under P/D on the
        consumer; a drafter that reads the target's hidden states (MTP, Eagle3, DSpark) gets the producer's
        hidden rows of the prompt, sent with the blocks by the P/D connector (:mod:`cpattn.engine.connector_pd`;
        DeepSeek-V4 and hybrid models: every prompt position's, with the state).
    """
    arrivals = [a if isinstance(a, Arrival) else Arrival(*a) for a in arrivals]
    sampling = _seeded(arrivals, seed)
    last = max((a.step for a in arrivals), default=0)
    connector = connector_args(kv_pool, kv_connector)
    common = dict(block_size=block_size, scheduler=scheduler, num_blocks=num_blocks, poison=poison,
                  kv_connector=connector, return_logits=return_logits, return_prompt_logits=return_prompt_logits,
                  algorithms=algorithms)
    decode_opts = dict(graph_mode=graph_mode, graph_backend=graph_backend, capture_sizes=capture_sizes, merge=merge,
                       drafter=drafter, num_speculative_tokens=num_speculative_tokens)
    if not pd:
        n = world.size if dcp_size is None else dcp_size
        if n != world.size and pcp_size != world.size:
            raise ValueError(f"dcp_size={dcp_size} on a world of {world.size} ranks: colocated, the engine spans the "
                             f"world (DCP over it, or PCP over it and DCP over its first dcp_size ranks); pass "
                             f"dcp_size={world.size}, pcp_size={world.size} or pd=True")
        role, group = "colocated", world
        engine = _engine(model, params, cfg, world, pcp_size=pcp_size, dcp_size=n, interleave_size=interleave_size,
                         **common, **decode_opts)
    else:
        role, engine = pd_role(world, model, params, cfg, pcp_size=pcp_size, dcp_size=dcp_size or 1, **common,
                               **decode_opts)
    final, first = {}, {}
    try:
        if on_start is not None:
            on_start(role, engine)
        for step in range(max_steps):
            if role != "decode":
                for i, a in enumerate(arrivals):
                    if a.step == step:
                        p = dataclasses.replace(sampling[i], max_tokens=1) if pd else sampling[i]
                        engine.add_request(a.prompt, p, request_id=i)
            if pd and role == "decode":
                for h in consumer_hand_off(world, engine.connector, lambda i: arrivals[i].prompt):
                    engine.add_request(arrivals[h.request_id].prompt, sampling[h.request_id], request_id=h.request_id)
                    first[h.request_id] = h.first_token
            if before_step is not None:
                before_step(role, engine)
            outs = engine.step() if engine.has_unfinished() else []
            if on_step is not None:
                on_step(role, engine, outs)
            handed = []
            for o in outs:
                if role == "decode":
                    check_first(o, first)
                if not o.finished:
                    if on_step is None or not _aborted(engine, o.request_id):
                        continue
                    o = dataclasses.replace(o, finished=True, finish_reason="abort")  # the hook stopped it
                if role == "prefill" and hands_off(o, sampling[o.request_id]):
                    handed.append((o.request_id, o.token_ids[0]))
                else:
                    final[o.request_id] = o
            if pd and role == "prefill":
                producer_hand_off(world, engine.connector, [(i, arrivals[i].prompt, tok) for i, tok in handed])
            left = step < last or engine.has_unfinished() or bool(handed)
            if not world.all_reduce(torch.tensor([float(left)])).item():
                return final
        raise RuntimeError(f"run_rank: the schedule did not drain in {max_steps} steps; raise max_steps")
    finally:
        engine.close()


def _aborted(engine: LLMEngine, request_id) -> bool:
    """Whether ``engine`` holds ``request_id`` as stopped by an abort."""
    req = engine.scheduler.requests.get(request_id)
    return req is not None and req.status == "finished" and req.finish_reason == "abort"


def pd_role(world: Group, model, params: dict, cfg: Any, *, pcp_size: int, dcp_size: int = 1, block_size: int = 16,
            kv_connector=None, graph_mode: str = "NONE", graph_backend: str = "auto", capture_sizes=None,
            merge: str = ENGINE_MERGE, drafter=None, num_speculative_tokens: int = 0,
            **common) -> tuple[str, LLMEngine]:
    """This rank's P/D role and engine on a world of ``pcp_size + dcp_size`` ranks (every rank calls it):
    ``("prefill", producer engine)`` on world ranks ``0 .. P-1`` (PCP over them), ``("decode", consumer
    engine)`` on ``P ..`` (DCP, with the capture / merge options and ``drafter``; the producer keeps the
    target hidden rows a drafter that reads them needs, :func:`~cpattn.engine.pd_engine.producer_hidden`).
    ``kv_connector``: the connector both roles bind (None: :class:`~cpattn.engine.connector_pd.PDConnector`,
    blocks rank to rank over ``world``);
    ``common``: scheduler, num_blocks, poison, algorithms (as :class:`~cpattn.engine.llm.LLMEngine`; both roles).

    >>> import cpattn
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config.tiny()
    >>> roles = cpattn.simulate(3, lambda g: pd_role(g, "qwen3", qwen3.init_params(cfg), cfg, pcp_size=2,
    ...                                               block_size=4)[0])
    >>> roles
    ['prefill', 'prefill', 'decode']
    """
    if world.size != pcp_size + dcp_size:
        raise ValueError(f"pd=True: pcp_size={pcp_size} + dcp_size={dcp_size} ranks, but the world has {world.size}; "
                         "start pcp_size + dcp_size ranks")
    link = GroupLink(world, range(pcp_size), range(pcp_size, pcp_size + dcp_size))
    common.update(block_size=block_size, interleave_size=block_size,
                  kv_connector=hidden_carrier(kv_connector or PDConnector(), get_family(model), drafter).linked(link))
    producer = world.split(range(pcp_size))
    consumer = world.split(range(pcp_size, pcp_size + dcp_size))
    if producer is not None:
        return "prefill", _engine(model, params, cfg, producer, pcp_size=producer.size, kv_role="kv_producer",
                                  hidden_layers=producer_hidden(get_family(model), drafter), **common)
    return "decode", _engine(model, params, cfg, consumer, kv_role="kv_consumer", graph_mode=graph_mode,
                             graph_backend=graph_backend, capture_sizes=capture_sizes, merge=merge, drafter=drafter,
                             num_speculative_tokens=num_speculative_tokens, **common)


def _engine(model, params, cfg, group: Group, *, pcp_size: int = 1, dcp_size: int | None = None,
            **kwargs) -> LLMEngine:
    with warnings.catch_warnings():  # a P/D producer is the guide's PCP prefill engine (see pd_engine)
        if kwargs.get("kv_role") == "kv_producer":
            warnings.simplefilter("ignore", GuideCompatWarning)
        return LLMEngine(model, params, cfg, world=group, dcp_size=dcp_size or group.size, pcp_size=pcp_size,
                         **kwargs)

