"""The planner's experiments, beside the other benchmarks: they measure this machine or published numbers
against :mod:`cpattn.plan`'s model, which stays the library (nothing in ``cpattn.plan`` imports this package).

- :mod:`~cpattn.bench.perf.calibrate` / :mod:`~cpattn.bench.perf.calibrate_comm` -- microbenchmarks that fit
  the CPU profile (``cpattn plan calibrate``);
- :mod:`~cpattn.bench.perf.validate` -- predicted (:mod:`cpattn.plan.bench_model`) vs measured ratios of
  ``cpattn bench pcp / dcp / graph`` (``cpattn plan validate``);
- :mod:`~cpattn.bench.perf.anchors` -- the published anchors (PCP, DCP, Llama3 1M, DeepSeek-V4 PCP2, SGLang
  CP), predicted (``cpattn plan anchors``); :mod:`~cpattn.bench.perf.anchor_terms`, deprecated;
- :mod:`~cpattn.bench.perf.cli` -- the three subcommands, on :mod:`cpattn.bench.harness`.

The old paths ``cpattn.plan.calibrate``, ``calibrate_comm``, ``validate``, ``anchors``, ``anchor_terms`` and
``cli_tools`` still import (one minor release), warning ``DeprecationWarning`` with the new path.
"""
