"""``EngineConfig``: one engine's five configs plus the model, checked against every rule of the CP guide.

Each part validates itself (:class:`ParallelConfig`, :class:`CacheConfig`,
:class:`KVTransferConfig`, :class:`SpeculativeConfig`,
:class:`CompilationConfig`, :class:`ModelConfig`); the rules that span
parts live here (DESIGN.md §8):

- DCP: MLA/DSA/V4 (one KV head) need ``tp >= dcp`` and ``tp % dcp == 0``;
  GQA (KV heads split over TP) ``(tp // num_kv_heads) >= dcp`` and
  ``% dcp == 0``; ``num_attention_heads % tp == 0``;
- DSA-CP only for DSA models; with PCP only FULL_DECODE_ONLY graphs;
- KV transfer with CP: ``cp_kv_cache_interleave_size == block_size``;
  in P/D only the producer uses PCP; pooling with PCP not layerwise;
- speculative decoding with PCP: MTP for MLA/DSA, Eagle3 for GQA, DSpark
  for DSA (DeepSeek-V4, a DSA model in the guide: MTP or DSpark); greedy
  drafts; no SFA draft attention; no adaptive verification; dynamic draft
  length not validated; capture sizes are multiples of ``1 + k``.

:meth:`EngineConfig.create` takes every field by its flat name (vLLM's
engine-argument names) and reports the problems of all parts at once.

Example
-------
>>> cfg = EngineConfig.create(tp_size=2, pcp_size=2, attention="mla")
>>> cfg.parallel.world_size_with_pcp
4
>>> EngineConfig.create(tp_size=4, dcp_size=8, attention="mla")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
cpattn.config.problems.ConfigError: invalid EngineConfig (1 problem):
  - dcp_size: ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cpattn.config.cache import CacheConfig
from cpattn.config.compilation import CompilationConfig
from cpattn.config.kv_transfer import KVTransferConfig
from cpattn.config.model import ModelConfig
from cpattn.config.parallel import ParallelConfig
from cpattn.config.problems import divisors, problem, raise_if
from cpattn.config.speculative import SpeculativeConfig

PCP_GRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
# speculative methods the guide supports with PCP, per attention kind
PCP_SPEC_METHODS = {"gqa": ("eagle3",), "mla": ("mtp",), "dsa": ("mtp", "dspark"), "v4": ("mtp", "dspark")}
PARTS = {"model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "kv_transfer": KVTransferConfig,
         "speculative": SpeculativeConfig, "compilation": CompilationConfig}


@dataclass(frozen=True)
class EngineConfig:
    """One inference engine: the model's attention facts and its five configs (see module doc)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        for name, cls in PARTS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"EngineConfig.{name} must be a {cls.__name__}; got {type(getattr(self, name)).__name__}")
        raise_if("EngineConfig", self.problems())

    @classmethod
    def create(cls, **flat) -> EngineConfig:
        """Build every part from flat field names; raise one :class:`ConfigError` listing all problems.

        >>> EngineConfig.create(dcp_size=2, tp_size=2, attention="mla", block_size=64).cache.block_size
        64
        """
        owners = {f.name: part for part, c in PARTS.items() for f in dataclasses.fields(c)}
        unknown = sorted(set(flat) - set(owners))
        if unknown:
            raise TypeError(f"EngineConfig.create: unknown fields {unknown}; known: {sorted(owners)}")
        kwargs: dict[str, dict] = {part: {} for part in PARTS}
        for name, value in flat.items():
            kwargs[owners[name]][name] = value
        parts = {part: c.unchecked(**kwargs[part]) for part, c in PARTS.items()}
        found = [p for part in parts.values() for p in part.problems()]
        if not any(part.field_problems() for part in parts.values()):  # the cross rules do arithmetic on fields
            whole = object.__new__(cls)
            for part, value in parts.items():
                object.__setattr__(whole, part, value)
            found += whole.problems()
        raise_if("EngineConfig", found)
        return cls(**{part: c(**kwargs[part]) for part, c in PARTS.items()})

    def problems(self) -> list[str]:
        """Every broken rule that spans parts; empty when valid (each part checked itself)."""
        return [*self._dcp_problems(), *self._pcp_problems(), *self._kv_problems(), *self._spec_problems()]

    def replace(self, **flat) -> EngineConfig:
        """A copy with flat fields changed, validated again.

        >>> EngineConfig.create(tp_size=2).replace(pcp_size=2).parallel.world_size_with_pcp
        4
        """
        current = {f.name: getattr(getattr(self, part), f.name) for part, c in PARTS.items()
                   for f in dataclasses.fields(c)}
        return EngineConfig.create(**{**current, **flat})

    # -- rules -----------------------------------------------------------------------------
    def _dcp_problems(self) -> list[str]:
        m, tp, dcp = self.model, self.parallel.tp_size, self.parallel.dcp_size
        out = []
        if m.num_attention_heads is not None and m.num_attention_heads % tp:
            out.append(problem("tp_size", f"tp_size={tp}, num_attention_heads={m.num_attention_heads}",
                               "num_attention_heads % tp_size == 0 (each TP rank holds a whole slice of the heads)",
                               f"use tp_size in {divisors(m.num_attention_heads)}"))
        if dcp == 1:
            return out
        if m.attention in ("mla", "dsa", "v4") or not m.tp_splits_kv_heads:
            if tp >= dcp and tp % dcp == 0:
                return out
            rule = ("MLA/DSA/V4 models need" if m.attention != "gqa" else "DCP reuses TP ranks:")
            return out + [problem(
                "dcp_size", f"dcp_size={dcp}, tp_size={tp} ({m.attention})",
                f"{rule} tp_size >= dcp_size and tp_size % dcp_size == 0 (DCP reuses TP ranks)",
                f"use dcp_size in {divisors(tp)} or raise tp_size to a multiple of {dcp}")]
        heads = m.num_kv_heads
        if heads is None:
            return out + [problem(
                "num_kv_heads", f"None with dcp_size={dcp} (gqa)",
                "GQA with DCP checks (tp_size // num_kv_heads) against dcp_size, so the KV head count is needed",
                "pass num_kv_heads (the model's num_key_value_heads)")]
        per_head = tp // heads  # TP ranks that hold a copy of the same KV head
        if per_head >= dcp and per_head % dcp == 0:
            return out
        return out + [problem(
            "dcp_size", f"dcp_size={dcp}, tp_size={tp}, num_kv_heads={heads} (gqa): tp_size // num_kv_heads = {per_head}",
            "GQA models need (tp_size // num_kv_heads) >= dcp_size and (tp_size // num_kv_heads) % dcp_size == 0 "
            "(ranks of one DCP group must hold the same KV heads)",
            f"use dcp_size in {divisors(per_head) or [1]} or raise tp_size to a multiple of num_kv_heads * dcp_size "
            f"= {heads * dcp}")]

    def _pcp_problems(self) -> list[str]:
        out = []
        p, attention = self.parallel, self.model.attention
        if p.enable_dsa_cp and attention != "dsa":
            out.append(problem("enable_dsa_cp", f"True with attention={attention!r}",
                               "DSA-CP is an optimization of DSA (sparse) attention only",
                               'set enable_dsa_cp=False, or attention="dsa" for a DSA model'))
        mode = self.compilation.graph_mode
        if p.pcp_size > 1 and mode not in PCP_GRAPH_MODES:
            out.append(problem("graph_mode", f"{mode!r} with pcp_size={p.pcp_size}",
                               "with PCP the only full-graph mode is FULL_DECODE_ONLY",
                               'use graph_mode="FULL_DECODE_ONLY" or "NONE" (eager)'))
        return out

    def _kv_problems(self) -> list[str]:
        out = []
        p, c, kv = self.parallel, self.cache, self.kv_transfer
        block, inter = c.block_size, c.cp_kv_cache_interleave_size
        if kv.kv_transfer is not None and (p.pcp_size > 1 or p.dcp_size > 1) and inter != block:
            out.append(problem(
                "cp_kv_cache_interleave_size",
                f"cp_kv_cache_interleave_size={inter}, block_size={block}, kv_transfer={kv.kv_transfer!r}",
                "with KV transfer (P/D or pooling) and context parallel, interleave size == block_size, "
                "so whole blocks move between engines",
                f"set cp_kv_cache_interleave_size={block}"))
        if p.pcp_size > 1 and kv.kv_transfer == "pd" and kv.kv_role not in (None, "kv_producer"):
            what = "the decode (kv_consumer) engine" if kv.kv_role == "kv_consumer" else f"a {kv.kv_role} engine"
            out.append(problem(
                "pcp_size", f"pcp_size={p.pcp_size} on {what}",
                "in P/D disaggregation only the prefill (kv_producer) engine uses PCP; the decode engine has pcp_size=1",
                "set pcp_size=1 on this engine (use dcp_size to shard its KV cache)"))
        if p.pcp_size > 1 and kv.kv_transfer == "pool" and kv.use_layerwise:
            out.append(problem(
                "use_layerwise", f"True with pcp_size={p.pcp_size}, kv_transfer='pool'",
                "KV-cache pooling with PCP needs a store connector that is not layerwise",
                "set use_layerwise=False (use_layerwise=false on the store connector)"))
        return out

    def _spec_problems(self) -> list[str]:
        out = []
        s, pcp = self.speculative, self.parallel.pcp_size
        sizes, q_len = self.compilation.capture_sizes, s.query_len
        if sizes is not None and any(x % q_len for x in sizes):
            out.append(problem(
                "capture_sizes", f"{list(sizes)} with num_speculative_tokens={s.num_speculative_tokens}",
                f"capture sizes count query tokens, whole requests of 1 + k = {q_len}: multiples of {q_len}",
                f"use multiples of {q_len}, e.g. {[q_len * m for m in (1, 2, 4, 8)]}"))
        method = s.speculative_method
        if pcp == 1 or method is None:
            return out
        allowed = PCP_SPEC_METHODS[self.model.attention]
        if method not in allowed:
            out.append(problem(
                "speculative_method", f"{method!r} with pcp_size={pcp}, attention={self.model.attention!r}",
                "PCP speculative decoding supports MTP for MLA and DSA models, Eagle3 for GQA models, "
                "DSpark for DeepSeek-V4 DSA models",
                f"use speculative_method in {list(allowed)}, or pcp_size=1"))
        if s.draft_sampling != "greedy":
            out.append(problem("draft_sampling", f"{s.draft_sampling!r} with pcp_size={pcp}",
                               "with PCP draft sampling must be greedy", 'set draft_sampling="greedy"'))
        if s.draft_attention == "sfa":
            out.append(problem("draft_attention", f"'sfa' with pcp_size={pcp}",
                               "PCP speculative decoding does not support SFA draft attention",
                               "use a dense draft attention backend (draft_attention=None)"))
        if s.adaptive_verification:
            out.append(problem("adaptive_verification", f"True with pcp_size={pcp}",
                               "PCP speculative decoding does not support adaptive verification",
                               "set adaptive_verification=False"))
        if s.dynamic_draft_length:
            out.append(problem("dynamic_draft_length", f"True with pcp_size={pcp}",
                               "a dynamic draft length is not validated with PCP (the guide)",
                               "verify a fixed num_speculative_tokens (dynamic_draft_length=False)"))
        return out
