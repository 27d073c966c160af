"""``ParallelConfig``: the context-parallel settings and every guide rule about attention.

The rules come from the context-parallel guide being reimplemented
(DESIGN.md §8). A config is checked when it is built; each broken rule is
reported with the parameter, the values seen, the rule and a fix, and all
broken rules are reported together in one ``ValueError``.

Example
-------
>>> from cpattn.config import ParallelConfig
>>> cfg = ParallelConfig(tp_size=2, pcp_size=2, attention="mla")
>>> cfg.world_size_with_pcp
4
>>> ParallelConfig(tp_size=4, dcp_size=8, attention="mla")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: invalid ParallelConfig (1 problem):
  - dcp_size: ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_KINDS = ("gqa", "mla", "dsa")
# vLLM's cudagraph_mode names
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
PCP_GRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
KV_TRANSFERS = (None, "pd", "pool")  # P/D disaggregation, KV-cache pooling
KV_ROLES = (None, "kv_producer", "kv_consumer", "kv_both")
# speculative methods the guide supports with PCP, per attention kind
PCP_SPEC_METHODS = {"gqa": ("eagle3",), "mla": ("mtp",), "dsa": ("mtp", "dspark")}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def _problem(param: str, seen: str, rule: str, fix: str) -> str:
    return f"{param}: saw {seen}; rule: {rule}; fix: {fix}"


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one inference engine, validated against the CP guide.

    Fields
    ------
    tp_size: tensor-parallel size. pcp_size: prefill context-parallel size
        (adds ranks: ``world_size_with_pcp = pcp_size * world_size``).
    dcp_size: decode context-parallel size; reuses TP ranks (no extra ranks).
    world_size: the original world size without PCP (default ``tp_size``);
        a multiple of ``tp_size``.
    attention: "gqa", "mla" or "dsa" (DeepSeek sparse attention, MLA-based).
    num_kv_heads: the model's KV heads; required for GQA with ``dcp_size > 1``.
    block_size: KV-cache block size (tokens per block), default 128.
    cp_kv_cache_interleave_size: tokens per DCP owner run (``I``); divides
        ``block_size``; equal to it when KV is transferred.
    kv_transfer: None, "pd" (prefill/decode disaggregation) or "pool"
        (KV-cache pooling). kv_role: "kv_producer" (prefill engine),
        "kv_consumer" (decode engine) or "kv_both"; only with "pd".
    kv_pool_layerwise: the pooling store connector moves KV layer by layer.
    enable_dsa_cp: the separate DSA-CP optimization (DSA models only).
    graph_mode: "NONE" (eager), "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
        "FULL_AND_PIECEWISE".
    speculative_method: None or e.g. "mtp", "eagle3", "dspark";
        num_speculative_tokens: draft tokens per step (>= 1 with a method).
    draft_sampling: how draft tokens are sampled ("greedy", ...).
    draft_attention: the draft model's attention backend (e.g. "sfa") or None.
    adaptive_verification: adaptive speculative verification.
    allow_pcp_with_dcp: opt in to PCP and DCP together (the guide forbids it).

    Example
    -------
    >>> ParallelConfig(tp_size=8, dcp_size=2, attention="gqa", num_kv_heads=4).dcp_size
    2
    """

    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    world_size: int | None = None
    attention: str = "gqa"
    num_kv_heads: int | None = None
    block_size: int = 128
    cp_kv_cache_interleave_size: int = 1
    kv_transfer: str | None = None
    kv_role: str | None = None
    kv_pool_layerwise: bool = False
    enable_dsa_cp: bool = False
    graph_mode: str = "NONE"
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    draft_sampling: str = "greedy"
    draft_attention: str | None = None
    adaptive_verification: bool = False
    allow_pcp_with_dcp: bool = False

    def __post_init__(self) -> None:
        norm = {
            "attention": str.lower, "graph_mode": str.upper, "kv_transfer": str.lower,
            "kv_role": str.lower, "speculative_method": str.lower,
            "draft_sampling": str.lower, "draft_attention": str.lower,
        }
        for name, fn in norm.items():
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, fn(value))
        self.validate()

    @property
    def original_world_size(self) -> int:
        """The world size without PCP: ``world_size``, or ``tp_size`` when it was not given."""
        return self.tp_size if self.world_size is None else self.world_size

    @property
    def world_size_with_pcp(self) -> int:
        """Ranks the engine needs: ``pcp_size * original_world_size`` (PCP adds ranks, DCP does not)."""
        return self.pcp_size * self.original_world_size

    def validate(self) -> None:
        """Raise ``ValueError`` listing every broken rule; return None when all hold."""
        found = self.problems()
        if found:
            noun = "problem" if len(found) == 1 else "problems"
            raise ValueError(f"invalid ParallelConfig ({len(found)} {noun}):\n  - " + "\n  - ".join(found))

    def problems(self) -> list[str]:
        """Every broken rule as ``"param: saw ...; rule: ...; fix: ..."``; empty when valid."""
        basic = self._field_problems()
        if basic:  # the rules below do arithmetic on these fields
            return basic
        return [
            *self._dcp_problems(),
            *self._pcp_problems(),
            *self._kv_problems(),
            *self._spec_problems(),
        ]

    def _field_problems(self) -> list[str]:
        out = []
        for name in ("tp_size", "pcp_size", "dcp_size", "block_size", "cp_kv_cache_interleave_size", "world_size"):
            value = getattr(self, name)
            if name == "world_size" and value is None:
                continue
            if not _is_int(value) or value < 1:
                out.append(_problem(name, repr(value), "a positive int", f"pass an int >= 1 as {name}"))
        if self.num_kv_heads is not None and (not _is_int(self.num_kv_heads) or self.num_kv_heads < 1):
            out.append(_problem("num_kv_heads", repr(self.num_kv_heads), "None or a positive int",
                                "pass the model's number of key/value heads"))
        if not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0:
            out.append(_problem("num_speculative_tokens", repr(self.num_speculative_tokens), "an int >= 0",
                                "pass the number of draft tokens per step (0 without speculation)"))
        choices = {"attention": ATTENTION_KINDS, "graph_mode": GRAPH_MODES,
                   "kv_transfer": KV_TRANSFERS, "kv_role": KV_ROLES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                out.append(_problem(name, repr(getattr(self, name)), f"one of {list(allowed)}",
                                    f"pick {name} from {list(allowed)}"))
        for name in ("speculative_method", "draft_attention"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                out.append(_problem(name, repr(value), "None or a non-empty string", f"pass a name or None as {name}"))
        if not isinstance(self.draft_sampling, str) or not self.draft_sampling:
            out.append(_problem("draft_sampling", repr(self.draft_sampling), "a non-empty string",
                                'pass draft_sampling="greedy"'))
        if not out and self.original_world_size % self.tp_size != 0:
            out.append(_problem("world_size", f"world_size={self.world_size}, tp_size={self.tp_size}",
                                "the original world size is a multiple of tp_size",
                                f"use world_size={self.tp_size} or another multiple of tp_size"))
        return out

    def _dcp_problems(self) -> list[str]:
        tp, dcp = self.tp_size, self.dcp_size
        if dcp == 1:
            return []
        if self.attention in ("mla", "dsa"):
            if tp >= dcp and tp % dcp == 0:
                return []
            return [_problem(
                "dcp_size", f"dcp_size={dcp}, tp_size={tp} ({self.attention})",
                "MLA/DSA models need tp_size >= dcp_size and tp_size % dcp_size == 0 (DCP reuses TP ranks)",
                f"use dcp_size in {_divisors(tp)} or raise tp_size to a multiple of {dcp}",
            )]
        heads = self.num_kv_heads
        if heads is None:
            return [_problem(
                "num_kv_heads", f"None with dcp_size={dcp} (gqa)",
                "GQA with DCP checks (tp_size // num_kv_heads) against dcp_size, so the KV head count is needed",
                "pass num_kv_heads (the model's num_key_value_heads)",
            )]
        per_head = tp // heads  # TP ranks that hold a copy of the same KV head
        if per_head >= dcp and per_head % dcp == 0:
            return []
        return [_problem(
            "dcp_size", f"dcp_size={dcp}, tp_size={tp}, num_kv_heads={heads} (gqa): tp_size // num_kv_heads = {per_head}",
            "GQA models need (tp_size // num_kv_heads) >= dcp_size and (tp_size // num_kv_heads) % dcp_size == 0 "
            "(ranks of one DCP group must hold the same KV heads)",
            f"use dcp_size in {_divisors(per_head) or [1]} or raise tp_size to a multiple of num_kv_heads * dcp_size "
            f"= {heads * dcp}",
        )]

    def _pcp_problems(self) -> list[str]:
        out = []
        pcp = self.pcp_size
        if self.enable_dsa_cp and self.attention != "dsa":
            out.append(_problem(
                "enable_dsa_cp", f"True with attention={self.attention!r}",
                "DSA-CP is an optimization of DSA (sparse) attention only",
                'set enable_dsa_cp=False, or attention="dsa" for a DSA model',
            ))
        if pcp == 1:
            return out
        if self.dcp_size > 1 and not self.allow_pcp_with_dcp:
            out.append(_problem(
                "pcp_size", f"pcp_size={pcp}, dcp_size={self.dcp_size}",
                "PCP and DCP cannot both be enabled (the guide's constraint)",
                "set dcp_size=1 or pcp_size=1, or pass allow_pcp_with_dcp=True to opt in",
            ))
        if self.enable_dsa_cp:
            out.append(_problem(
                "enable_dsa_cp", f"True with pcp_size={pcp}",
                "in the DSA backend PCP and DSA-CP cannot both be enabled",
                "set enable_dsa_cp=False (PCP replaces DSA-CP: at the same world size, run "
                "tp_size=1, pcp_size=N instead of tp_size=N with DSA-CP)",
            ))
        if self.graph_mode not in PCP_GRAPH_MODES:
            out.append(_problem(
                "graph_mode", f"{self.graph_mode!r} with pcp_size={pcp}",
                "with PCP the only full-graph mode is FULL_DECODE_ONLY",
                'use graph_mode="FULL_DECODE_ONLY" or "NONE" (eager)',
            ))
        return out

    def _kv_problems(self) -> list[str]:
        out = []
        block, inter = self.block_size, self.cp_kv_cache_interleave_size
        if block % inter != 0:
            out.append(_problem(
                "cp_kv_cache_interleave_size", f"cp_kv_cache_interleave_size={inter}, block_size={block}",
                "block_size % cp_kv_cache_interleave_size == 0",
                f"use cp_kv_cache_interleave_size in {_divisors(block)}",
            ))
        cp_on = self.pcp_size > 1 or self.dcp_size > 1
        if self.kv_transfer is not None and cp_on and inter != block:
            out.append(_problem(
                "cp_kv_cache_interleave_size",
                f"cp_kv_cache_interleave_size={inter}, block_size={block}, kv_transfer={self.kv_transfer!r}",
                "with KV transfer (P/D or pooling) and context parallel, interleave size == block_size, "
                "so whole blocks move between engines",
                f"set cp_kv_cache_interleave_size={block}",
            ))
        if self.kv_role is not None and self.kv_transfer != "pd":
            out.append(_problem(
                "kv_role", f"{self.kv_role!r} with kv_transfer={self.kv_transfer!r}",
                'kv_role describes an engine of a P/D pair (kv_transfer="pd")',
                'set kv_transfer="pd" or kv_role=None',
            ))
        if self.kv_transfer == "pd" and self.kv_role is None:
            out.append(_problem(
                "kv_role", 'None with kv_transfer="pd"',
                "each engine of a P/D pair has a role",
                'pass kv_role="kv_producer" (prefill engine) or "kv_consumer" (decode engine)',
            ))
        if self.pcp_size > 1 and self.kv_transfer == "pd" and self.kv_role not in (None, "kv_producer"):
            what = "the decode (kv_consumer) engine" if self.kv_role == "kv_consumer" else f"a {self.kv_role} engine"
            out.append(_problem(
                "pcp_size", f"pcp_size={self.pcp_size} on {what}",
                "in P/D disaggregation only the prefill (kv_producer) engine uses PCP; the decode engine has pcp_size=1",
                "set pcp_size=1 on this engine (use dcp_size to shard its KV cache)",
            ))
        if self.pcp_size > 1 and self.kv_transfer == "pool" and self.kv_pool_layerwise:
            out.append(_problem(
                "kv_pool_layerwise", f"True with pcp_size={self.pcp_size}, kv_transfer='pool'",
                "KV-cache pooling with PCP needs a store connector that is not layerwise",
                "set kv_pool_layerwise=False (use_layerwise=false on the store connector)",
            ))
        return out

    def _spec_problems(self) -> list[str]:
        out = []
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is None and k > 0:
            out.append(_problem(
                "num_speculative_tokens", f"{k} with speculative_method=None",
                "draft tokens need a speculative method",
                "set speculative_method or num_speculative_tokens=0",
            ))
        if method is not None and k == 0:
            out.append(_problem(
                "num_speculative_tokens", f"0 with speculative_method={method!r}",
                "speculative decoding drafts at least one token per step",
                "set num_speculative_tokens >= 1 (e.g. 3) or speculative_method=None",
            ))
        if self.pcp_size == 1 or method is None:
            return out
        allowed = PCP_SPEC_METHODS[self.attention]
        if method not in allowed:
            out.append(_problem(
                "speculative_method", f"{method!r} with pcp_size={self.pcp_size}, attention={self.attention!r}",
                "PCP speculative decoding supports MTP for MLA and DSA models, Eagle3 for GQA models, "
                "DSpark for DeepSeek-V4 DSA models",
                f"use speculative_method in {list(allowed)}, or pcp_size=1",
            ))
        if self.draft_sampling != "greedy":
            out.append(_problem(
                "draft_sampling", f"{self.draft_sampling!r} with pcp_size={self.pcp_size}",
                "with PCP draft sampling must be greedy",
                'set draft_sampling="greedy"',
            ))
        if self.draft_attention == "sfa":
            out.append(_problem(
                "draft_attention", f"'sfa' with pcp_size={self.pcp_size}",
                "PCP speculative decoding does not support SFA draft attention",
                "use a dense draft attention backend (draft_attention=None)",
            ))
        if self.adaptive_verification:
            out.append(_problem(
                "adaptive_verification", f"True with pcp_size={self.pcp_size}",
                "PCP speculative decoding does not support adaptive verification",
                "set adaptive_verification=False",
            ))
        return out

    def replace(self, **changes) -> ParallelConfig:
        """A copy with ``changes`` applied, validated again.

        >>> ParallelConfig(tp_size=2).replace(pcp_size=2).world_size_with_pcp
        4
        """
        return dataclasses.replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
