"""What the engine supports, checked before any rank starts, in the configs' own problem format.

Beyond the guide's rules (:class:`cpattn.config.EngineConfig`), cpattn's
engine has its own limits, each reported as
``"param: saw ...; rule: ...; fix: ..."``:

- TP runs only as the split of query heads inside the DCP group, so a
  decode engine has ``tp_size == dcp_size`` and a separate prefill engine
  ``tp_size == 1``; a decode engine has ``pcp_size == 1`` and a separate
  prefill engine ``dcp_size == 1`` (one engine with both opts in through
  ``allow_pcp_with_dcp``);
- engines on the same ranks have PCP and DCP sizes of 1 or the world size;
  on separate ranks (P/D) the world is ``pcp_size + dcp_size`` ranks and
  KV moves as whole blocks (``cp_kv_cache_interleave_size == block_size``);
- a compiler graph backend needs a family whose decode step is capturable;
- speculation: k >= 1 drafts with a drafter, none without;
- a KV pool moves whole blocks of the paged cache: not for a family with
  its own cache (``ModelFamily.cache``, DeepSeek-V4's ``"v4"``).

Example
-------
>>> from cpattn.config import EngineConfig
>>> from cpattn.models.family import get_family
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> dec = EngineConfig.create(tp_size=4, dcp_size=2, attention="mla")
>>> print(engine_problems(get_family("qwen3"), cfg, EngineConfig.create(), dec, world_size=2)[0])  # doctest: +ELLIPSIS
tp_size: saw tp_size=4, dcp_size=2; rule: cpattn's engine runs tensor parallelism only as ...
"""

from __future__ import annotations

from typing import Any

from cpattn.config import EngineConfig
from cpattn.config.problems import problem, raise_if
from cpattn.models.family import ModelFamily


def topology(prefill: EngineConfig, decode: EngineConfig, world_size: int) -> str:
    """"colocated" (both engines on the same ranks) or "disaggregated" (P + N separate ranks)."""
    p, n = prefill.parallel.pcp_size, decode.parallel.dcp_size
    return "disaggregated" if world_size == p + n and world_size > max(p, n) else "colocated"


def engine_problems(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, *,
                    world_size: int, topology: str | None = None, drafter=None, max_new_tokens: int = 1,
                    pool: bool = False) -> list[str]:
    """Every reason the engine cannot run this pair of configs on ``world_size`` ranks (empty: it can).

    topology: "colocated", "disaggregated" (default: :func:`topology` of the
    world size) or "simulated" (two simulated meshes, any sizes). pool: a KV
    pool takes part (it moves whole blocks). A problem of the DCP size or of
    the ranks offers layouts that pass every rule (:func:`passing_layouts`).
    """
    topology = topology or globals()["topology"](prefill, decode, world_size)
    out = _problems(family, cfg, prefill, decode, world_size=world_size, topology=topology, drafter=drafter,
                    max_new_tokens=max_new_tokens, pool=pool)
    if not any(p.startswith(("world_size:", "dcp_size:")) for p in out):
        return out
    offers = passing_layouts(family, cfg, prefill, decode, world_size=world_size, topology=topology,
                             drafter=drafter, max_new_tokens=max_new_tokens, pool=pool)
    if not offers:
        return out
    fix = " or ".join(f"run {w} ranks with pcp_size={p}, dcp_size={n}" if w != world_size else
                      f"use pcp_size={p}, dcp_size={n}" for p, n, w in offers)
    return [f"{p.rpartition('; fix: ')[0]}; fix: {fix}" if p.startswith(("world_size:", "dcp_size:")) else p
            for p in out]


def passing_layouts(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, *, world_size: int,
                    topology: str, shown: int = 3, **kw) -> list[tuple[int, int, int]]:
    """Up to ``shown`` (pcp_size, dcp_size, ranks) nearest the configs' sizes that pass every rule (the
    guide's and the engine's; the decode engine keeps ``tp_size = dcp_size``): colocated engines run
    ``max(pcp, dcp)`` ranks, P/D ``pcp + dcp``, simulated meshes any.

    >>> from cpattn.models.family import get_family
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    >>> p = EngineConfig.create(pcp_size=3)
    >>> d = EngineConfig.create(tp_size=2, dcp_size=2, num_kv_heads=1, tp_splits_kv_heads=False)
    >>> passing_layouts(get_family("qwen3"), cfg, p, d, world_size=3, topology="colocated")
    [(2, 2, 2), (3, 1, 3), (1, 2, 2)]
    """
    import warnings

    from cpattn.config import ConfigError

    p0, n0 = prefill.parallel.pcp_size, decode.parallel.dcp_size
    one = prefill is decode
    found = []
    span = range(1, max(8, 2 * max(p0, n0)) + 1)
    for p, n in sorted(((p, n) for p in span for n in span), key=lambda pn: (abs(pn[0] - p0) + abs(pn[1] - n0), pn)):
        if (p, n) == (p0, n0):
            continue
        w = {"colocated": max(p, n), "disaggregated": p + n}.get(topology, world_size)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if one:
                    pre = dec = prefill.replace(pcp_size=p, dcp_size=n, tp_size=n)
                else:
                    pre = prefill.replace(pcp_size=p)
                    dec = decode.replace(dcp_size=n, tp_size=n)
        except ConfigError:
            continue
        if not _problems(family, cfg, pre, dec, world_size=w, topology=topology, **kw):
            found.append((p, n, w))
            if len(found) == shown:
                break
    return found


