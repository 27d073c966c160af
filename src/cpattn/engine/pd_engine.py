"""P/D in the step loop: a prefill engine and a decode engine joined by a KV connector (a pool by default).

The guide's disaggregated layout serves a request in two roles. The **producer**
is an :class:`~cpattn.engine.llm.LLMEngine` of ``pcp_size`` ranks (one engine,
``pcp_size = dcp_size``, so its prompt chunks run PCP). It runs the request
with ``max_tokens = 1``. Its prompt spans become computed, and after each step
every producer rank stores the pool blocks it owns. The **consumer** is an
``LLMEngine`` of ``dcp_size`` ranks (captured decode if asked). It takes the
request when the producer finishes. At admission its second tier fetches the
prompt's whole blocks from the pool, so it computes only the tail (at least one
token, vLLM's rule, so that it has logits) and then decodes.

Each step of :class:`PDEngine` is one producer step followed by one consumer
step. On the simulated mesh the two run one after the other. In a deployment
they run on their own devices at the same time. The connector carries whole
pool blocks, whose keys chain the token hash and the weights' identity.
Blocks are keyed per ``block_size`` tokens, not per rank, so a producer of P
ranks and a consumer of D ranks share them whatever P and D are. Both sides
need ``interleave_size = block_size``, which is the pool tier's rule.

With ``kv_connector=PDConnector()`` (:mod:`cpattn.engine.connector_pd`) no pool sits between
them: when the producer finishes a request, its whole blocks go straight to the consumer (in
memory here, rank to rank in :func:`~cpattn.engine.run_rank.run_rank`).
``PoolConnector(pool, store=False) + PDConnector()`` sends only the blocks the pool does not hold.
DeepSeek-V4 has no per-token blocks: its default connector is ``PDConnector()``, which hands each
request's whole V4 state and first-token logits over (:mod:`cpattn.engine.connector_v4`); no pool.
A hybrid model (Qwen3-Next) too: ``PDConnector()`` hands over every prompt block, the linear layers'
states after the prompt and the first-token logits (:mod:`cpattn.engine.connector_hybrid`); no pool,
no prefix caching, and the consumer computes no prompt token.

The first token comes from the producer, which gives the TTFT. The consumer
samples it again from its recomputed tail, using the same per-request seed,
and the engine checks that the two agree. A mismatch is a ``RuntimeError``
that names the request, never a silent swap.

Example
-------
>>> from cpattn.config import GuideCompatWarning, SchedulerConfig
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> pd = PDEngine("qwen3", qwen3.init_params(cfg), cfg, pcp_size=2, dcp_size=2, block_size=4,
...               scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
>>> out = pd.generate([list(range(1, 20)), [5, 6, 7]], SamplingParams(max_tokens=3))
>>> [len(o.token_ids) for o in out], pd.stats.decode.pool_hit_tokens   # 16 of the first prompt's 19 came over
([3, 3], 16)
>>> pd.close()
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from cpattn.config import GuideCompatWarning, SchedulerConfig
from cpattn.engine.connector import Handoff, PoolConnector
from cpattn.engine.connector_pd import MemoryLink, PDConnector, moves_blocks
from cpattn.engine.llm import EngineStats, LLMEngine, RequestOutput, SamplingParams, drain
from cpattn.engine.outputs import RequestOutputKind
from cpattn.engine.pooling import open_for_run, release
from cpattn.models.family import get_family
from cpattn.dcp.layer_merges import ENGINE_MERGE


@dataclass(frozen=True)
class PDStats:
    """The two roles' counters (:class:`~cpattn.engine.llm.EngineStats`); ``handed_off``: requests passed
    from the producer to the consumer."""

    prefill: EngineStats
    decode: EngineStats
    handed_off: int


def memory_pool(model, cfg, params: dict, block_size: int):
    """An in-process KV pool (a dict store) under this model's identity: P/D's connector on the simulated
    mesh when none is given (threads share it; processes need a store they all open, LMDB or Mooncake)."""
    from cpattn.engine.pooling import pool_identity
    from cpattn.pool import DictStore, KVPool

    return KVPool(DictStore(), pool_identity(get_family(model), cfg, params, block_size, label="pd"))


def hands_off(o: RequestOutput, params: SamplingParams) -> bool:
    """Whether a request the producer finished (its first token out) goes on to the consumer: not when
    aborted, when ``max_tokens`` is 1, or when the first token is a stop token."""
    return o.finish_reason != "abort" and params.max_tokens > 1 and o.token_ids[-1] not in params.stop_token_ids


def check_first(o: RequestOutput, first: dict) -> None:
    """The consumer's first token of a handed-off request must be the producer's (``first`` pops it)."""
    want = first.get(o.request_id)
    if o.token_ids and want is not None:
        if o.token_ids[0] != want:
            raise RuntimeError(f"request {o.request_id!r}: the decode role sampled first token {o.token_ids[0]}, "
                               f"the prefill role {want}; the roles diverged")
        del first[o.request_id]


def pd_params(prompt_token_ids: Sequence[int], params: SamplingParams | None, max_model_len: int,
              rng: random.Random) -> SamplingParams:
    """A P/D request's whole-request params, checked: the prompt + ``max_tokens - 1`` fit ``max_model_len``
    (else ValueError), and a request without a seed gets one drawn from ``rng``, so both roles sample the
    first token alike (the same draw on every rank that shares ``rng``'s seed).

    >>> p = pd_params([1, 2, 3], SamplingParams(max_tokens=2, seed=None), 8, random.Random(0))
    >>> p.max_tokens, p.seed is not None
    (2, True)
    >>> pd_params([1, 2, 3], SamplingParams(max_tokens=7), 8, random.Random(0))
    Traceback (most recent call last):
    ...
    ValueError: request needs 3 prompt + 7 max_tokens - 1 tokens; max_model_len is 8: shorten it or raise max_model_len
    """
    p = params or SamplingParams()
    if p.output_kind is not RequestOutputKind.CUMULATIVE:
        raise ValueError(f"PDEngine: SamplingParams.output_kind={p.output_kind.name}: P/D returns CUMULATIVE "
                         "outputs only (LLMEngine takes DELTA and FINAL_ONLY)")
    if len(prompt_token_ids) + p.max_tokens - 1 > max_model_len:
        raise ValueError(f"request needs {len(prompt_token_ids)} prompt + {p.max_tokens} max_tokens - 1 "
                         f"tokens; max_model_len is {max_model_len}: shorten it or raise max_model_len")
    if getattr(p, "seed", 0) is None:  # one seed for both roles, so the first token is sampled alike
        p = dataclasses.replace(p, seed=rng.randrange(2**63))
    return p


def producer_hidden(family, drafter) -> tuple | None:
    """The ``hidden_layers`` a P/D producer keeps for the consumer's ``drafter``: the drafter's when it reads
    the target's hidden states (every family's P/D connector hands the rows over), else None.

    >>> from cpattn.drafters.ngram import NgramDrafter
    >>> producer_hidden(get_family("qwen3"), NgramDrafter()) is None
    True
    >>> producer_hidden(get_family("deepseek_v4"), type("Head", (), {"hidden_layers": (0, 1)})())
    (0, 1)
    """
    return getattr(drafter, "hidden_layers", None)


def hidden_carrier(connector, family, drafter):
    """``connector``, or ``connector + PDConnector()`` when the consumer's ``drafter`` reads the target's hidden
    states and ``connector`` holds no :class:`~cpattn.engine.connector_pd.PDConnector`: a pool holds blocks only,
    and the P/D connector carries the prompt's hidden rows (it sends no block the pool holds)."""
    if producer_hidden(family, drafter) is None or moves_blocks(connector):
        return connector
    return connector + PDConnector()


