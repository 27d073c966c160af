"""The guide's speculative methods as drafters: MTP, Eagle3 and DSpark (one module each).

Every drafter here reads the target's hidden states (``hidden_layers``),
keeps its own small KV cache (:mod:`cpattn.drafters.cache`), drafts greedily
and is a pure function of (its weights, the target hidden states, the
tokens, its cache); the engine runs it replicated on every rank with
logical PCP size 1 (:mod:`cpattn.engine.drafters` has the protocol):

- :mod:`~cpattn.drafters.mtp` -- DeepSeek's multi-token-prediction module
  (DeepSeek-V3 / V3.2 / GLM-5 targets), straight from a DeepSeek-V3-format checkpoint;
- :mod:`~cpattn.drafters.qwen3_next_mtp` -- Qwen3-Next's MTP module (``mtp.*``: hybrid
  Qwen3-Next / Qwen3.5 targets), one gated-attention layer over the target's hidden state;
- :mod:`~cpattn.drafters.eagle3` -- EAGLE-3: low/mid/high target layers fused
  by an fc layer, one decoder layer, a reduced draft vocabulary (``d2t``);
- :mod:`~cpattn.drafters.dspark` -- DSpark: a parallel draft block over the
  target's fused hidden states, a Markov head inside the block, a
  confidence head estimating each draft's survival.

Training them (``cpattn train-draft``: self-distillation on a target's own
greedy continuations) is the lab's, :mod:`cpattn.lab`, which nothing here imports.

Beside them the two drafters that read tokens only: :mod:`~cpattn.drafters.ngram`
(prompt lookup, no weights) and :mod:`~cpattn.drafters.draft_model` (a small
model of the target's family, its own dense cache).

All are reachable by name from :data:`cpattn.drafters.registry.DRAFTERS`
(:mod:`cpattn.engine.drafters` holds the protocol they follow).
"""
