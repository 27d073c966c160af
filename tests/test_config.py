"""EngineConfig and its parts: every attention rule of the CP guide, valid and invalid, table-driven.

Each invalid row names the parameter the error must blame and a phrase of the
rule; every error must also carry the values seen and a fix. A ``("note", ...)``
row is a layout cpattn runs exactly but vLLM-Ascend's engine refuses: the
config builds with a compatibility note (a GuideCompatWarning), and
``strict_guide=True`` refuses it (docs/compat.md).
"""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest

from cpattn.config import (
    CacheConfig, CompilationConfig, ConfigError, EngineConfig, GuideCompatWarning, KVTransferConfig, ModelConfig,
    ParallelConfig, SpeculativeConfig,
)

PD = dict(kv_transfer="pd")

# (id, kwargs, None for valid | (param blamed, phrase of the message))
CASES = [
    # defaults and sizes
    ("defaults", {}, None),
    ("tp0", dict(tp_size=0), ("tp_size", "positive int")),
    ("pcp_negative", dict(pcp_size=-2), ("pcp_size", "positive int")),
    ("dcp_bool", dict(dcp_size=True), ("dcp_size", "positive int")),
    ("block_float", dict(block_size=128.0), ("block_size", "positive int")),
    ("kv_heads_zero", dict(num_kv_heads=0), ("num_kv_heads", "positive int")),
    ("spec_tokens_negative", dict(num_speculative_tokens=-1), ("num_speculative_tokens", ">= 0")),
    ("attention_unknown", dict(attention="mha"), ("attention", "one of")),
    ("graph_unknown", dict(graph_mode="EAGER"), ("graph_mode", "one of")),
    ("kv_transfer_unknown", dict(kv_transfer="rdma"), ("kv_transfer", "one of")),
    ("kv_role_unknown", dict(kv_role="prefill", **PD), ("kv_role", "one of")),
    ("draft_sampling_empty", dict(draft_sampling=""), ("draft_sampling", "non-empty")),
    ("world_not_multiple", dict(tp_size=4, world_size=6), ("world_size", "multiple of tp_size")),
    ("world_multiple", dict(tp_size=4, world_size=8), None),
    ("case_insensitive", dict(attention="MLA", graph_mode="full_decode_only", pcp_size=2), None),
    # DCP with MLA / DSA: tp >= dcp and tp % dcp == 0
    ("mla_dcp_eq_tp", dict(attention="mla", tp_size=8, dcp_size=8), None),
    ("mla_dcp_divides", dict(attention="mla", tp_size=8, dcp_size=2), None),
    ("mla_dcp_gt_tp", dict(attention="mla", tp_size=4, dcp_size=8), ("dcp_size", "tp_size >= dcp_size")),
    ("mla_dcp_not_divisor", dict(attention="mla", tp_size=6, dcp_size=4), ("dcp_size", "tp_size % dcp_size == 0")),
    ("dsa_dcp_ok", dict(attention="dsa", tp_size=16, dcp_size=4), None),
    ("dsa_dcp_not_divisor", dict(attention="dsa", tp_size=8, dcp_size=3), ("dcp_size", "MLA/DSA")),
    ("mla_ignores_kv_heads", dict(attention="mla", tp_size=8, dcp_size=8, num_kv_heads=128), None),
    # DCP with GQA: (tp // kv_heads) >= dcp and (tp // kv_heads) % dcp == 0
    ("gqa_dcp_ok", dict(tp_size=8, dcp_size=2, num_kv_heads=4), None),
    ("gqa_dcp_max", dict(tp_size=16, dcp_size=4, num_kv_heads=4), None),
    ("gqa_dcp_too_big", dict(tp_size=8, dcp_size=4, num_kv_heads=4), ("dcp_size", "(tp_size // num_kv_heads) >= dcp_size")),
    ("gqa_dcp_not_divisor", dict(tp_size=12, dcp_size=2, num_kv_heads=4), ("dcp_size", "% dcp_size == 0")),
    ("gqa_tp_below_heads", dict(tp_size=4, dcp_size=2, num_kv_heads=8), ("dcp_size", "tp_size // num_kv_heads = 0")),
    ("gqa_dcp_needs_heads", dict(tp_size=8, dcp_size=2), ("num_kv_heads", "KV head count")),
    ("gqa_no_dcp_no_heads", dict(tp_size=8), None),
    # PCP and DCP not both on, unless opted in
    ("pcp_and_dcp", dict(attention="mla", tp_size=2, pcp_size=2, dcp_size=2), ("pcp_size", "cannot both be enabled")),
    ("pcp_and_dcp_opt_in", dict(attention="mla", tp_size=2, pcp_size=2, dcp_size=2, allow_pcp_with_dcp=True), ("note", "allow_pcp_with_dcp", "cannot both be enabled")),
    ("pcp_alone", dict(tp_size=2, pcp_size=4), None),
    # DSA-CP
    ("dsa_cp", dict(attention="dsa", tp_size=8, enable_dsa_cp=True), None),
    ("dsa_cp_with_pcp", dict(attention="dsa", tp_size=8, pcp_size=2, enable_dsa_cp=True), ("note", "enable_dsa_cp", "PCP and DSA-CP")),
    ("dsa_cp_on_gqa", dict(attention="gqa", enable_dsa_cp=True), ("enable_dsa_cp", "DSA (sparse) attention only")),
    ("dsa_pcp_without_dsa_cp", dict(attention="dsa", tp_size=1, pcp_size=8), None),
    # interleave size
    ("interleave_divides", dict(block_size=128, cp_kv_cache_interleave_size=16, tp_size=2, dcp_size=2, attention="mla"), None),
    ("interleave_not_divisor", dict(block_size=128, cp_kv_cache_interleave_size=48), ("cp_kv_cache_interleave_size", "block_size % cp_kv_cache_interleave_size == 0")),
    ("interleave_gt_block", dict(block_size=64, cp_kv_cache_interleave_size=128), ("cp_kv_cache_interleave_size", "% cp_kv_cache_interleave_size")),
    ("transfer_interleave_eq_block", dict(attention="mla", tp_size=2, dcp_size=2, cp_kv_cache_interleave_size=128, kv_transfer="pool"), None),
    ("transfer_interleave_ne_block", dict(attention="mla", tp_size=2, dcp_size=2, kv_transfer="pool"), ("cp_kv_cache_interleave_size", "KV transfer")),
    ("transfer_pd_dcp_interleave", dict(attention="mla", tp_size=2, dcp_size=2, block_size=64, cp_kv_cache_interleave_size=32, kv_role="kv_consumer", **PD), ("cp_kv_cache_interleave_size", "set cp_kv_cache_interleave_size=64")),
    ("transfer_pcp_interleave", dict(pcp_size=2, kv_role="kv_producer", **PD), ("cp_kv_cache_interleave_size", "== block_size")),
    ("transfer_without_cp", dict(kv_role="kv_consumer", **PD), None),
    # P/D roles
    ("pd_producer_pcp", dict(pcp_size=2, kv_role="kv_producer", cp_kv_cache_interleave_size=128, **PD), None),
    ("pd_consumer_pcp", dict(pcp_size=2, kv_role="kv_consumer", cp_kv_cache_interleave_size=128, **PD), ("pcp_size", "decode (kv_consumer) engine")),
    ("pd_both_pcp", dict(pcp_size=2, kv_role="kv_both", cp_kv_cache_interleave_size=128, **PD), ("pcp_size", "only the prefill (kv_producer)")),
    ("pd_consumer_dcp", dict(attention="mla", tp_size=4, dcp_size=4, kv_role="kv_consumer", cp_kv_cache_interleave_size=128, **PD), None),
    ("pd_needs_role", dict(kv_transfer="pd"), ("kv_role", "has a role")),
    ("role_without_pd", dict(kv_role="kv_producer"), ("kv_role", 'kv_transfer="pd"')),
    ("role_with_pool", dict(kv_role="kv_producer", kv_transfer="pool"), ("kv_role", 'kv_transfer="pd"')),
    # KV pooling with PCP: non-layerwise connector only
    ("pool_pcp", dict(pcp_size=2, kv_transfer="pool", cp_kv_cache_interleave_size=128), None),
    ("pool_pcp_layerwise", dict(pcp_size=2, kv_transfer="pool", use_layerwise=True, cp_kv_cache_interleave_size=128), ("note", "use_layerwise", "not layerwise")),
    ("pool_layerwise_no_pcp", dict(kv_transfer="pool", use_layerwise=True), None),
    # graph mode with PCP
    ("pcp_eager", dict(pcp_size=2, graph_mode="NONE"), None),
    ("pcp_full_decode_only", dict(pcp_size=2, graph_mode="FULL_DECODE_ONLY"), None),
    ("pcp_piecewise", dict(pcp_size=2, graph_mode="PIECEWISE"), ("note", "graph_mode", "FULL_DECODE_ONLY")),
    ("pcp_full", dict(pcp_size=2, graph_mode="FULL"), ("note", "graph_mode", "FULL_DECODE_ONLY")),
    ("pcp_full_and_piecewise", dict(pcp_size=2, graph_mode="FULL_AND_PIECEWISE"), ("note", "graph_mode", "FULL_DECODE_ONLY")),
    ("no_pcp_piecewise", dict(graph_mode="PIECEWISE"), None),
    # speculative decoding with PCP
    ("spec_tokens_without_method", dict(num_speculative_tokens=3), ("num_speculative_tokens", "need a speculative method")),
    ("spec_method_without_tokens", dict(speculative_method="mtp", attention="mla"), ("num_speculative_tokens", "at least one")),
    ("pcp_mla_mtp", dict(attention="mla", pcp_size=2, speculative_method="mtp", num_speculative_tokens=3), None),
    ("pcp_dsa_mtp", dict(attention="dsa", pcp_size=2, speculative_method="mtp", num_speculative_tokens=1), None),
    ("pcp_dsa_dspark", dict(attention="dsa", pcp_size=2, speculative_method="dspark", num_speculative_tokens=2), None),
    ("pcp_gqa_eagle3", dict(attention="gqa", pcp_size=2, speculative_method="eagle3", num_speculative_tokens=3), None),
    ("pcp_gqa_mtp", dict(attention="gqa", pcp_size=2, speculative_method="mtp", num_speculative_tokens=3), ("note", "speculative_method", "Eagle3 for GQA")),
    ("pcp_mla_eagle3", dict(attention="mla", pcp_size=2, speculative_method="eagle3", num_speculative_tokens=3), ("note", "speculative_method", "MTP for MLA")),
    ("pcp_mla_ngram", dict(attention="mla", pcp_size=2, speculative_method="ngram", num_speculative_tokens=3), ("note", "speculative_method", "['mtp']")),
    ("no_pcp_any_method", dict(attention="mla", speculative_method="ngram", num_speculative_tokens=3, draft_sampling="random"), None),
    ("pcp_draft_random", dict(attention="mla", pcp_size=2, speculative_method="mtp", num_speculative_tokens=3, draft_sampling="random"), ("note", "draft_sampling", "must be greedy")),
    ("pcp_draft_sfa", dict(attention="dsa", pcp_size=2, speculative_method="mtp", num_speculative_tokens=1, draft_attention="sfa"), ("note", "draft_attention", "SFA draft attention")),
    ("no_pcp_draft_sfa", dict(attention="dsa", speculative_method="mtp", num_speculative_tokens=1, draft_attention="sfa"), None),
    ("pcp_adaptive", dict(attention="mla", pcp_size=2, speculative_method="mtp", num_speculative_tokens=3, adaptive_verification=True), ("note", "adaptive_verification", "adaptive verification")),
    ("no_pcp_adaptive", dict(attention="mla", speculative_method="mtp", num_speculative_tokens=3, adaptive_verification=True), None),
    # the guide's own example commands
    ("guide_mla_mtp", dict(attention="mla", tp_size=2, pcp_size=2, speculative_method="mtp", num_speculative_tokens=3, graph_mode="FULL_DECODE_ONLY"), None),
    ("guide_dcp_glm", dict(attention="dsa", tp_size=8, pcp_size=1, dcp_size=8, block_size=128, cp_kv_cache_interleave_size=128), None),
    ("guide_dcp_pd", dict(attention="mla", tp_size=2, dcp_size=2, cp_kv_cache_interleave_size=128, kv_role="kv_consumer", **PD), None),
]


