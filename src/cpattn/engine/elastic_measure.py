"""Elastic CP's threshold measured on the engine's own ranks: ``pcp_min_tokens="measure"``.

The planner's break-even (:func:`cpattn.engine.elastic.pcp_min_tokens`) predicts where ring attention over
P ranks beats one rank, from a profile. A whole model step pays more per PCP chunk than its attention:
every layer's exchange, and a fixed cost per collective, which an uncalibrated profile does not know. On
this project's 2-core machine (tiny Qwen3, 2 gloo ranks) the planner put the break-even at 192 tokens, and
a lone 256-token chunk took about 1.8x its one-rank time under PCP: below ~512 tokens PCP lost.

With ``pcp_min_tokens="measure"`` the engine times both ways, on its own world, one lone chunk of L new
tokens: PCP over the group, and the path a shorter chunk takes under the elastic policy (data-parallel:
one rank computes it, :mod:`cpattn.engine.runner_dp`). L runs over 64, 128, 256, ... up to the step
budget; each length gets one warm-up and ``reps`` interleaved rounds of both. Every sample is the slowest
rank's (one all-gather at the end), so every rank reads the same numbers and picks the same threshold
(:func:`threshold`): the shortest L from which PCP's median is below the other path's at every longer L
measured, or :data:`~cpattn.engine.elastic.NEVER`. The timing runs in a scratch engine on the same world
(its own few blocks, no prefix caching, closed afterwards), so the served engine's counters and caches
start empty. The tokens do not depend on the threshold (both paths are exact); only the speed does.

>>> threshold([64, 128, 256, 512], pcp=[3.0, 4.0, 5.0, 6.0], other=[2.0, 3.0, 6.0, 9.0])
256
>>> threshold([64, 128], pcp=[3.0, 1.0], other=[2.0, 2.0]), threshold([64], pcp=[1.0], other=[2.0])
(128, 64)
>>> threshold([64, 128], pcp=[3.0, 3.0], other=[2.0, 2.0]) == NEVER
True
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import GuideCompatWarning, SchedulerConfig
from cpattn.engine.elastic import NEVER

SHORTEST = 64  # the first length timed
LONGEST = 8192  # the last, whatever the budget: past it PCP's lead only grows (attention is quadratic)


def lengths(budget: int) -> list[int]:
    """The chunk lengths timed: 64, 128, ... up to ``min(budget, 8192)`` (at least 64).

    >>> lengths(2048), lengths(100)
    ([64, 128, 256, 512, 1024, 2048], [64])
    """
    out, n = [], SHORTEST
    while n <= max(SHORTEST, min(budget, LONGEST)):
        out.append(n)
        n *= 2
    return out


def threshold(lens: list[int], *, pcp: list[float], other: list[float]) -> int:
    """The shortest of ``lens`` (ascending) from which ``pcp[i] < other[i]`` holds at every longer one too
    (seconds per chunk, one per length); :data:`~cpattn.engine.elastic.NEVER` when PCP loses the longest."""
    best = NEVER
    for n, a, b in reversed(list(zip(lens, pcp, other))):
        if a >= b:
            break
        best = n
    return best


def measure(model, params: dict, cfg: Any, world: Group | None, *, pcp_size: int, dcp_size: int, block_size: int,
            interleave_size: int, budget: int, reps: int = 3, seed: int = 0) -> int:
    """Time a lone chunk under PCP and under the elastic policy's short path on ``world`` (module doc); the
    threshold every rank agrees on. Call it on every rank of the world, with the same arguments.

    world: the engine's group (a simulated world of threads works, with the threads' timings; None, the
    in-process mesh that runs its ranks one after the other, is refused). budget: the longest chunk
    (the scheduler's ``max_num_batched_tokens``). reps: timed rounds per length and path.
    """
    from cpattn.engine.llm import LLMEngine  # here: the engine imports this module
    from cpattn.engine.sampling import SamplingParams

    if world is None:
        raise ValueError('pcp_min_tokens="measure" times the engine\'s ranks, so it needs world= (gloo ranks, '
                         'torchrun, or a cpattn.simulate world); pass an int, or None for the planner\'s break-even')
    lens = lengths(budget)
    sched = SchedulerConfig(max_num_batched_tokens=lens[-1], max_num_seqs=1, enable_prefix_caching=False,
                            max_model_len=lens[-1] + 1)
    blocks = -(-(lens[-1] + 1) // (block_size * dcp_size)) + 2
    with warnings.catch_warnings():  # the served engine's own construction said what the guide would refuse
        warnings.simplefilter("ignore", GuideCompatWarning)
        engine = LLMEngine(model, params, cfg, world=world, pcp_size=pcp_size, dcp_size=dcp_size,
                           block_size=block_size, interleave_size=interleave_size, scheduler=sched,
                           num_blocks=blocks, pcp_policy="elastic", pcp_min_tokens=0)
    runner, gen = engine.runners[0], torch.Generator().manual_seed(seed)  # the same prompts on every rank
    one = SamplingParams(max_tokens=1)
    times: dict[str, list[float]] = {"pcp": [], "other": []}  # [length * reps] seconds each, this rank's
    try:
        for n in lens:
            for r in range(reps + 1):  # round 0 warms the length up
                for path in ("pcp", "other") if r % 2 == 0 else ("other", "pcp"):
                    runner.pcp_min_tokens = 0 if path == "pcp" else n + 1  # every chunk PCP / this one not
                    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
                    world.all_reduce(torch.zeros(1))  # a start line
                    t0 = time.perf_counter()
                    engine.add_request(prompt, one)
                    while engine.has_unfinished():
                        engine.step()
                    if r:
                        times[path].append(time.perf_counter() - t0)
    finally:
        engine.close()
    mine = torch.tensor(times["pcp"] + times["other"], dtype=torch.float64)
    slowest = world.all_gather(mine).view(world.size, 2, len(lens), reps).amax(0)  # the slowest rank's
    pcp, other = ([statistics.median(row) for row in slowest[i].tolist()] for i in (0, 1))
    return threshold(lens, pcp=pcp, other=other)
