"""The decode stage as a decode :class:`~cpattn.config.EngineConfig` asks for it: this rank's empty cache,
a captured runner for its capture sizes and graph backend, and the run (eager or replayed, plain or
speculative). The driver composes these; each is usable alone (``cpattn demo`` times them one by one).
"""

from __future__ import annotations

from cpattn.comm.group import Group
from cpattn.comm.sim import SimMesh
from cpattn.config import EngineConfig
from cpattn.engine.batch import Prompts
from cpattn.engine.decode import DecodeOut, cache_capacity, decode, make_runner  # noqa: F401 - cache_capacity kept
from cpattn.engine.drafters import TargetHidden
from cpattn.models.family import ModelFamily, param_dtype  # noqa: F401 - param_dtype kept importable
from cpattn.engine.options import Algorithms
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.prefill import PrefillOut
from cpattn.engine.prefill_steps import Prefix


def graph_backend(decode_cfg: EngineConfig, family: ModelFamily, group: Group) -> str:
    """The graph backend a decode group uses: "auto" picks a compiler only where the step can be traced."""
    name = decode_cfg.compilation.graph_backend
    if name != "auto":
        return name
    return "auto" if family.capturable and group.traceable else "eager"


def run_decode(dg: Group, family, params, cfg, shard, prompts: Prompts, first, steps, decode_cfg, algorithms, drafter,
               on_step, runner=None, prompt_hidden: TargetHidden | None = None) -> DecodeOut:
    """The decode stage as the decode engine's config asks: eager, or through a captured runner
    (built here unless one is passed; the drafter's own steps then use the same graph backend).
    prompt_hidden: the prompts' hidden states for a drafter that reads them (:func:`drafter_hidden`).
    Returns :class:`~cpattn.engine.decode.DecodeOut`."""
    k = decode_cfg.speculative.num_speculative_tokens if drafter is not None else 0
    captures = decode_cfg.compilation.captures
    if runner is None and captures:
        runner = capture(dg, family, params, cfg, shard, prompts, decode_cfg, algorithms, drafter)
    return decode(dg, family, params, cfg, shard, prompts.lists(), first, steps, drafter=drafter,
                  num_speculative_tokens=k, merge=algorithms.dcp_merge, runner=runner, on_step=on_step,
                  prompt_hidden=prompt_hidden,
                  draft_graph=graph_backend(decode_cfg, family, dg) if captures and k else None)


def hidden_layers(drafter) -> tuple | None:
    """The target hidden states a run must keep for its drafter (None: it reads tokens only)."""
    return None if drafter is None else drafter.hidden_layers


def drafter_hidden(out: PrefillOut, p: Prompts, prefix: Prefix | None = None) -> TargetHidden | None:
    """The prefill's hidden states (request order) as the drafter's first :class:`TargetHidden`: each
    request's computed rows, from its first uncached position."""
    if out.hidden is None:
        return None
    ctx = prefix.context_lens if prefix is not None else (0,) * p.num_requests
    new = p if prefix is None else p.suffix(ctx)
    return TargetHidden.packed(out.hidden, new.cu_seqlens, list(ctx))


def capture(dg: Group, family, params, cfg, shard, prompts: Prompts, decode_cfg: EngineConfig,
            algorithms: Algorithms, drafter):
    """A captured :class:`~cpattn.graphs.DecodeRunner` for the decode engine's capture sizes and backend."""
    k = decode_cfg.speculative.num_speculative_tokens if drafter is not None else 0
    sizes = decode_cfg.compilation.capture_sizes
    return make_runner(dg, family, params, cfg, shard, num_speculative_tokens=k,
                       max_requests=prompts.num_requests, merge=algorithms.dcp_merge,
                       capture_sizes=list(sizes) if sizes else None, backend=graph_backend(decode_cfg, family, dg),
                       hidden_layers=hidden_layers(drafter) if k else None)


def new_shard(family, cfg, params, prompts: Prompts, steps: int, decode_cfg: EngineConfig, drafter,
              group: Group | None = None) -> PagedShard:
    """An empty decode cache for this rank, sized for the prompts, ``steps`` more tokens and k drafts: the
    family's cache backend's (a :class:`~cpattn.engine.paged_cache.PagedShard` for the paged kind;
    ``group``: this rank's decode group, default this rank alone)."""
    k = decode_cfg.speculative.num_speculative_tokens if drafter is not None else 0
    return family.backend.new_cache(family, cfg, params, prompts, steps, decode_cfg, k,
                                    group or SimMesh(1).groups()[0])
