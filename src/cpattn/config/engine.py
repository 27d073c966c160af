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
- speculative decoding: capture sizes are multiples of ``1 + k``.

One policy for the guide's limitation lists (docs/compat.md): a rule that
protects correctness is a refusal (a :class:`ConfigError`); a rule that
only says what vLLM-Ascend's engine supports -- where cpattn runs the
layout exactly -- is a *compatibility note* (:meth:`EngineConfig.compat_notes`,
one :class:`GuideCompatWarning` at construction), and becomes a refusal with
``strict_guide=True`` (for a deployment planned on that engine). The notes:
speculative decoding with PCP (MTP for MLA/DSA, Eagle3 for GQA, DSpark for
DSA/V4; greedy drafts; no SFA draft attention; no adaptive verification;
dynamic draft length not validated), graph modes other than
FULL_DECODE_ONLY with PCP, PCP with DSA-CP, a layerwise pooling connector
with PCP, and PCP with DCP in one engine (opted in by ``allow_pcp_with_dcp``).

A refusal's ``fix:`` names values that pass every rule: integer fields are
searched near the value seen through the whole check (:func:`searched_fix`).

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
  - dcp_size: ...; fix: use dcp_size in [4, 2, 1] or tp_size in [8, 16]
>>> import warnings
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore")
...     EngineConfig.create(pcp_size=2, speculative_method="ngram", num_speculative_tokens=2).compat_notes()
...     # doctest: +ELLIPSIS
["speculative_method: saw 'ngram' with pcp_size=2, attention='gqa'; rule: vLLM-Ascend's engine refuses it: ..."]
>>> EngineConfig.create(pcp_size=2, speculative_method="ngram", num_speculative_tokens=2, strict_guide=True)
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
cpattn.config.problems.ConfigError: invalid EngineConfig (1 problem):
  - speculative_method: saw 'ngram' with pcp_size=2, attention='gqa'; rule: vLLM-Ascend's engine refuses it: ...
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import InitVar, dataclass, field

from cpattn.config.cache import CacheConfig
from cpattn.config.compilation import CompilationConfig
from cpattn.config.kv_transfer import KVTransferConfig
from cpattn.config.model import ModelConfig
from cpattn.config.parallel import ParallelConfig
from cpattn.config.problems import divisors, problem, raise_if, searched_fix
from cpattn.config.speculative import SpeculativeConfig

PCP_GRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
# speculative methods the guide supports with PCP, per attention kind
PCP_SPEC_METHODS = {"gqa": ("eagle3",), "mla": ("mtp",), "dsa": ("mtp", "dspark"), "v4": ("mtp", "dspark")}
PARTS = {"model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "kv_transfer": KVTransferConfig,
         "speculative": SpeculativeConfig, "compilation": CompilationConfig}
# integer fields a refusal's fix may change, per refused field (searched through the whole check)
FIX_FIELDS = {"dcp_size": ("dcp_size", "tp_size"), "tp_size": ("tp_size",), "pcp_size": ("pcp_size",),
              "cp_kv_cache_interleave_size": ("cp_kv_cache_interleave_size",), "block_size": ("block_size",),
              "world_size": ("world_size",)}


class GuideCompatWarning(UserWarning):
    """A layout cpattn runs exactly that vLLM-Ascend's engine would refuse (a compatibility note)."""


def _flat_problems(cls, flat: dict, strict: bool) -> list[str]:
    """Every problem of the config ``flat`` describes (parts, then cross rules and, when ``strict``, the
    guide's compatibility notes), without raising."""
    owners = {f.name: part for part, c in PARTS.items() for f in dataclasses.fields(c)}
    kwargs: dict[str, dict] = {part: {} for part in PARTS}
    for name, value in flat.items():
        kwargs[owners[name]][name] = value
    parts = {part: c.unchecked(**kwargs[part]) for part, c in PARTS.items()}
    found = [p for part in parts.values() for p in part.problems()]
    if not any(part.field_problems() for part in parts.values()):  # the cross rules do arithmetic on fields
        whole = object.__new__(cls)
        for part, value in parts.items():
            object.__setattr__(whole, part, value)
        object.__setattr__(whole, "strict_guide", strict)
        found += whole.problems()
    return found


