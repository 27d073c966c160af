"""The P/D connector's hybrid payload: a request's prompt KV blocks plus its linear layers' states.

A hybrid model (Qwen3-Next, Qwen3.5: ``ModelFamily.cache == "hybrid"``) keeps two things per request
(:mod:`cpattn.engine.runner_hybrid`): the full-attention layers' KV in paged blocks, DCP-sharded, and one
state slot for the linear layers (per linear layer a conv state [K-1, C] and a recurrent state
[Hv, Dk, Dv]), replicated on every DCP rank. Whole blocks alone cannot hand a request over: the consumer
would have to start the linear layers from the state after the blocks, which the producer never had
(its chunks end where the budget cut them). So :class:`~cpattn.engine.connector_pd.PDConnector` bound to
a hybrid family becomes a :class:`HybridPDConnector` (``PDConnector()`` serves every kind):

- **stage**, on the producer: when its hybrid runner finishes a request's prompt, it hands the connector
  the request's states after the L prompt tokens and the first-token logits [V] (the same on every
  producer rank: PCP ends with the same states everywhere).
- **save**, on the producer: the request's every prompt block, ``ceil(L / block_size)`` of them, the
  last one partial (this rank's, as :class:`~cpattn.engine.connector_pd.PDConnector` stages whole blocks).
- **send / recv**: block j goes from producer rank ``j % P`` to consumer rank ``j % D`` (both sides keep
  global block j on rank ``j % size``, ``interleave_size = block_size``); the states and logits go from
  producer rank ``d % P`` to consumer rank d, whole (replicated). Over a
  :class:`~cpattn.engine.connector_pd.GroupLink`: the blocks as ``send_block_pairs`` sends them, then per
  consumer rank three messages (conv states, recurrent states, logits ``[n, V]``); their sizes follow
  from the config and the hand-off list, so no header goes.
- **take**, on the consumer: each prefill row of a handed request (the scheduler schedules the prompt as
  usual, chunked or whole) gets the entry; the runner writes the handed KV rows of the row's positions
  into the row's blocks, and at the row that ends the prompt it installs the states in the request's
  slot and samples the first token from the handed logits.

**The consumer computes no prompt token** (DeepSeek-V4's rule, :mod:`cpattn.engine.connector_v4`).
vLLM's consumer computes at least one token to have its logits; a hybrid consumer would then need the
state after L - 1 tokens, which is not part of the state after L. Instead the exact state after L goes
over with the logits of token L - 1; the consumer samples the first token from them with the request's
own parameters (so :func:`~cpattn.engine.pd_engine.check_first` still compares the roles) and decodes
from the producer's bits. A request the consumer preempts after its prompt is recomputed there; one
preempted while its prompt rows were still being placed places them again (the entry is kept until the
prompt is done).

**Hidden rows**, with a drafter that reads the target's hidden states (Qwen3-Next's MTP: both engines keep
its ``hidden_layers``): **save** stages the producer's rows of all L prompt positions (flattened ``{name:
[L, F]}``, :class:`~cpattn.engine.hidden_rows.HiddenRowsMixin`, as
:class:`~cpattn.engine.connector_pd.PDConnector` does), **send** sends them after the states (consumer rank d
from producer rank ``d % P``), and each consumer prompt row of the request hands back the rows of its
positions as the step's own (:func:`~cpattn.engine.hidden_rows.handed_hidden`; kept until the prompt is
placed), so the drafter's first proposal reads every prompt position.

Bytes per request (``stats.bytes_by_request``, summed over producer ranks): the ``ceil(L / B)`` blocks
``[B, F]`` once, and for each consumer rank the states (:meth:`HybridPDConnector.state_numel`) and V logits;
with a hidden-state drafter, ``D * L * sum(F_name) * itemsize`` of hidden rows more (``hidden_bytes_sent``).

Example
-------
>>> import cpattn
>>> from cpattn.engine.run_rank import Arrival, run_rank
>>> from cpattn.engine.sampling import SamplingParams
>>> from cpattn.models import qwen3_next as qn
>>> cfg = qn.Qwen3NextConfig.tiny()
>>> params = qn.init_params(cfg)
>>> out = cpattn.simulate(2, run_rank, "qwen3_next", params, cfg, [Arrival(list(range(1, 12)), SamplingParams(max_tokens=3))],
...                       pd=True, block_size=4)   # rank 0 prefills, rank 1 decodes from the handed blocks + states
>>> out[0], len(out[1][0].token_ids)
({}, 3)
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from cpattn.engine.connector import Handoff, Side
from cpattn.engine.connector_pd import MemoryLink, PDConnector, TransferStats, check_bind
from cpattn.engine.logits import acc_dtype
from cpattn.models.family import param_dtype


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding a ``num_tokens`` prompt's KV, the last one partial: what a hybrid hand-off moves.

    >>> prompt_blocks(8, 4), prompt_blocks(9, 4), prompt_blocks(1, 4)
    (2, 3, 1)
    """
    return -(-num_tokens // block_size)


@dataclass
class HybridEntry:
    """What a consumer holds of one handed request: ``num_tokens`` (L), ``blocks`` {global block j: [B, F]}
    (those of the consumer ranks this engine drives), per linear layer ``conv`` [K-1, C] and ``state``
    [Hv, Dk, Dv] (after the L prompt tokens), ``logits`` [V] (of prompt position L - 1)."""

    num_tokens: int
    blocks: dict
    conv: tuple
    state: tuple
    logits: torch.Tensor


class HybridPDConnector(PDConnector):
    """The P/D connector bound to a hybrid engine (module doc); build it as ``PDConnector()``."""

    def bind(self, side: Side) -> HybridPDConnector:
        from cpattn.engine.kv_rows import row_width

        check_bind(self.link, side)
        bound = copy.copy(self)
        bound.side = side
        bound.width = row_width(tuple(side.family.kv_layouts(side.cfg)))
        bound.dtype = param_dtype(side.params)
        bound.logits_dtype = acc_dtype(bound.dtype)
        bound.vocab = int(side.cfg.vocab_size)
        one = side.family.recurrent_cache(side.cfg, batch=1, dtype=bound.dtype)
        bound.conv_shapes = tuple(tuple(t.shape[1:]) for t in one.conv)
        bound.state_shapes = tuple(tuple(t.shape[1:]) for t in one.state)
        bound.conv_dtype = one.conv[0].dtype if one.conv else bound.dtype
        bound.state_dtype = one.state[0].dtype if one.state else bound.logits_dtype
        bound._outbox, bound._staged, bound._inbox, bound._waiting = {}, {}, {}, {}
        bound._stats = TransferStats()
        bound._bind_hidden(side)
        return bound

    def state_numel(self) -> tuple[int, int]:
        """(conv, recurrent) elements of one request's states, every linear layer."""
        conv = sum(int(torch.Size(s).numel()) for s in self.conv_shapes)
        return conv, sum(int(torch.Size(s).numel()) for s in self.state_shapes)

    def _range(self, h: Handoff) -> tuple[int, int]:
        return 0, prompt_blocks(len(h.tokens), self.side.block_size)

    # -- producer ---------------------------------------------------------------------------------
    def stage(self, request_id: Hashable, conv: Sequence[torch.Tensor], state: Sequence[torch.Tensor],
              first_logits: torch.Tensor, num_tokens: int, rank: int) -> None:
        """The producer runner of DCP rank ``rank``, after the row that ends a prompt of ``num_tokens``: the
        request's states after it (per linear layer conv [K-1, C], state [Hv, Dk, Dv]) and its logits [V].
        A consumer stages nothing (a recompute there)."""
        if self.side.role != "kv_producer" or (self.side.rank is None and rank != 0):
            return
        if first_logits.shape[-1] != self.vocab:
            raise ValueError(f"first-token logits of {first_logits.shape[-1]} entries, vocab_size {self.vocab}")
        self._staged[request_id] = (tuple(t.clone() for t in conv), tuple(t.clone() for t in state),
                                    first_logits.reshape(-1).to(self.logits_dtype).clone(), int(num_tokens))

    def save(self, out, requests) -> None:
        if self.side.role == "kv_consumer":
            self._admitted(out, requests)
            return
        s = self.side
        for b, rid in enumerate(out.req_ids):
            req = requests[rid]
            if req.status != "finished" or req.finish_reason == "abort":
                continue
            table, n = out.block_tables[b], s.dcp_size
            self._outbox[rid] = {j: s.read(j % n, table[j // n]) for j in range(prompt_blocks(req.num_prompt,
                                                                                               s.block_size))
                                 if s.rank is None or j % n == s.rank}
            self._stage_hidden(rid, req.num_prompt)  # a drafter's: the whole prompt's (the consumer computes none)

    def _mine(self, d: int) -> bool:
        """Whether this producer engine sends consumer rank d's states (producer rank ``d % P`` does)."""
        return self.side.rank is None or d % self.side.dcp_size == self.side.rank

    def send(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_producer":
            raise ValueError(f"PDConnector.send on a {self.side.role} engine; the producer sends")
        bad = [h.request_id for h in handed if self._staged.get(h.request_id, (0, 0, 0, -1))[3] != len(h.tokens)]
        if bad:
            raise RuntimeError(f"requests {bad!r}: handed off but their linear states after the whole prompt were "
                               "never staged; the producer must prefill them in this engine")
        sent = dict.fromkeys((h.request_id for h in handed), 0)
        if handed:
            nblocks = [self._range(h)[1] for h in handed]
            for h, nbytes in zip(handed, self.link.send(self, handed, nblocks, [0] * len(handed))):
                sent[h.request_id] += nbytes
            box = {}
            for d in range(self.link.consumer_size):
                if not self._mine(d):
                    continue
                states = [self._staged[h.request_id] for h in handed]
                for h, (conv, state, logits, _) in zip(handed, states):
                    sent[h.request_id] += sum(t.nbytes for t in (*conv, *state)) + logits.nbytes
                if isinstance(self.link, MemoryLink):
                    box[d] = states
                else:
                    world, dst = self.link.world, self.link.consumers[d]
                    world.send(_flat([t for c, _, _, _ in states for t in c], self.conv_dtype), dst)
                    world.send(_flat([t for _, s, _, _ in states for t in s], self.state_dtype), dst)
                    world.send(torch.stack([lg for _, _, lg, _ in states]), dst)
            if isinstance(self.link, MemoryLink):
                self.link._queue.append(box)
        st = self._stats
        for rid, nbytes in sent.items():
            st.bytes_by_request[rid] = st.bytes_by_request.get(rid, 0) + nbytes
            st.bytes_sent += nbytes
        st.blocks_sent += sum(len(self._outbox.get(h.request_id, {})) for h in handed)
        self._send_hidden(handed)  # after the blocks and states
        self._outbox.clear()  # staged requests not handed off (aborted, or done at the first token)
        self._staged.clear()

    # -- consumer ---------------------------------------------------------------------------------
    def recv(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_consumer":
            raise ValueError(f"PDConnector.recv on a {self.side.role} engine; the consumer receives")
        if not handed:
            return
        nblocks = [self._range(h)[1] for h in handed]
        got = self.link.recv(self, handed, nblocks, [0] * len(handed))
        if isinstance(self.link, MemoryLink):
            box = self.link.recv(self, handed, [], [])
        else:
            d, world = self.side.rank, self.link.world
            src = self.link.producers[d % len(self.link.producers)]
            nc, ns = self.state_numel()
            conv = world.recv((nc * len(handed),), self.conv_dtype, src)
            state = world.recv((ns * len(handed),), self.state_dtype, src)
            logits = world.recv((len(handed), self.vocab), self.logits_dtype, src)
            box = {d: [(_unflat(conv, b * nc, self.conv_shapes), _unflat(state, b * ns, self.state_shapes), logits[b],
                        len(h.tokens)) for b, h in enumerate(handed)]}
        mine = self._keep_mine(got, len(handed))
        for b, h in enumerate(handed):
            conv, state, logits, _ = next(iter(box.values()))[b]  # the same on every consumer rank
            for d in box:
                c, s, lg, _ = box[d][b]
                self._stats.bytes_received += sum(t.nbytes for t in (*c, *s)) + lg.nbytes
            self._inbox[h.request_id] = HybridEntry(len(h.tokens), mine[b], conv, state, logits)
            self._waiting[h.request_id] = h.request_id
        self._recv_hidden(handed)  # kept until the prompt is placed (_drop)

    def take(self, request_id: Hashable, context_len: int, query_len: int) -> HybridEntry | None:
        """The consumer runner: the entry of a request whose prefill row covers prompt positions
        ``context_len .. context_len + query_len - 1`` (None: nothing handed, or a recompute past the prompt)."""
        entry = self._inbox.get(request_id) if self.side.role == "kv_consumer" else None
        if entry is None or context_len + query_len > entry.num_tokens:
            return None
        return entry

    def fetch(self, tokens, start, stop):
        return []  # the blocks go to the runner with the states (take), not through the scheduler's spans

    def _admitted(self, out, requests) -> None:
        """Drop the entries of requests whose prompt is placed (or that finished while waiting)."""
        for rid in list(self._waiting):
            req = requests.get(rid)
            if req is not None and (req.status == "finished" or req.num_computed >= self._inbox[rid].num_tokens):
                if req.status != "finished":
                    self._stats.blocks_loaded += len(self._inbox[rid].blocks)
                self._drop(rid)

    def request_finished(self, request_id) -> None:
        self._outbox.pop(request_id, None)
        self._staged.pop(request_id, None)
        self._drop(request_id)

    def _drop(self, rid) -> None:
        if self._waiting.pop(rid, None) is not None:
            self._inbox.pop(rid, None)
            self._hidden_in.pop(rid, None)


def _flat(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)


def _unflat(flat: torch.Tensor, start: int, shapes) -> tuple[torch.Tensor, ...]:
    out, at = [], start
    for s in shapes:
        n = int(torch.Size(s).numel())
        out.append(flat[at:at + n].view(s))
        at += n
    return tuple(out)
