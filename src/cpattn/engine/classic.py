"""The classic entry points, each a thin call of :mod:`cpattn.engine` (prefill -> hand-off -> decode).

(Moved here from ``cpattn.models.generate``, which still re-exports them: they call the engine, so they
stand above it, not among the models.)

- :func:`generate` / :func:`generate_on_rank`: greedy generation, PCP
  prefill and DCP decode (simulated meshes, or every rank of a real group);
- :func:`speculative_generate` / :func:`speculative_generate_on_rank`: the
  same with a drafter, 1 + k tokens verified per DCP step;
- :func:`disagg_generate` / :func:`pd_generate_on_rank`: P/D, a PCP prefill
  engine handing whole KV blocks to a DCP decode engine;
- :func:`pcp_dcp_generate` / :func:`pcp_dcp_generate_on_rank`: one engine
  with PCP and DCP on the same ranks (opt-in beyond the guide).

``model`` is a family name ("qwen3", "deepseek_v3", "deepseek_v32"), its
:class:`~cpattn.models.family.ModelFamily`, or its module. Every function
checks the layout before any rank starts and returns a
:class:`~cpattn.engine.result.Generation` (tokens [B, N], the logits they
came from [B, N, V], prompt logits when the prefill gathered them, speculative
counts in ``stats``, this rank's measurements in ``facts``).

Example
-------
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> out = generate(qwen3, qwen3.init_params(cfg), cfg, [[1, 2, 3], [4, 5]], 4, pcp_size=2)
>>> out.tokens.shape
torch.Size([2, 4])
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

from cpattn._deprecation import renamed_kwargs
from cpattn.comm.group import Group
from cpattn.config import EngineConfig
from cpattn.engine import driver
from cpattn.engine.drafters import check_drafter, speculative_fields
from cpattn.models.family import ModelFamily
from cpattn.engine.options import Algorithms
from cpattn.engine.result import Generation
from cpattn.dcp.layer_merges import ENGINE_MERGE


def _family(model: ModelFamily | ModuleType | str) -> ModelFamily | str:
    return model.FAMILY if isinstance(model, ModuleType) else model


def _speculative(config: EngineConfig, drafter) -> EngineConfig:
    """The decode engine's config with the drafter's method and settings (re-checked: the guide's rules
    with PCP refuse what they must, e.g. a non-greedy draft or a method the attention kind does not take)."""
    return config if drafter is None else config.replace(**speculative_fields(drafter))


def _graph(graph) -> dict:
    """graph=False: eager; True: a DecodeRunner with the 'eager' backend; a name: that backend."""
    if not graph:
        return {}
    return {"graph_mode": "FULL_DECODE_ONLY", "graph_backend": graph if isinstance(graph, str) else "eager"}


def _on_group(group: Group, fn: str, name: str, size: int | None, old: str, flag: bool | None) -> int:
    """A size of a run on every rank of ``group``: ``group.size`` (default) or 1; ``old``: its deprecated bool."""
    n = group.size
    if flag is not None:
        if size is not None:
            raise TypeError(f"{fn}() got {old}= and {name}=; pass {name}= only ({old} is its deprecated form)")
        warnings.warn(f"{fn}({old}=True/False) is deprecated; pass {name}={n} (over the group) or {name}=1",
                      DeprecationWarning, stacklevel=3)
        size = n if flag else 1
    size = n if size is None else size
    if size not in (1, n):
        raise ValueError(f"{fn}: {name}={size}, but a run on every rank of a group of {n} takes {name} = {n} "
                         f"(over the group) or 1 (each rank alone)")
    return size


def generate(model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *, pcp_size: int = 1,
             dcp_size: int = 1, pcp_method: str = "ring", block_size: int = 4, interleave_size: int = 1,
             dcp_merge: str = ENGINE_MERGE, dsa_split: str = "balanced") -> Generation:
    """Greedy generation: prefill on ``pcp_size`` simulated ranks, decode on ``dcp_size`` (the KV moves in memory).

    pcp_method: "ring" or "allgather"; dsa_split: a DSA model's prefill split
    ("balanced" head-tail or "contiguous"); block_size / interleave_size: the
    decode cache layout; dcp_merge: one of the engine's merges (:data:`cpattn.dcp.ENGINE_MERGES`), by default
    :data:`cpattn.dcp.ENGINE_MERGE` (``"local_ag"``, as every engine door).
    """
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size, block_size=block_size,
                                     interleave_size=interleave_size)
    return driver.generate(_family(model), params, cfg, prompts, max_new_tokens, prefill=pre, decode=dec,
                           algorithms=Algorithms(pcp_method=pcp_method, dsa_split=dsa_split, dcp_merge=dcp_merge))


def generate_on_rank(group: Group, model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                     pcp_size: int | None = None, dcp_size: int | None = None, pcp_method: str = "ring",
                     block_size: int = 4, interleave_size: int = 1, dcp_merge: str = ENGINE_MERGE,
                     dsa_split: str = "balanced", pcp: bool | None = None, dcp: bool | None = None) -> Generation:
    """:func:`generate` as one rank of a real (or simulated) group; run it on every rank.

    ``pcp_size``: ``group.size`` (default: the prefill split over the group) or 1 (every rank prefills
    alone); ``dcp_size``: ``group.size`` (default: the decode cache sharded over the group) or 1 (every
    rank decodes alone). ``pcp`` / ``dcp`` (bools) are their deprecated forms.

    Example
    -------
    >>> gens = spawn(2, generate_on_rank, "qwen3", params, cfg, [[1, 2, 3]], 8)  # doctest: +SKIP
    """
    pcp_size = _on_group(group, "generate_on_rank", "pcp_size", pcp_size, "pcp", pcp)
    dcp_size = _on_group(group, "generate_on_rank", "dcp_size", dcp_size, "dcp", dcp)
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size,
                                     block_size=block_size, interleave_size=interleave_size)
    return driver.generate_on_rank(group, _family(model), params, cfg, prompts, max_new_tokens, prefill=pre,
                                   decode=dec, algorithms=Algorithms(pcp_method=pcp_method, dsa_split=dsa_split,
                                                                     dcp_merge=dcp_merge))


def speculative_generate(model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *, drafter=None,
                         num_speculative_tokens: int = 0, pcp_size: int = 1, dcp_size: int = 1,
                         pcp_method: str = "ring", block_size: int = 4, interleave_size: int = 1,
                         dcp_merge: str = ENGINE_MERGE, graph=False,
                         capture_sizes: list[int] | None = None) -> Generation:
    """:func:`generate` with a drafter (:mod:`cpattn.engine.drafters`): k drafts verified per DCP step.

    graph: verify through a DecodeRunner (True: the 'eager' backend on the
    simulated mesh; capture sizes multiples of 1 + k). Tokens equal plain
    greedy generation's.
    """
    check_drafter(drafter, num_speculative_tokens, settings=False)
    k = num_speculative_tokens if drafter is not None else 0
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size, block_size=block_size,
                                     interleave_size=interleave_size, num_speculative_tokens=k,
                                     capture_sizes=capture_sizes, **_graph(graph))
    return driver.generate(_family(model), params, cfg, prompts, max_new_tokens, prefill=pre,
                           decode=_speculative(dec, drafter),
                           algorithms=Algorithms(pcp_method=pcp_method, dcp_merge=dcp_merge), drafter=drafter)


def speculative_generate_on_rank(group: Group, model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                                 drafter=None, num_speculative_tokens: int = 0, pcp_size: int | None = None,
                                 pcp_method: str = "ring", block_size: int = 4, interleave_size: int = 1,
                                 dcp_merge: str = ENGINE_MERGE, graph=False,
                                 capture_sizes: list[int] | None = None, pcp: bool | None = None) -> Generation:
    """:func:`speculative_generate` as one rank of a real group (DCP decode over ``group``; PCP prefill over
    it with ``pcp_size = group.size``, the default, or on every rank alone with 1; ``pcp``: deprecated bool)."""
    check_drafter(drafter, num_speculative_tokens, settings=False)
    k = num_speculative_tokens if drafter is not None else 0
    n = group.size
    pcp_size = _on_group(group, "speculative_generate_on_rank", "pcp_size", pcp_size, "pcp", pcp)
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=n, block_size=block_size,
                                     interleave_size=interleave_size, num_speculative_tokens=k,
                                     capture_sizes=capture_sizes, **_graph(graph))
    return driver.generate_on_rank(group, _family(model), params, cfg, prompts, max_new_tokens, prefill=pre,
                                   decode=_speculative(dec, drafter),
                                   algorithms=Algorithms(pcp_method=pcp_method, dcp_merge=dcp_merge), drafter=drafter)


@renamed_kwargs(prefill_size="pcp_size", decode_size="dcp_size")
def pd_configs(model, cfg: Any, *, pcp_size: int, dcp_size: int, block_size: int,
               interleave_size: int | None = None, decode_pcp_size: int = 1) -> tuple[EngineConfig, EngineConfig]:
    """The P/D pair's configs (kv_producer, kv_consumer); the interleave defaults to the block size.

    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> prod, cons = pd_configs("qwen3", cfg, pcp_size=2, dcp_size=2, block_size=4)
    >>> prod.kv_transfer.kv_role, cons.kv_transfer.kv_role, cons.parallel.pcp_size
    ('kv_producer', 'kv_consumer', 1)
    """
    inter = block_size if interleave_size is None else interleave_size
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size,
                                     block_size=block_size, interleave_size=inter, pd=True)
    return pre, (dec if decode_pcp_size == 1 else dec.replace(pcp_size=decode_pcp_size))


@renamed_kwargs(prefill_size="pcp_size", decode_size="dcp_size")
def disagg_generate(model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *, pcp_size: int,
                    dcp_size: int, block_size: int = 4, pcp_method: str = "ring", drafter=None,
                    num_speculative_tokens: int = 0, dcp_merge: str = ENGINE_MERGE, graph=False) -> Generation:
    """P/D on simulated meshes: prefill on ``pcp_size`` ranks, whole blocks dealt in memory, decode on ``dcp_size``."""
    check_drafter(drafter, num_speculative_tokens, settings=False)
    k = num_speculative_tokens if drafter is not None else 0
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size,
                                     block_size=block_size, interleave_size=block_size, num_speculative_tokens=k,
                                     pd=True, **_graph(graph))
    return driver.generate(_family(model), params, cfg, prompts, max_new_tokens, prefill=pre,
                           decode=_speculative(dec, drafter),
                           algorithms=Algorithms(pcp_method=pcp_method, dcp_merge=dcp_merge), drafter=drafter)


@renamed_kwargs(prefill_size="pcp_size", decode_size="dcp_size")
def pd_generate_on_rank(world: Group, model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                        pcp_size: int, dcp_size: int, block_size: int = 4, pcp_method: str = "ring",
                        drafter=None, num_speculative_tokens: int = 0, dcp_merge: str = ENGINE_MERGE,
                        graph=False) -> Generation:
    """One rank of a P/D pair in a torch.distributed world of ``pcp_size + dcp_size`` processes.

    World ranks < P prefill and send whole blocks (isend/irecv), the rest decode.
    ``facts.handoff`` says what this rank sent or received.
    """
    check_drafter(drafter, num_speculative_tokens, settings=False)
    k = num_speculative_tokens if drafter is not None else 0
    if world.size != pcp_size + dcp_size:
        raise ValueError(f"the world has {world.size} ranks but pcp_size + dcp_size = "
                         f"{pcp_size} + {dcp_size} = {pcp_size + dcp_size}")
    pre, dec = driver.engine_configs(_family(model), cfg, pcp_size=pcp_size, dcp_size=dcp_size,
                                     block_size=block_size, interleave_size=block_size, num_speculative_tokens=k,
                                     pd=True, **_graph(graph))
    return driver.generate_on_rank(world, _family(model), params, cfg, prompts, max_new_tokens, prefill=pre,
                                   decode=_speculative(dec, drafter),
                                   algorithms=Algorithms(pcp_method=pcp_method, dcp_merge=dcp_merge), drafter=drafter)


def pcp_dcp_config(model, cfg: Any, size: int, *, block_size: int = 4, interleave_size: int = 1,
                   allow_pcp_with_dcp: bool = True) -> EngineConfig:
    """One engine with ``pcp_size == dcp_size == size`` (``allow_pcp_with_dcp=False``: the guide's ValueError)."""
    if not allow_pcp_with_dcp:
        return EngineConfig.create(tp_size=size, pcp_size=size, dcp_size=size, block_size=block_size,
                                   cp_kv_cache_interleave_size=interleave_size)
    return driver.engine_configs(_family(model), cfg, pcp_size=size, dcp_size=size, block_size=block_size,
                                 interleave_size=interleave_size, one_engine=True)[0]


def _one_engine(config: EngineConfig, size: int, drafter, k: int, graph) -> EngineConfig:
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a cpattn.config.EngineConfig; got {type(config).__name__}")
    if config.parallel.pcp_size != size or config.parallel.dcp_size != size:
        raise ValueError(
            f"config has pcp_size={config.parallel.pcp_size}, dcp_size={config.parallel.dcp_size} but the group has "
            f"{size} ranks; PCP+DCP here uses the same ranks for both: pass pcp_size = dcp_size = {size}")
    check_drafter(drafter, k, settings=False)
    if drafter is None and not graph:
        return config
    spec = speculative_fields(drafter) if drafter is not None else {"speculative_method": None}
    return config.replace(num_speculative_tokens=k if drafter is not None else 0, **spec, **_graph(graph))


def pcp_dcp_generate_on_rank(group: Group, model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                             config: EngineConfig, pcp_method: str = "ring", exchange: str = "a2a", drafter=None,
                             num_speculative_tokens: int = 0, dcp_merge: str = ENGINE_MERGE, graph=False) -> Generation:
    """PCP prefill writing the DCP layout of the same ranks (one owner all-to-all), then DCP decode.

    config: one engine with ``pcp_size == dcp_size == group.size`` and
    ``allow_pcp_with_dcp=True`` (:func:`pcp_dcp_config`). exchange: "a2a" or
    "allgather". With PCP, speculative decoding follows the guide's methods.
    """
    one = _one_engine(config, group.size, drafter, num_speculative_tokens, graph)
    return driver.generate_on_rank(group, _family(model), params, cfg, prompts, max_new_tokens, prefill=one,
                                   decode=one, drafter=drafter, prompt_logits=False,
                                   algorithms=Algorithms(pcp_method=pcp_method, dcp_merge=dcp_merge, handoff=exchange))


def pcp_dcp_generate(model, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *, config: EngineConfig,
                     **kw) -> Generation:
    """:func:`pcp_dcp_generate_on_rank` on ``config.parallel.pcp_size`` simulated ranks; rank 0's generation."""
    from cpattn.comm.sim import simulate

    size = config.parallel.pcp_size
    _one_engine(config, size, kw.get("drafter"), kw.get("num_speculative_tokens", 0), kw.get("graph", False))
    outs = simulate(size, pcp_dcp_generate_on_rank, model.FAMILY if isinstance(model, ModuleType) else model,
                    params, cfg, prompts, max_new_tokens, config=config, **kw)
    for r, o in enumerate(outs[1:], 1):
        if not o.tokens.equal(outs[0].tokens):
            raise RuntimeError(f"rank {r} generated different tokens than rank 0; the ranks diverged")
    return outs[0]
