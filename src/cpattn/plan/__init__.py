"""``cpattn.plan``: a performance model for hardware we do not have, calibrated on the hardware we do.

Modules (one idea each):

- :mod:`~cpattn.plan.profiles` -- devices and links (H200 node, B200 node, Ascend 910C node, this CPU),
  each published number with its source;
- :mod:`~cpattn.plan.specs` -- model shapes (:class:`ModelSpec`), ``get_model``;
- :mod:`~cpattn.plan.families` -- built-ins and ``config.json`` read through the model families' own ``from_hf``;
- :mod:`~cpattn.plan.v4costs` -- DeepSeek-V4's attention per layer kind (window, CSA, HCA);
- :mod:`~cpattn.plan.costs` -- exact attention pairs / FLOPs and the alpha + beta cost of each collective;
- :mod:`~cpattn.plan.rules` -- which layouts the engine accepts (``EngineConfig.create`` itself);
- :mod:`~cpattn.plan.collectives` -- collectives as the libraries run them (vLLM custom all-reduce, NCCL);
- :mod:`~cpattn.plan.memory` / :mod:`~cpattn.plan.fits` -- weights, activations, KV; what overflows, what fits;
- :mod:`~cpattn.plan.model` -- TTFT (per request and makespan), TPOT, KV bytes and concurrency per layout;
- :mod:`~cpattn.plan.objective` -- the recommendation for ttft / tpot / throughput / goodput, ties as ties;
- :mod:`~cpattn.plan.arrival` -- goodput under Poisson arrivals (an M/D/1 queue on the prefill);
- :mod:`~cpattn.plan.breakeven` -- the prompt length above which PCP lowers TTFT (``pcp_break_even``);
- :mod:`~cpattn.plan.bench_model` -- this machine's benchmarks (``cpattn bench pcp / dcp / graph``) priced;
- :mod:`~cpattn.plan.cli` -- ``cpattn plan`` (its subcommands calibrate / validate / anchors run the
  benchmark-side experiments of :mod:`cpattn.bench.perf`: the microbenchmarks that fit the CPU profile,
  predicted vs measured ratios, the published anchors predicted).

Example
-------
>>> from cpattn.plan import Layout, get_model, get_profile, predict
>>> p = predict(get_model("qwen3-235b-a22b"), get_profile("h200"), Layout(8, 1, 2), context=32768, batch=8)
>>> p.fits, p.ttft_s > 0, p.tpot_s > 0
(True, True, True)
"""

from cpattn.plan.breakeven import pcp_break_even
from cpattn.plan.model import Layout, Options, Prediction, layouts, predict, recommend
from cpattn.plan.profiles import Profile, get_profile
from cpattn.plan.specs import ModelSpec, get_model

__all__ = ["pcp_break_even", "Layout", "Options", "Prediction", "layouts", "predict", "recommend", "Profile", "get_profile",
           "ModelSpec", "get_model"]
