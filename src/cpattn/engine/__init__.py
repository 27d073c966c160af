"""The engine: prefill -> hand-off -> decode, as stages over explicit state, composed by one driver.

Layers below it: ops -> layout / comm -> pcp / dcp / dsa -> graphs -> models
(pure forward functions per family). Stages, each usable alone:

- **prefill** (:mod:`cpattn.engine.prefill`): prompts over a group of ranks
  -- one device, PCP (ring / all-gather), DSA-CP for DSA models -- with an
  optional cached prefix (:class:`~cpattn.engine.prefill_steps.Prefix`, the
  hook a KV pool uses). Out: first-token logits, this rank's KV rows.
- **hand-off** (:mod:`cpattn.engine.handoff`): KV rows to their DCP owners
  on the same ranks (one all-to-all, or all-gather and keep), whole blocks
  to separate decode ranks (P/D, point to point), whole blocks to and from a
  KV pool.
- **decode** (:mod:`cpattn.engine.decode`): dense (one rank) or DCP; plain or
  speculative with any drafter; eager or through a
  :class:`~cpattn.graphs.DecodeRunner` (FULL_DECODE_ONLY).
  :mod:`cpattn.engine.decode_stage` builds the cache, the runner and the run
  as a decode engine config asks.

The step loop (:class:`~cpattn.engine.llm.LLMEngine`): requests arrive, each step a scheduler
(:mod:`cpattn.engine.scheduler`, :mod:`cpattn.engine.blocks`) picks decode tokens and prefill chunks
under a token budget and a runner (:mod:`cpattn.engine.runner`) executes them; prefix caching, the KV
pool as its second tier, preemption by recompute, speculative decoding, PCP chunks (docs/engine.md).
:class:`~cpattn.engine.pd_engine.PDEngine` serves P/D in the step loop: a PCP prefill engine and a DCP
decode engine, the KV pool between them.

The driver (:mod:`cpattn.engine.driver`) takes a prefill and a decode
:class:`~cpattn.config.EngineConfig`, checks them once before any rank
starts (the guide's rules, then :mod:`cpattn.engine.checks`), and returns a
:class:`~cpattn.engine.result.Generation`. One vocabulary throughout
(:mod:`cpattn.engine.batch`): ``query_lens`` (new tokens), ``context_lens``
(already cached), ``seq_lens`` (both).

Protocols
---------
**Model family** (:mod:`cpattn.models.family`): a family is one file in
:mod:`cpattn.models` ending with ``FAMILY = ModelFamily(name, config_class,
attention, forward, init_params, kv_layouts, capturable)``; its forward
calls an attention *step* -- ``step(layer, q, k, v, scale)`` (GQA, MLA) or
``step.dsa(layer, q, kv, q_index, w_index, k_index, topk, scale)`` (DSA) --
and the engine supplies the step of each layout. Add the ``model_type`` to
``FAMILY_MODULES`` and the engine runs it:

>>> import torch
>>> from cpattn.models.family import KVLayout, ModelFamily
>>> from cpattn.engine.reference import reference_generate
>>> def forward(params, cfg, tokens, attn, *, logits_index=None):
...     x = params["emb"][tokens]                                   # [T, 8]
...     q = k = v = x.view(-1, 1, 8)                                # one head
...     h = x + attn(0, q, k, v, 8 ** -0.5).view(-1, 8)
...     h = h if logits_index is None else h[logits_index]
...     return h @ params["emb"].T                                  # [T, V]
>>> class Cfg:
...     num_attention_heads, num_hidden_layers, vocab_size = 1, 1, 16
>>> toy = ModelFamily("toy", Cfg, "gqa", forward, lambda cfg, **kw: {}, lambda cfg: (KVLayout(1, 8, 8),))
>>> params = {"emb": torch.randn(16, 8, generator=torch.Generator().manual_seed(0))}
>>> reference_generate(toy, params, Cfg(), [[1, 2, 3]], 3).tokens.shape
torch.Size([1, 3])

**Drafter** (:mod:`cpattn.engine.drafters`): a picklable description
declaring its ``method`` (the ``speculative_method`` the guide's PCP rules
check), its ``settings`` (draft sampling / attention, verification
schedule: routed into the engine's ``SpeculativeConfig``) and
``hidden_layers`` (None, or the target hidden states it reads), with
``start(num_requests, max_len, *, graph=None) -> state``. The state's
``propose(histories, k, requests, hidden=None) -> [A, k]`` drafts k tokens
per request from the token histories and, for drafters that read them,
the target's hidden states of the rows computed since the last call (a
:class:`~cpattn.engine.drafters.TargetHidden`: the prompt after prefill,
the 1 + k verified rows after a step, the leading ``1 + accepted`` final);
``rollback(requests, keep_lens)`` drops what it holds past the tokens the
target accepted. Registered by name in
:data:`~cpattn.drafters.registry.DRAFTERS` (n-gram, draft model, and the
guide's MTP, Eagle3 and DSpark from :mod:`cpattn.drafters`):

>>> from cpattn.drafters.registry import DRAFTERS
>>> state = DRAFTERS["ngram"]().start(num_requests=1, max_len=16)
>>> state.propose([[4, 5, 6, 4]], 2, [0]).tolist()
[[5, 6]]
>>> state.rollback([0], [4])
>>> DRAFTERS["eagle3"].method, DRAFTERS["mtp"].hidden_layers
('eagle3', ())

**KV pool**: whole KV blocks (``[block_size, F]`` rows of
:mod:`cpattn.engine.kv_rows`) keyed by a chained prefix hash of the
blocks' tokens, so a block written under one layout is found under any
other. ``lookup(keys) -> int`` (leading keys present), ``load(keys) ->
[payload]``, ``store(keys, payloads)``; a request then prefills only past
its cached prefix. A minimal in-memory pool:

>>> class DictPool:
...     def __init__(self): self.blocks = {}
...     def lookup(self, keys): return next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys))
...     def load(self, keys): return [self.blocks[k] for k in keys]
...     def store(self, keys, payloads): self.blocks.update(zip(keys, payloads))
>>> pool = DictPool(); pool.store(["a", "b"], [torch.zeros(4, 6)] * 2)
>>> pool.lookup(["a", "b", "c"]), len(pool.load(["a"]))
(2, 1)
"""

import cpattn.engine.backend  # noqa: F401 - registers the cache backends with cpattn.models.family
from cpattn.engine.batch import Prompts
from cpattn.engine.driver import engine_configs, generate, generate_on_rank
from cpattn.engine.llm import EngineStats, LLMEngine, RequestOutput, SamplingParams
from cpattn.engine.options import Algorithms
from cpattn.engine.outputs import RequestOutputKind
from cpattn.engine.pd_engine import PDEngine, PDStats
from cpattn.engine.reference import reference_generate
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.engine.result import Generation, RunFacts
from cpattn.models.family import KVLayout, ModelFamily, get_family

__all__ = ["Prompts", "Algorithms", "KVLayout", "ModelFamily", "get_family", "engine_configs", "generate",
           "generate_on_rank", "reference_generate", "Generation", "RunFacts", "LLMEngine", "SamplingParams",
           "RequestOutput", "RequestOutputKind", "EngineStats", "PDEngine", "PDStats", "Arrival",
           "run_rank"]
