"""Which layouts the engine accepts: every layout the planner prices goes through ``EngineConfig.create``.

The planner does not restate the guide's rules: :func:`layout_problems`
builds the engine's own config (:meth:`cpattn.config.EngineConfig.create`)
for a model and a :class:`~cpattn.plan.model.Layout` and returns the
problems it raises, each ``"param: saw ...; rule: ...; fix: ..."`` with its
fix searched through the whole check. :func:`~cpattn.plan.model.predict`
refuses a layout with problems (a :class:`~cpattn.config.ConfigError`, a
``ValueError``), and :func:`layout_space` splits the candidates of a device
count into the accepted and the refused, so ``cpattn plan`` can print the
refused ones with their rule and fix instead of pricing them.

Candidates for ``devices``: every ``tp * pcp == devices``; with ``pcp == 1``
``dcp`` any divisor of ``devices`` (so ``dcp > tp`` and the GQA head rule
are shown refused, not silently skipped); with ``pcp > 1`` only ``dcp == 1``
(the guide refuses PCP with DCP in one engine) unless the engine's opt-in
``allow_pcp_with_dcp`` is given, then every ``dcp`` too.

Example
-------
>>> from cpattn.plan.model import Layout
>>> from cpattn.plan.specs import get_model
>>> layout_problems(get_model("deepseek-r1"), Layout(tp=8, dcp=3))  # doctest: +ELLIPSIS
['dcp_size: saw dcp_size=3, tp_size=8 (mla); rule: MLA/DSA/V4 models need tp_size >= dcp_size ...; fix: ...']
>>> layout_problems(get_model("qwen3-235b-a22b"), Layout(tp=8, dcp=2))
[]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from cpattn.config import ConfigError, EngineConfig
from cpattn.config.problems import divisors


@dataclass(frozen=True)
class Refusal:
    """A layout the engine refuses: ``problems`` are the config's lines (rule and fix in each)."""

    layout: object
    problems: tuple[str, ...]

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return {"layout": asdict(self.layout), "name": str(self.layout), "problems": list(self.problems),
                "rules": [rule_of(p) for p in self.problems], "fixes": [fix_of(p) for p in self.problems]}


def engine_fields(spec, lay, allow_pcp_with_dcp: bool = False) -> dict:
    """The flat ``EngineConfig.create`` fields of ``spec`` run with layout ``lay`` (vLLM's TP layout of KV
    heads: each TP rank holds a slice of them, the guide's GQA rule)."""
    gqa = spec.attention == "gqa"
    return dict(tp_size=lay.tp, pcp_size=lay.pcp, dcp_size=lay.dcp, attention=spec.attention,
                num_attention_heads=spec.heads, num_kv_heads=spec.kv_heads if gqa else None,
                allow_pcp_with_dcp=allow_pcp_with_dcp)


def layout_problems(spec, lay, allow_pcp_with_dcp: bool = False, **fields) -> list[str]:
    """The problems ``EngineConfig.create`` reports for ``spec`` with layout ``lay`` (and any other engine
    ``fields``, e.g. ``kv_transfer="pd", kv_role="kv_consumer"``); empty when accepted."""
    try:
        with warnings.catch_warnings():  # an opted-in PCP + DCP engine's compatibility note is not a refusal
            warnings.simplefilter("ignore")
            EngineConfig.create(**engine_fields(spec, lay, allow_pcp_with_dcp), **fields)
    except ConfigError as e:
        return list(e.problems)
    return []


def check_layout(spec, lay, allow_pcp_with_dcp: bool = False) -> None:
    """Raise the engine's :class:`~cpattn.config.ConfigError` (a ``ValueError``) when it refuses ``lay``."""
    found = layout_problems(spec, lay, allow_pcp_with_dcp)
    if found:
        raise ConfigError(f"layout {lay} for {spec.name}", found)


def rule_of(line: str) -> str:
    """The ``rule:`` part of a problem line."""
    return line.partition("; rule: ")[2].rpartition("; fix: ")[0] or line


def fix_of(line: str) -> str:
    """The ``fix:`` part of a problem line."""
    return line.rpartition("; fix: ")[2]


def candidates(devices: int, allow_pcp_with_dcp: bool = False, dp_attention: bool = False) -> list:
    """Every ``Layout(tp, devices // tp, dcp)`` with ``tp`` and ``dcp`` divisors of ``devices`` (``dcp == 1``
    only when ``pcp > 1``, unless ``allow_pcp_with_dcp``); with ``dp_attention`` also every ``dp > 1`` dividing
    ``devices``, each replica of ``devices // dp`` devices laid out the same way (DP attention, one expert group).

    >>> [str(x) for x in candidates(2)]
    ['tp=1 pcp=2 dcp=1', 'tp=2 pcp=1 dcp=1', 'tp=2 pcp=1 dcp=2']
    >>> [str(x) for x in candidates(2, dp_attention=True)][3:]
    ['tp=1 pcp=1 dcp=1 dp=2']
    """
    from cpattn.plan.model import Layout

    out = []
    for dp in divisors(devices) if dp_attention else [1]:
        per = devices // dp
        out += [Layout(tp, per // tp, dcp, dp) for tp in divisors(per) for dcp in divisors(per)
                if dcp == 1 or tp == per or allow_pcp_with_dcp]
    return out


def layout_space(spec, devices: int, allow_pcp_with_dcp: bool = False,
                 dp_attention: bool = False) -> tuple[list, list[Refusal]]:
    """(accepted layouts, refusals) among :func:`candidates` of ``devices`` for ``spec`` (the engine's check
    applies to each replica: ``EngineConfig`` has no DP size).

    >>> from cpattn.plan.specs import get_model
    >>> ok, refused = layout_space(get_model("qwen3-235b-a22b"), 8)
    >>> [str(x) for x in ok]
    ['tp=1 pcp=8 dcp=1', 'tp=2 pcp=4 dcp=1', 'tp=4 pcp=2 dcp=1', 'tp=8 pcp=1 dcp=1', 'tp=8 pcp=1 dcp=2']
    >>> any(str(r.layout) == "tp=8 pcp=1 dcp=4" for r in refused)
    True
    """
    ok, refused = [], []
    for lay in candidates(devices, allow_pcp_with_dcp, dp_attention):
        found = layout_problems(spec, lay, allow_pcp_with_dcp)
        (refused.append(Refusal(lay, tuple(found))) if found else ok.append(lay))
    return ok, refused