@dataclass(frozen=True)
class EngineConfig:
    """One inference engine: the model's attention facts and its five configs (see module doc).

    ``strict_guide=True``: the guide's compatibility notes are refusals too (what vLLM-Ascend's engine
    would refuse); read back as ``config.strict_guide``.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    strict_guide: InitVar[bool] = False

    def __post_init__(self, strict_guide: bool = False) -> None:
        for name, cls in PARTS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"EngineConfig.{name} must be a {cls.__name__}; got {type(getattr(self, name)).__name__}")
        if not isinstance(strict_guide, bool):
            raise TypeError(f"EngineConfig.strict_guide must be True or False; got {strict_guide!r}")
        object.__setattr__(self, "strict_guide", strict_guide)
        found = self.problems()
        if found:
            raise_if("EngineConfig", _with_fixes(type(self), self.flat(), found, strict_guide))
        notes = self.compat_notes()
        if notes:
            warnings.warn(GuideCompatWarning(
                "cpattn runs this layout exactly, but vLLM-Ascend's engine would refuse it (EngineConfig"
                "(strict_guide=True) / --guide-compat refuses it here): " + " -- also ".join(notes)), stacklevel=3)

    @classmethod
    def create(cls, **flat) -> EngineConfig:
        """Build every part from flat field names (and ``strict_guide``); raise one :class:`ConfigError`
        listing all problems, each fix searched through the whole check.

        >>> EngineConfig.create(dcp_size=2, tp_size=2, attention="mla", block_size=64).cache.block_size
        64
        """
        strict = flat.pop("strict_guide", False)
        owners = {f.name: part for part, c in PARTS.items() for f in dataclasses.fields(c)}
        unknown = sorted(set(flat) - set(owners))
        if unknown:
            raise TypeError(f"EngineConfig.create: unknown fields {unknown}; known: {sorted(owners)}")
        found = _flat_problems(cls, flat, bool(strict))
        raise_if("EngineConfig", _with_fixes(cls, flat, found, bool(strict)))
        kwargs: dict[str, dict] = {part: {} for part in PARTS}
        for name, value in flat.items():
            kwargs[owners[name]][name] = value
        return cls(**{part: c(**kwargs[part]) for part, c in PARTS.items()}, strict_guide=strict)

    def problems(self) -> list[str]:
        """Every broken rule that spans parts; empty when valid (each part checked itself). With
        ``strict_guide`` the compatibility notes count as problems."""
        out = [*self._dcp_problems(), *self._kv_problems(), *self._spec_problems()]
        return out + (self.compat_notes() if getattr(self, "strict_guide", False) else [])

    def compat_notes(self) -> list[str]:
        """What vLLM-Ascend's engine would refuse in this layout although cpattn runs it exactly (the guide's
        limitation lists), one ``"param: saw ...; rule: ...; fix: ..."`` line each (the fix is for a
        deployment on that engine); empty when the guide allows everything here.

        >>> EngineConfig.create(tp_size=2, dcp_size=2, attention="mla").compat_notes()
        []
        """
        return [*self._pcp_notes(), *self._kv_notes(), *self._spec_notes()]

    def flat(self) -> dict:
        """Every part's fields by flat name (what :meth:`create` takes).

        >>> EngineConfig.create(block_size=64).flat()["block_size"]
        64
        """
        return {f.name: getattr(getattr(self, part), f.name) for part, c in PARTS.items()
                for f in dataclasses.fields(c)}

    def replace(self, **flat) -> EngineConfig:
        """A copy with flat fields changed, validated again (``strict_guide`` kept unless given).

        >>> EngineConfig.create(tp_size=2).replace(pcp_size=2).parallel.world_size_with_pcp
        4
        """
        return EngineConfig.create(**{**self.flat(), "strict_guide": self.strict_guide, **flat})

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

    def _pcp_notes(self) -> list[str]:
        out = []
        p = self.parallel
        if p.pcp_size > 1 and p.dcp_size > 1 and p.allow_pcp_with_dcp:
            out.append(_note("allow_pcp_with_dcp", f"True with pcp_size={p.pcp_size}, dcp_size={p.dcp_size}",
                             "PCP and DCP cannot both be enabled in one engine",
                             "two engines: a PCP prefill engine and a DCP decode engine (P/D)"))
        if p.pcp_size > 1 and p.enable_dsa_cp:
            out.append(_note("enable_dsa_cp", f"True with pcp_size={p.pcp_size}",
                             "in the DSA backend PCP and DSA-CP cannot both be enabled",
                             "set enable_dsa_cp=False (PCP replaces DSA-CP: at the same world size, run "
                             "tp_size=1, pcp_size=N instead of tp_size=N with DSA-CP)"))
        mode = self.compilation.graph_mode
        if p.pcp_size > 1 and mode not in PCP_GRAPH_MODES:
            out.append(_note("graph_mode", f"{mode!r} with pcp_size={p.pcp_size}",
                             "with PCP the only full-graph mode is FULL_DECODE_ONLY",
                             'use graph_mode="FULL_DECODE_ONLY" or "NONE" (eager)'))
        return out

    def _kv_problems(self) -> list[str]:
        out = []
        p, c, kv = self.parallel, self.cache, self.kv_transfer
        attention = self.model.attention
        if p.enable_dsa_cp and attention != "dsa":
            out.append(problem("enable_dsa_cp", f"True with attention={attention!r}",
                               "DSA-CP is an optimization of DSA (sparse) attention only",
                               'set enable_dsa_cp=False, or attention="dsa" for a DSA model'))
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
        return out

    def _kv_notes(self) -> list[str]:
        p, kv = self.parallel, self.kv_transfer
        if p.pcp_size > 1 and kv.kv_transfer == "pool" and kv.use_layerwise:
            return [_note("use_layerwise", f"True with pcp_size={p.pcp_size}, kv_transfer='pool'",
                          "KV-cache pooling with PCP needs a store connector that is not layerwise",
                          "set use_layerwise=False (use_layerwise=false on the store connector)")]
        return []

    def _spec_problems(self) -> list[str]:
        out = []
        s = self.speculative
        sizes, q_len = self.compilation.capture_sizes, s.query_len
        if sizes is not None and any(x % q_len for x in sizes):
            out.append(problem(
                "capture_sizes", f"{list(sizes)} with num_speculative_tokens={s.num_speculative_tokens}",
                f"capture sizes count query tokens, whole requests of 1 + k = {q_len}: multiples of {q_len}",
                f"use multiples of {q_len}, e.g. {[q_len * m for m in (1, 2, 4, 8)]}"))
        return out

    def _spec_notes(self) -> list[str]:
        out = []
        s, pcp = self.speculative, self.parallel.pcp_size
        method = s.speculative_method
        if pcp == 1 or method is None:
            return out
        allowed = PCP_SPEC_METHODS[self.model.attention]
        problem = _note  # the guide's speculative rules with PCP are compatibility notes
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


def _note(param: str, seen: str, rule: str, fix: str) -> str:
    """A compatibility note: the guide's rule that vLLM-Ascend's engine enforces and cpattn does not need."""
    return problem(param, seen, f"vLLM-Ascend's engine refuses it: {rule}", fix)


def _with_fixes(cls, flat: dict, found: list[str], strict: bool) -> list[str]:
    """``found`` with each integer field's fix replaced by values that pass every rule (:func:`searched_fix`)."""
    defaults = {f.name: f.default for c in PARTS.values() for f in dataclasses.fields(c)}
    flat = {**defaults, **{k: v for k, v in flat.items() if k != "strict_guide"}}

    def param(line: str) -> str:
        return line.split(":", 1)[0]

    others = Counter(param(p) for p in found if param(p) not in FIX_FIELDS)  # problems no integer change fixes

    before = Counter(param(p) for p in found)

    def left(changed: dict) -> Counter:
        return Counter(param(p) for p in _flat_problems(cls, {**flat, **changed}, strict))

    def ok(changed: dict) -> bool:  # every integer rule holds, nothing new is broken
        now = left(changed)
        return all(n not in FIX_FIELDS for n in now) and now <= others

    def progress(changed: dict) -> bool:  # fewer problems, none new
        now = left(changed)
        return now <= before and sum(now.values()) < sum(before.values())

    searchable = [param(p) for p in found if param(p) in FIX_FIELDS]
    also = tuple(dict.fromkeys(f for n in searchable for f in FIX_FIELDS[n][:1]))
    return [p if "allow_pcp_with_dcp" in p.rpartition("; fix: ")[2] else  # its fix names the opt-in: kept
            searched_fix(p, flat, FIX_FIELDS, ok, also=also if len(searchable) == 2 else (), progress=progress)
            for p in found]