@pytest.mark.parametrize("kwargs, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rules(kwargs, expected):
    if expected is None:
        cfg = EngineConfig.create(**kwargs)
        assert cfg.problems() == [] and cfg.compat_notes() == []
        return
    strict = {}
    if expected[0] == "note":  # runs, with the note; strict_guide=True refuses it
        _, param, phrase = expected
        with pytest.warns(GuideCompatWarning, match=param):
            cfg = EngineConfig.create(**kwargs)
        assert cfg.problems() == []
        assert any(n.startswith(f"{param}: ") and phrase in n for n in cfg.compat_notes()), cfg.compat_notes()
        strict = {"strict_guide": True}
    else:
        param, phrase = expected
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(**kwargs, **strict)
    msg = str(info.value)
    lines = [line for line in msg.splitlines() if line.startswith(f"  - {param}: ")]
    assert lines, f"no problem blames {param!r} in:\n{msg}"
    assert any(phrase in line for line in lines), f"{phrase!r} not in:\n{msg}"
    for line in msg.splitlines()[1:]:  # every problem: param, values seen, rule, fix
        assert re.match(r"  - \w+: saw .+; rule: .+; fix: .+", line), line


def test_every_problem_reported_at_once():
    bad = dict(attention="mla", tp_size=2, pcp_size=2, dcp_size=2, graph_mode="FULL", speculative_method="eagle3",
               num_speculative_tokens=1, draft_sampling="random")
    with pytest.raises(ValueError) as info:
        EngineConfig.create(**bad, strict_guide=True)
    msg = str(info.value)
    assert msg.startswith("invalid EngineConfig (4 problems):")
    for param in ("pcp_size", "graph_mode", "speculative_method", "draft_sampling"):
        assert f"  - {param}: " in msg
    with pytest.raises(ValueError) as info:  # without strict_guide only the refusal: PCP + DCP not opted in
        EngineConfig.create(**bad)
    assert str(info.value).startswith("invalid EngineConfig (1 problem):\n  - pcp_size: ")


def test_fix_is_actionable():
    # the suggested values pass every rule (the next rule too)
    with pytest.raises(ValueError, match=r"use dcp_size in \[2, 1\]"):
        EngineConfig.create(tp_size=8, dcp_size=4, num_kv_heads=4)
    for dcp in (1, 2):
        EngineConfig.create(tp_size=8, dcp_size=dcp, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"use dcp_size in \[3, 2, 6\]"):
        EngineConfig.create(tp_size=6, dcp_size=4, attention="mla")
    # an interleave that breaks two rules: the offer passes both (a divisor of the block was refused next)
    with pytest.raises(ValueError) as info:
        EngineConfig.create(tp_size=2, dcp_size=2, attention="mla", block_size=16, cp_kv_cache_interleave_size=3,
                            kv_transfer="pool")
    assert str(info.value).count("fix: set cp_kv_cache_interleave_size=16") == 2, str(info.value)


def _offers(line: str) -> list[dict]:
    """Every change a problem's fix offers, as {field: value, ...}: alternatives split on `` or ``; ``use f in
    [a, b]`` offers each value, ``set f=a and g=b`` both changes at once."""
    out = []
    for alt in line.rpartition("; fix: ")[2].split(" or "):
        out += [{f: int(v)} for f, vals in re.findall(r"(\w+) in \[([\d, ]+)\]", alt) for v in vals.split(", ")]
        pairs = {f: int(v) for f, v in re.findall(r"(\w+)=(\d+)\b", alt)}
        if pairs:
            out.append(pairs)
    return out


# bad layouts: each row breaks one to three integer rules (heads vs TP, DCP vs TP / KV heads, interleave vs block,
# interleave vs KV transfer); the grid is sampled (every 5th combination) to stay fast
GRID = [dict(attention=a, tp_size=tp, dcp_size=dcp, pcp_size=pcp, num_kv_heads=kv, num_attention_heads=heads,
             block_size=block, cp_kv_cache_interleave_size=inter, kv_transfer=kvt, allow_pcp_with_dcp=True)
        for a in ("gqa", "mla") for tp in (1, 3, 4, 8) for dcp in (1, 2, 3, 8) for pcp in (1, 3)
        for kv, heads in ((4, 8), (2, 6)) for block, inter in ((16, 16), (16, 3), (16, 32), (12, 8))
        for kvt in (None, "pool")][::29]


def _broken(layout: dict) -> collections.Counter:
    try:
        EngineConfig.create(**layout)
        return collections.Counter()
    except ConfigError as e:
        return collections.Counter(p.split(":")[0] for p in e.problems)


@pytest.mark.slow
def test_every_offered_fix_passes_every_rule():
    """Applying an offered fix never breaks a rule the layout kept: with one or two broken rules it leaves
    none (the next rule is checked too); with more, fewer and no new one (each problem's fix does its part)."""
    seen = 0
    for layout in GRID:
        before = _broken(layout)
        if not before:
            continue
        with pytest.raises(ConfigError) as info:
            EngineConfig.create(**layout)
        for line in info.value.problems:
            offers = _offers(line)
            assert offers or "no value of" in line, line  # an integer fix, or says none passes alone
            for change in offers:
                seen += 1
                after = _broken({**layout, **change})
                if sum(before.values()) == 1:
                    assert not after, (layout, line, change, after)
                assert not after or (after <= before and sum(after.values()) < sum(before.values())), \
                    (layout, line, change, after)
    assert seen > 30  # the grid exercised many offers


@pytest.mark.parametrize("tp, pcp, world, expected", [(1, 1, None, 1), (2, 2, None, 4), (4, 2, 8, 16), (8, 1, 16, 16)])
def test_world_size_with_pcp(tp, pcp, world, expected):
    cfg = ParallelConfig(tp_size=tp, pcp_size=pcp, world_size=world)
    assert cfg.world_size_with_pcp == expected == pcp * cfg.original_world_size


def test_dcp_adds_no_ranks():
    cfg = EngineConfig.create(tp_size=8, dcp_size=8, attention="mla")
    assert cfg.parallel.world_size_with_pcp == 8


def test_frozen_and_replace_revalidates():
    cfg = EngineConfig.create(tp_size=2, attention="mla")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.tp_size = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel = ParallelConfig()  # type: ignore[misc]
    assert cfg.replace(tp_size=4, dcp_size=4).parallel.world_size_with_pcp == 4  # world_size follows tp_size
    with pytest.raises(ValueError, match="dcp_size"):
        cfg.replace(dcp_size=4)
    assert cfg.parallel.replace(pcp_size=2).world_size_with_pcp == 4


def test_normalised_names():
    cfg = EngineConfig.create(attention="GQA", graph_mode="full_decode_only", kv_transfer="PD", kv_role="KV_Producer")
    assert (cfg.model.attention, cfg.compilation.graph_mode, cfg.kv_transfer.kv_transfer, cfg.kv_transfer.kv_role) == (
        "gqa", "FULL_DECODE_ONLY", "pd", "kv_producer")


# rules added with the split configs: heads vs TP, replicated KV heads, capture sizes, dynamic draft length
MORE = [
    ("heads_not_divisible", dict(tp_size=4, num_attention_heads=6), ("tp_size", "num_attention_heads % tp_size")),
    ("heads_divisible", dict(tp_size=2, num_attention_heads=6), None),
    ("gqa_replicated_kv_heads", dict(tp_size=2, dcp_size=2, num_kv_heads=4, tp_splits_kv_heads=False), None),
    ("gqa_replicated_dcp_gt_tp", dict(tp_size=2, dcp_size=4, num_kv_heads=4, tp_splits_kv_heads=False),
     ("dcp_size", "tp_size >= dcp_size")),
    ("capture_sizes_spec", dict(speculative_method="ngram", num_speculative_tokens=1, capture_sizes=[2, 4]), None),
    ("capture_sizes_not_multiple", dict(speculative_method="ngram", num_speculative_tokens=2, capture_sizes=[3, 4]),
     ("capture_sizes", "multiples of 3")),
    ("capture_sizes_empty", dict(capture_sizes=[]), ("capture_sizes", "non-empty")),
    ("pcp_dynamic_draft", dict(attention="dsa", pcp_size=2, speculative_method="dspark", num_speculative_tokens=2,
                               dynamic_draft_length=True), ("note", "dynamic_draft_length", "not validated")),
    ("dynamic_draft_no_pcp", dict(attention="dsa", speculative_method="dspark", num_speculative_tokens=2,
                                  dynamic_draft_length=True), None),
]


@pytest.mark.parametrize("kwargs, expected", [c[1:] for c in MORE], ids=[c[0] for c in MORE])
def test_more_rules(kwargs, expected):
    test_rules(kwargs, expected)


@pytest.mark.parametrize("cls, kwargs, param", [
    (ParallelConfig, dict(dcp_size=0), "dcp_size"),
    (CacheConfig, dict(block_size=64, cp_kv_cache_interleave_size=48), "cp_kv_cache_interleave_size"),
    (KVTransferConfig, dict(kv_transfer="pd"), "kv_role"),
    (SpeculativeConfig, dict(num_speculative_tokens=2), "num_speculative_tokens"),
    (CompilationConfig, dict(graph_mode="eager"), "graph_mode"),
    (ModelConfig, dict(attention="mha"), "attention"),
])
def test_each_part_checks_itself(cls, kwargs, param):
    with pytest.raises(ConfigError, match=rf"invalid {cls.__name__} \(1 problem\):\n  - {param}: saw "):
        cls(**kwargs)


def test_create_names_unknown_fields():
    with pytest.raises(TypeError, match=r"unknown fields \['pcp'\]"):
        EngineConfig.create(pcp=2)


def test_parts_compose():
    cfg = EngineConfig(model=ModelConfig(attention="mla"), parallel=ParallelConfig(tp_size=2, dcp_size=2),
                       cache=CacheConfig(block_size=64, cp_kv_cache_interleave_size=64),
                       kv_transfer=KVTransferConfig(kv_transfer="pd", kv_role="kv_consumer"))
    assert cfg == EngineConfig.create(attention="mla", tp_size=2, dcp_size=2, block_size=64,
                                      cp_kv_cache_interleave_size=64, kv_transfer="pd", kv_role="kv_consumer")
    with pytest.raises(ConfigError, match="cp_kv_cache_interleave_size"):  # the cross rule, checked on assembly
        EngineConfig(model=ModelConfig(attention="mla"), parallel=ParallelConfig(tp_size=2, dcp_size=2),
                     kv_transfer=KVTransferConfig(kv_transfer="pool"))
