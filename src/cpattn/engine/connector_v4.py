"""The P/D connector's DeepSeek-V4 payload: a request's whole V4 decode state, producer to consumer slot.

V4's cache is not per-token KV blocks (rings plus compressed entries,
:mod:`cpattn.v4.cache`), so :class:`~cpattn.engine.connector_pd.PDConnector`
bound to a family of ``cache="v4"`` becomes a :class:`V4PDConnector`
(``PDConnector()`` works for both kinds; the paged path is unchanged):

- **stage**, on the producer: when its V4 runner prefills a request, it hands
  the connector the collected prefill state (:class:`~cpattn.v4.handoff.V4Handoff`,
  the same on every producer rank) and the first-token logits.
- **send / recv** (the same :class:`~cpattn.engine.connector.Handoff` list on
  both roles): consumer rank d gets, from producer rank ``d % P``, each handed
  request's *share* for d (:mod:`cpattn.v4.share`: ring rows at positions
  ``[L - back, L)``, the entries and indexer keys d owns) and the first-token
  logits [V]. Over a :class:`~cpattn.engine.connector_pd.GroupLink`: two
  messages per consumer rank (the shares back to back, the logits ``[n, V]``);
  their sizes follow from the layout and the prompt lengths, so no header goes.
- **take**, on the consumer: at admission its V4 runner places the share in the
  request's slot and samples the first token from the handed logits.

**The consumer computes no prompt token.** vLLM's rule (the consumer computes
at least one token, to have logits) does not fit V4: the state after L - 1
tokens is not a part of the state after L (the rings shift, an entry may close
at token L), so the producer would have to export a second state. Instead the
full state of the L prompt tokens goes over with the logits of the last one;
the consumer samples the first token from them with the request's own sampling
parameters (so a seeded request draws what the producer drew, and
:func:`~cpattn.engine.pd_engine.check_first` still compares the two roles) and
decodes from there. A request the consumer preempts is recomputed there, whole.

**Hidden rows**, with a drafter that reads the target's hidden states (DSpark:
both engines keep its ``hidden_layers``): the producer engine keeps each
request's rows of every prompt position; **save** stages all L of them
(flattened ``{name: [L, F]}``, :class:`~cpattn.engine.hidden_rows.HiddenRowsMixin`,
as :class:`~cpattn.engine.connector_pd.PDConnector` does), **send** sends them
after the shares (consumer rank d from producer rank ``d % P``: an int64
header, then ``[sum L, sum F]``), and the consumer's runner hands them back as
the placed row's own (:func:`~cpattn.engine.hidden_rows.handed_hidden`), so
the drafter's first proposal reads every prompt position.

Bytes per request (``stats.bytes_by_request``, summed over producer ranks):
for each consumer rank, its share (:func:`~cpattn.v4.share.share_numel`) and V
logits, in the model's and the logits' dtypes; with a hidden-state drafter,
``D * L * sum(F_name) * itemsize`` of hidden rows more (``hidden_bytes_sent``).

Example
-------
>>> import cpattn
>>> from cpattn.engine.run_rank import Arrival, run_rank
>>> from cpattn.engine.sampling import SamplingParams
>>> from cpattn.models import deepseek_v4 as v4
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> out = cpattn.simulate(2, run_rank, "deepseek_v4", params, cfg, [Arrival(list(range(1, 20)), SamplingParams(max_tokens=3))],
...                       pd=True, block_size=4)   # rank 0 prefills, rank 1 decodes from the handed state
>>> out[0], len(out[1][0].token_ids)
({}, 3)
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from cpattn.engine.connector import Handoff, KVConnector, Side
from cpattn.engine.connector_pd import MemoryLink, PDConnector, TransferStats, check_bind
from cpattn.engine.logits import acc_dtype
from cpattn.models.family import param_dtype
from cpattn.v4.handoff import V4Handoff
from cpattn.v4.share import export_share, share_numel


class V4PDConnector(PDConnector):
    """The P/D connector bound to a V4 engine (module doc); build it as ``PDConnector()``."""

    def bind(self, side: Side) -> V4PDConnector:
        check_bind(self.link, side, whole_blocks=False)  # a whole request state goes over, not blocks
        bound = copy.copy(self)
        bound.side = side
        bound.layout = side.cfg.layout(block_size=side.block_size)
        bound.dtype = param_dtype(side.params)
        bound.logits_dtype = acc_dtype(bound.dtype)
        bound.vocab = int(side.cfg.vocab_size)
        bound._outbox, bound._inbox, bound._waiting = {}, {}, {}
        bound._stats = TransferStats()
        bound._bind_hidden(side)
        return bound

    # -- producer ---------------------------------------------------------------------------------
    def stage(self, request_id: Hashable, handoff: V4Handoff, j: int, first_logits: torch.Tensor, rank: int) -> None:
        """The producer runner of DCP rank ``rank``, after a prefill: request ``j`` of ``handoff`` is
        ``request_id``, its first-token logits [V]. A consumer (a recompute there) stages nothing."""
        if self.side.role != "kv_producer" or (self.side.rank is None and rank != 0):
            return
        if first_logits.shape[-1] != self.vocab:
            raise ValueError(f"first-token logits of {first_logits.shape[-1]} entries, vocab_size {self.vocab}")
        self._outbox[request_id] = (handoff, j, first_logits.to(self.logits_dtype))

    def save(self, out, requests) -> None:
        if self.side.role == "kv_consumer":
            self._admitted(out, requests)
            return
        for rid in out.req_ids:  # a drafter's hidden rows: the whole prompt's (the consumer computes none of it)
            req = requests[rid]
            if req.status == "finished" and req.finish_reason != "abort":
                self._stage_hidden(rid, req.num_prompt)

    def _mine(self, d: int, num_producers: int) -> bool:
        """Whether this producer engine sends consumer rank d's shares (producer rank ``d % P`` does)."""
        return self.side.rank is None or d % num_producers == self.side.rank

    def _share(self, rid, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, j, logits = self._outbox[rid]
        flat = export_share(h, j, self.layout, rank=d, size=self.link.consumer_size,
                            interleave=self.side.interleave_size)
        return flat.to(self.dtype), logits

    def send(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_producer":
            raise ValueError(f"PDConnector.send on a {self.side.role} engine; the producer sends")
        missing = [h.request_id for h in handed if h.request_id not in self._outbox]
        if missing:
            raise RuntimeError(f"requests {missing!r}: handed off but their V4 state was never staged; the producer "
                               "must prefill them in this engine")
        p = self.side.dcp_size
        sent = dict.fromkeys((h.request_id for h in handed), 0)
        if handed:
            box = {}
            for d in range(self.link.consumer_size):
                if not self._mine(d, p):
                    continue
                shares = [self._share(h.request_id, d) for h in handed]
                for h, (flat, logits) in zip(handed, shares):
                    sent[h.request_id] += flat.nbytes + logits.nbytes
                if isinstance(self.link, MemoryLink):
                    box[d] = shares
                else:
                    world, dst = self.link.world, self.link.consumers[d]
                    world.send(torch.cat([f for f, _ in shares]), dst)
                    world.send(torch.stack([lg for _, lg in shares]), dst)
            if isinstance(self.link, MemoryLink):
                self.link._queue.append(box)
        st = self._stats
        for rid, nbytes in sent.items():
            st.bytes_by_request[rid] = st.bytes_by_request.get(rid, 0) + nbytes
            st.bytes_sent += nbytes
            st.blocks_sent += bool(nbytes)  # one V4 state (not blocks) per request sent
        self._send_hidden(handed)  # after the states
        self._outbox.clear()  # staged requests not handed off (aborted, or done at the first token)

    # -- consumer ---------------------------------------------------------------------------------
    def recv(self, handed: Sequence[Handoff]) -> None:
        if self.side.role != "kv_consumer":
            raise ValueError(f"PDConnector.recv on a {self.side.role} engine; the consumer receives")
        if not handed:
            return
        n, lay, inter = self.link.consumer_size, self.layout, self.side.interleave_size
        if isinstance(self.link, MemoryLink):
            box = self.link.recv(self, handed, [], [])
        else:
            d = self.side.rank
            src = self.link.producers[d % len(self.link.producers)]
            sizes = [share_numel(lay, len(h.tokens), rank=d, size=n, interleave=inter) for h in handed]
            world = self.link.world
            flats = world.recv((sum(sizes),), self.dtype, src).split(sizes)
            logits = world.recv((len(handed), self.vocab), self.logits_dtype, src)
            box = {d: list(zip(flats, logits))}
        for b, h in enumerate(handed):
            shares = {d: box[d][b] for d in box if self.side.rank is None or d == self.side.rank}
            for flat, lg in shares.values():
                self._stats.blocks_received += 1
                self._stats.bytes_received += flat.nbytes + lg.nbytes
            self._inbox[h.request_id] = (len(h.tokens), shares)
            self._waiting[h.request_id] = h.request_id
        self._recv_hidden(handed)

    def take(self, request_id: Hashable, rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The consumer runner of DCP rank ``rank``: (share, first-token logits [V]) of a request whose
        ``num_tokens``-token prefill row it is about to run, or None (nothing handed, or a recompute)."""
        entry = self._inbox.get(request_id) if self.side.role == "kv_consumer" else None
        if entry is None or entry[0] != num_tokens:
            return None
        self._stats.blocks_loaded += 1
        return entry[1][rank]

    def fetch(self, tokens, start, stop):
        return []  # V4's state goes to the runner (take), not into the scheduler's blocks

    def request_finished(self, request_id) -> None:
        self._outbox.pop(request_id, None)
        self._hidden_in.pop(request_id, None)
        self._drop(request_id)

    def _drop(self, rid) -> None:
        if self._waiting.pop(rid, None) is not None:
            self._inbox.pop(rid, None)


def is_v4_direct(connector: KVConnector | None) -> bool:
    """Whether ``connector`` is the bare P/D connector (the one a V4 engine takes), unbound or bound."""
    return isinstance(connector, PDConnector)