class PDEngine:
    """Prefill on ``pcp_size`` ranks, decode on ``dcp_size`` ranks, the KV through a pool (module doc).

    Arguments
    ---------
    model, params, cfg: a family (or its name), its weights, its config.
    pcp_size: the producer's ranks (its chunks run PCP over them). dcp_size: the consumer's ranks (its
        KV cache sharded over them).
    block_size: both sides' KV block (and interleave) size.
    scheduler: both roles' :class:`~cpattn.config.SchedulerConfig`; prefix caching stays on (the pool
        is its second tier), except for DeepSeek-V4 and hybrid models (off; None: their defaults).
    kv_pool: the connector: a :class:`~cpattn.engine.pooling.PoolSpec` (LMDB, Mooncake) or an open pool;
        None: an in-process dict pool. kv_connector: instead, a
        :class:`~cpattn.engine.connector.KVConnector` (``PDConnector()``: blocks handed over directly).
    graph_mode / graph_backend / capture_sizes: the consumer's decode capture (the producer runs eagerly,
        as a step with a prefill chunk does). seed: draws the seed of each request that brings none,
        given to both roles so their first tokens agree. num_blocks / poison / merge / algorithms: as
        :class:`~cpattn.engine.llm.LLMEngine`, per role.
    return_logits / return_prompt_logits: as :class:`~cpattn.engine.llm.LLMEngine` (opt-in): the consumer's
        logits of every output token, the producer's prompt logits (on the consumer's outputs once handed off).
    drafter / num_speculative_tokens: speculative decoding on the consumer (the producer samples one token
        and needs none): any drafter. One that reads the target's hidden states (MTP, Eagle3, DSpark) gets
        the producer's hidden rows of the prompt positions the consumer does not compute, sent with the
        blocks (:mod:`cpattn.engine.connector_pd`; DeepSeek-V4 and hybrid models: the whole prompt's, with
        the state, :mod:`cpattn.engine.connector_v4`, :mod:`cpattn.engine.connector_hybrid`), so it drafts as
        in one engine that ran the prompt.
    """

    def __init__(self, model, params: dict, cfg: Any, *, pcp_size: int = 1, dcp_size: int = 1, block_size: int = 16,
                 scheduler: SchedulerConfig | None = None, kv_pool=None, graph_mode: str = "NONE",
                 graph_backend: str = "auto", capture_sizes=None, num_blocks: int | None = None,
                 poison: bool = False, merge: str = ENGINE_MERGE, seed: int = 0, kv_connector=None,
                 return_logits: bool = False, return_prompt_logits: bool = False, drafter=None,
                 num_speculative_tokens: int = 0, algorithms=None) -> None:
        family = get_family(model)
        v4 = family.backend.name == "v4"  # no per-token blocks: its whole state goes over (connector_v4)
        hybrid = family.cache == "hybrid"  # blocks + linear states, which no pool holds (connector_hybrid)
        if v4 and kv_pool is not None:
            raise ValueError(f"kv_pool: {family.name} keeps its own cache (window rings + compressed entries), not "
                             "per-token KV blocks a pool could hold; pass kv_pool=None (the P/D connector hands over "
                             "its whole state)")
        if hybrid and kv_pool is not None:
            raise ValueError(f"kv_pool: {family.name} is a hybrid model, whose linear layers' states a pool of KV "
                             "blocks does not hold; pass kv_pool=None (the P/D connector hands over the prompt's "
                             "blocks and the states)")
        if (v4 or hybrid) and kv_connector is None:
            kv_connector = PDConnector()
        sched = scheduler or (None if v4 or hybrid else SchedulerConfig())  # None: the family's own defaults
        if not (v4 or hybrid) and not sched.enable_prefix_caching:
            raise ValueError("scheduler.enable_prefix_caching=False: P/D hands the KV over through the prefix "
                             "cache's second tier; leave prefix caching on")
        self.pool, self._opened = None, False
        if kv_connector is None:
            if kv_pool is None:
                self.pool = memory_pool(family, cfg, params, block_size)
            else:
                self.pool, self._opened = open_for_run(kv_pool, family, cfg, params, block_size)
            kv_connector = PoolConnector(self.pool)
        elif kv_pool is not None:
            raise ValueError("pass kv_pool= or kv_connector=, not both (compose them: PoolConnector(pool) + PDConnector())")
        kv_connector = hidden_carrier(kv_connector, family, drafter)
        connector = kv_connector.linked(MemoryLink(dcp_size))
        common = dict(block_size=block_size, interleave_size=block_size, scheduler=sched, kv_connector=connector,
                      num_blocks=num_blocks, poison=poison, merge=merge, algorithms=algorithms)
        with warnings.catch_warnings():  # the one-engine PCP + DCP warning's own fix is this P/D pair
            warnings.simplefilter("ignore", GuideCompatWarning)
            self.prefill = LLMEngine(family, params, cfg, dcp_size=pcp_size, pcp_size=pcp_size, kv_role="kv_producer",
                                     return_logits=return_logits, return_prompt_logits=return_prompt_logits,
                                     hidden_layers=producer_hidden(family, drafter), **common)
        self.decode = LLMEngine(family, params, cfg, dcp_size=dcp_size, graph_mode=graph_mode, kv_role="kv_consumer",
                                graph_backend=graph_backend, capture_sizes=capture_sizes, return_logits=return_logits,
                                drafter=drafter, num_speculative_tokens=num_speculative_tokens, **common)
        self._prompt_logits: dict[Hashable, Any] = {}  # the producer's, for the consumer's outputs
        self.pool = self.pool or self.prefill.pool  # the pool a given connector holds, if any
        self.max_model_len = min(self.prefill.max_model_len, self.decode.max_model_len)
        self._rng = random.Random(seed)
        self._params: dict[Hashable, SamplingParams] = {}
        self._first: dict[Hashable, int] = {}  # the producer's first token of each handed-off request
        self._handed_off = 0

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request on the producer (checked now); returns its id."""
        p = pd_params(prompt_token_ids, params, self.max_model_len, self._rng)
        first = dataclasses.replace(p, max_tokens=1)
        rid = self.prefill.add_request(prompt_token_ids, first, request_id=request_id)
        self._params[rid] = p
        return rid

    def abort_request(self, request_id: Hashable) -> bool:
        """Stop a request in whichever role holds it; False if it had already finished."""
        self._params.pop(request_id, None)
        if request_id not in self.decode.scheduler.requests:  # not handed off: the producer holds it (or finished it)
            return self.prefill.abort_request(request_id)
        if self.decode.connector is not None:
            self.decode.connector.request_finished(request_id)  # blocks received for it, if it never ran
        return self.decode.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One producer step, then one consumer step: the :class:`RequestOutput` of every row either ran
        (a handed-off request shows its first token, unfinished, until the consumer carries on)."""
        outputs, handed = [], []
        for o in self.prefill.step() if self.prefill.has_unfinished() else []:
            p = self._params.get(o.request_id)
            if not o.finished or p is None:  # a chunk in progress, or aborted meanwhile
                outputs.append(o)
            elif not hands_off(o, p):
                del self._params[o.request_id]
                outputs.append(o)
            else:
                handed.append(Handoff(o.request_id, tuple(o.prompt_token_ids), o.token_ids[0]))
                if o.prompt_logits is not None:
                    self._prompt_logits[o.request_id] = o.prompt_logits
                outputs.append(dataclasses.replace(o, finished=False, finish_reason=None))
        if self.prefill.connector is not None:
            ask = moves_blocks(self.prefill.connector)
            handed = [dataclasses.replace(h, found=self.prefill.connector.found(h.tokens)) if ask else h for h in handed]
            self.prefill.connector.send(handed)
            self.decode.connector.recv(handed)
        for h in handed:
            self.decode.add_request(list(h.tokens), self._params[h.request_id], request_id=h.request_id)
            self._first[h.request_id] = h.first_token
            self._handed_off += 1
        for o in self.decode.step() if self.decode.has_unfinished() else []:
            check_first(o, self._first)
            if o.finished:
                self._params.pop(o.request_id, None)
            if self._prompt_logits:
                kept = self._prompt_logits.pop if o.finished else self._prompt_logits.get
                o = dataclasses.replace(o, prompt_logits=kept(o.request_id, None))
            outputs.append(o)
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Submit every prompt now and step until all finish; the final output of each, in prompt order."""
        return drain(self, prompts, params)

    @property
    def stats(self) -> PDStats:
        return PDStats(self.prefill.stats, self.decode.stats, self._handed_off)

    def close(self) -> None:
        """Release both roles and the pool if this engine opened it (idempotent)."""
        self.prefill.close()
        self.decode.close()
        if self._opened:
            release(self.pool)
            self._opened = False