def nearest_sizes(fits, pcp_size: int, dcp_size: int, *, shown: int = 3) -> list[tuple[int, int]]:
    """Up to ``shown`` (pcp_size, dcp_size) pairs nearest the given ones for which ``fits(p, n)`` is True (a
    command's whole check, e.g. the demo's), to offer as the fix of a refused layout.

    >>> nearest_sizes(lambda p, n: 4 % n == 0 and p in (1, max(p, n)) and n in (1, max(p, n)), 3, 2)
    [(2, 2), (3, 1), (1, 2)]
    """
    import warnings

    span = range(1, max(8, 2 * max(pcp_size, dcp_size)) + 1)
    found = []
    near = sorted(((p, n) for p in span for n in span),
                  key=lambda pn: (abs(pn[0] - pcp_size) + abs(pn[1] - dcp_size), pn))
    for p, n in near:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if (p, n) != (pcp_size, dcp_size) and fits(p, n):
                found.append((p, n))
        if len(found) == shown:
            break
    return found


def _problems(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, *, world_size: int,
              topology: str, drafter=None, max_new_tokens: int = 1, pool: bool = False) -> list[str]:
    out = []
    one = prefill is decode
    p, n = prefill.parallel.pcp_size, decode.parallel.dcp_size
    heads = cfg.num_attention_heads
    dtp = decode.parallel.tp_size
    if dtp != n:
        out.append(problem("tp_size", f"tp_size={dtp}, dcp_size={n}",
                           "cpattn's engine runs tensor parallelism only as the DCP group's split of query heads",
                           f"set tp_size={n} (= dcp_size) on the decode engine"))
    elif heads % n:
        out.append(problem("dcp_size", f"dcp_size={n}, num_attention_heads={heads}",
                           "num_attention_heads % dcp_size == 0 (DCP reuses TP ranks, each holding a slice of the heads)",
                           f"use dcp_size in {[d for d in range(1, heads + 1) if heads % d == 0]}"))
    if not one:
        if prefill.parallel.tp_size != 1:
            out.append(problem("tp_size", f"tp_size={prefill.parallel.tp_size} on the prefill engine",
                               "the prefill engine splits tokens (PCP), not heads", "set tp_size=1 on the prefill engine"))
        if prefill.parallel.dcp_size != 1:
            out.append(problem("dcp_size", f"dcp_size={prefill.parallel.dcp_size} on the prefill engine",
                               "a separate prefill engine has no decode cache to shard",
                               "set dcp_size=1 on the prefill engine (DCP belongs to the decode engine)"))
        if decode.parallel.pcp_size != 1:
            out.append(problem("pcp_size", f"pcp_size={decode.parallel.pcp_size} on the decode engine",
                               "a separate decode engine prefills nothing", "set pcp_size=1 on the decode engine"))
    if topology == "disaggregated":
        if decode.cache.cp_kv_cache_interleave_size != decode.cache.block_size:
            out.append(problem("cp_kv_cache_interleave_size",
                               f"{decode.cache.cp_kv_cache_interleave_size} with block_size={decode.cache.block_size} "
                               "(P/D)", "P/D moves whole blocks, so interleave size == block size",
                               f"set cp_kv_cache_interleave_size={decode.cache.block_size}"))
    elif topology == "colocated" and (p not in (1, world_size) or n not in (1, world_size)):
        out.append(problem("world_size", f"{world_size} ranks for pcp_size={p}, dcp_size={n}",
                           "engines on the same ranks have PCP and DCP sizes of 1 or the number of ranks; "
                           "engines on separate ranks (P/D) need pcp_size + dcp_size ranks",
                           f"run {max(p, n)} ranks (sizes 1 or {max(p, n)}) or {p + n} ranks for P/D"))
    if pool and n > 1 and decode.cache.cp_kv_cache_interleave_size != decode.cache.block_size:
        out.append(problem("cp_kv_cache_interleave_size",
                           f"{decode.cache.cp_kv_cache_interleave_size} with block_size={decode.cache.block_size} "
                           f"and a KV pool (dcp_size={n})", "a DCP rank stores and loads whole blocks of a KV pool, "
                           "so interleave size == block size", f"set cp_kv_cache_interleave_size={decode.cache.block_size}"))
    if pool and not family.backend.per_token_kv:
        out.append(problem("kv_pool", f"a KV pool for {family.name}", f"{family.name} keeps its own cache "
                           f"(ModelFamily.cache={family.cache!r}), which the pool's whole-block rows do not describe",
                           "run without a KV pool"))
    backend = decode.compilation.graph_backend
    if decode.compilation.captures and backend not in ("auto", "eager") and not family.capturable:
        out.append(problem("graph_backend", f"{backend!r} for {family.name}",
                           f"a compiler backend needs a capturable decode step; {family.name}'s has data-dependent "
                           "shapes or host syncs", "use graph_backend='eager' or 'auto'"))
    k = decode.speculative.num_speculative_tokens
    if drafter is None and k:
        out.append(problem("num_speculative_tokens", f"{k} without a drafter",
                           "draft tokens need a drafter", "pass a drafter or num_speculative_tokens=0"))
    if drafter is not None and not k:
        out.append(problem("num_speculative_tokens", "0 with a drafter",
                           "speculative decoding drafts at least one token per step",
                           "set num_speculative_tokens >= 1 (e.g. 3)"))
    if max_new_tokens < 1:
        out.append(problem("max_new_tokens", repr(max_new_tokens), "at least 1", "ask for max_new_tokens >= 1"))
    return out


def check(family: ModelFamily, cfg: Any, prefill: EngineConfig, decode: EngineConfig, *, world_size: int,
          topology: str | None = None, drafter=None, max_new_tokens: int = 1, pool: bool = False) -> None:
    """Raise one :class:`~cpattn.config.ConfigError` listing every problem of :func:`engine_problems`."""
    raise_if("engine layout", engine_problems(family, cfg, prefill, decode, world_size=world_size, topology=topology,
                                              drafter=drafter, max_new_tokens=max_new_tokens, pool=pool))
