"""The training lab: how the shipped draft heads and tiny targets were made. The runtime never imports it.

The drafters themselves (:mod:`cpattn.drafters`) and the engine run without
anything here; this package trains and measures them:

- :mod:`~cpattn.lab.corpus` -- a synthetic corpus with structure (walks over phrases);
- :mod:`~cpattn.lab.target` -- tiny Qwen3 / DeepSeek-V3 targets trained on it, saved as
  checkpoints (config.json from each config's ``to_hf()``), and the self-distillation data
  (:func:`~cpattn.lab.target.greedy_data`: the target's greedy continuations, hidden states, argmax);
- :mod:`~cpattn.lab.sequence` -- the drafters over whole sequences without a cache (training
  forwards, and no-cache references of the cached inference);
- :mod:`~cpattn.lab.objectives` -- each method's self-distillation loss;
- :mod:`~cpattn.lab.train` -- ``cpattn train-target`` and ``cpattn train-draft``;
- :mod:`~cpattn.lab.progress` -- phases, steps and the wall-clock budget of long training work;
- :mod:`~cpattn.lab.report` -- ``cpattn bench drafts``: acceptance and decode speed of the heads.

Until the next release the old paths (``cpattn.drafters.train`` ...) still import, with a
DeprecationWarning naming the new one.
"""
