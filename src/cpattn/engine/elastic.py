"""Elastic CP: a request's prefill chunk runs PCP only when PCP pays for that chunk's length.

Static CP prefills every chunk over all P ranks. Below a few thousand tokens
that is slower than one rank: SGLang measured 15-21% worse TTFT. With
``pcp_policy="elastic"`` the step loop compares each prefill chunk with a
threshold. A chunk of at least ``pcp_min_tokens`` new tokens runs PCP over the
group. A shorter chunk prefills data-parallel: each of a step's short chunks
on one rank (balanced by tokens), its cached context gathered onto that rank,
the new KV rows sent to their DCP owners and the last-row logits shared
(:mod:`cpattn.engine.runner_dp`; ``StepRunner.dp_stats`` counts them); the
step's decodes run DCP as before. Runners with their own caches (hybrid
models) and PCP wider than the DCP group run short chunks as DCP attention
with the decodes instead. Decode
keeps the DCP layout whatever degree the prefill ran at, and the tokens are the
same either way.

A chunk that continues cached context counts its attention too (:func:`runs_pcp`): it runs PCP when its
query-key pairs reach a fresh threshold-length chunk's, so a long prompt's last chunk, short after a full
one, stays under PCP with its kept context instead of gathering that context onto one rank.

The threshold is the planner's break-even for attention on this machine
(:func:`cpattn.plan.breakeven.bench_break_even` over the model's head shape
with the ``cpu`` profile, which is the calibrated one once ``cpattn plan
calibrate`` has written it). It is the chunk length from which the predicted
ring time over P ranks is below one rank's.

>>> from cpattn.models import qwen3
>>> n = pcp_min_tokens("qwen3", qwen3.Qwen3Config.tiny(), 2)
>>> n > 0 and n % 64 == 0
True
"""

from __future__ import annotations

from typing import Any

from cpattn.models.family import get_family

POLICIES = ("always", "elastic")
NEVER = 1 << 62  # the planner says PCP never wins: every chunk runs DCP attention


def pcp_min_tokens(model, cfg: Any, pcp_size: int, profile: str = "cpu") -> int:
    """The shortest chunk (new tokens) that runs PCP over ``pcp_size`` ranks under the elastic policy."""
    from cpattn.plan.breakeven import bench_break_even
    from cpattn.plan.profiles import get_profile

    m = get_family(model).model_config(cfg)
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "qk_nope_head_dim", 64) + getattr(cfg, "qk_rope_head_dim", 0)
    n = bench_break_even(get_profile(profile), heads=m.num_attention_heads, kv_heads=m.num_kv_heads,
                         head_dim=head_dim, pcp=pcp_size)
    return NEVER if n is None else n


def runs_pcp(new: int, context: int, min_tokens: int) -> bool:
    """Whether a prefill chunk of ``new`` tokens after ``context`` cached ones runs PCP under the threshold
    ``min_tokens``: it has ``min_tokens`` new tokens, or its attention (``new * (context + new / 2)`` query-key
    pairs) is at least a fresh ``min_tokens``-token chunk's (``min_tokens ** 2 / 2``). So a long prompt's last,
    shorter chunk stays under PCP (its context is long), and a short prompt after a cached prefix does not.

    >>> runs_pcp(1024, 0, 1024), runs_pcp(952, 2048, 1024), runs_pcp(200, 64, 1024), runs_pcp(100, 2000, 1024)
    (True, True, False, False)
    >>> runs_pcp(1, 0, 0), runs_pcp(8191, 1 << 20, NEVER)
    (True, False)
    """
    return new >= min_tokens or new * (2 * context + new) >= min_tokens * min_tokens


def resolve(policy: str, min_tokens: int | str | None, model, cfg: Any, pcp_size: int, measure=None) -> int:
    """The runner's ``pcp_min_tokens`` for a policy: "always" 0 (every chunk PCP), "elastic" the given
    ``min_tokens``, :func:`pcp_min_tokens` for None, or ``measure()`` for "measure" (the engine's own timing,
    :mod:`cpattn.engine.elastic_measure`)."""
    if policy not in POLICIES:
        raise ValueError(f"pcp_policy={policy!r}; pass one of {', '.join(POLICIES)}")
    if min_tokens is not None and min_tokens != "measure" and (
            not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0):
        raise ValueError(f"pcp_min_tokens: saw {min_tokens!r}; expected an int >= 0, 'measure' (timed on the "
                         "engine's ranks) or None (the planner's break-even)")
    if pcp_size < 2:  # no PCP group: every chunk runs DCP attention whatever the policy
        return 0
    if policy == "always":
        if min_tokens not in (None, 0):
            raise ValueError(f"pcp_min_tokens={min_tokens!r} with pcp_policy='always'; pass pcp_policy='elastic'")
        return 0
    if min_tokens == "measure":
        return measure()
    return min_tokens if min_tokens is not None else pcp_min_tokens(model, cfg, pcp_size)
