"""Helpers of tests/test_engine_loop*.py: a schedule run through LLMEngine, its gloo rank function, and two
spies (every rank's logits checked equal each step; the calls a function gets from every rank's thread)."""

from __future__ import annotations

import functools
import threading

import torch

from cpattn.config import SchedulerConfig
from cpattn.engine.llm import LLMEngine, SamplingParams


@functools.lru_cache(maxsize=None)
def tiny_float64(family: str, seed: int):
    """(config, params) of ``family``'s tiny config in float64 (one copy per (family, seed) for the session)."""
    from cpattn.models.family import get_family

    fam = get_family(family)
    cfg = fam.config_class.tiny()
    return cfg, fam.init_params(cfg, seed=seed, dtype=torch.float64)


def run_schedule(engine: LLMEngine, schedule: list[dict]) -> tuple[dict, list]:
    """Feed ``schedule`` (dicts: prompt, max_tokens, arrive step, optional stop / abort step) to ``engine``,
    stepping until everything finished. Returns ({index: request id}, [(SchedulerOutput, replayed) per step])."""
    ids, steps, step = {}, [], 0
    pending = sorted(range(len(schedule)), key=lambda i: schedule[i]["arrive"])
    while pending or engine.has_unfinished():
        while pending and schedule[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            r = schedule[i]
            ids[i] = engine.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"],
                                                                    stop_token_ids=tuple(r.get("stop", ()))))
        for i, rid in ids.items():
            if schedule[i].get("abort") == step:
                engine.abort_request(rid)
        engine.step()
        steps.append(engine.last_step)
        step += 1
        if step > 10_000:
            raise RuntimeError("the schedule did not drain in 10,000 steps")
    return ids, steps


def check_schedule(engine: LLMEngine, schedule: list[dict], expected) -> list:
    """Run ``schedule`` (:func:`run_schedule`); assert every request's tokens equal ``expected(req)`` (an aborted
    one's: a prefix), that no step with an eager reason replayed and that no block or request is left; then one
    more step (the scheduler reports the last finishes with it: the runners drop their state). Returns the steps."""
    ids, steps = run_schedule(engine, schedule)
    for i, rid in ids.items():
        req = engine.scheduler.requests[rid]
        got, want = list(req.output), expected(schedule[i])
        if req.finish_reason == "abort":
            assert want[: len(got)] == got, f"aborted request {i}: {got} is not a prefix of {want}"
        else:
            assert got == want, f"request {i} (prompt {len(schedule[i]['prompt'])} tokens): {got} != {want}"
    for out, replayed in steps:
        assert not (replayed and not out.uniform_decode), f"a step with {out.eager_reason} replayed"
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    assert s.replayed_steps + s.eager_steps == s.steps == len([o for o, _ in steps if o.req_ids])
    engine.step()
    return steps


def gloo_rank(group, family: str, cfg, seed: int, schedule: list[dict], engine_kwargs: dict) -> dict:
    """One torchrun-style rank: every rank builds the engine over its group and runs the same schedule."""
    fam_params = __import__("cpattn.engine.family", fromlist=["get_family"]).get_family(family)
    params = fam_params.init_params(cfg, seed=seed, dtype=torch.float64)
    engine = LLMEngine(family, params, cfg, world=group, dcp_size=group.size,
                       scheduler=SchedulerConfig(**engine_kwargs.pop("scheduler")), **engine_kwargs)
    ids, steps = run_schedule(engine, schedule)
    return {i: list(engine.scheduler.requests[rid].output) for i, rid in ids.items()}


def run_arrivals(engine: LLMEngine, reqs: list[dict], params: list) -> tuple[list[list[int]], int]:
    """Add ``reqs[i]["prompt"]`` with ``params[i]`` at step ``reqs[i]["arrive"]``, step until drained; (each
    request's output tokens in arrival order, preemptions). Asserts no block leaked."""
    ids, step = [], 0
    while len(ids) < len(reqs) or engine.has_unfinished():
        ids += [engine.add_request(r["prompt"], params[i]) for i, r in enumerate(reqs) if r["arrive"] == step]
        engine.step()
        step += 1
    assert engine.stats.blocks_used == 0
    return [list(engine.scheduler.requests[i].output) for i in ids], engine.stats.preemptions


def checked_logits(engine: LLMEngine, dcp: int | None = None) -> list[int]:
    """Make every step of ``engine`` (a simulated mesh: one result per rank) assert that every rank's logits
    equal rank 0's; with ``dcp``, the runners of ranks ``dcp..`` (outside the DCP group) also raise if they run
    a DCP step. Returns a one-item list counting the checked rows."""
    seen, execute = [0], engine._execute

    def run(out):
        results = execute(out)
        for r, res in enumerate(results[1:], 1):
            assert list(res.logits) == list(results[0].logits), r
            for rid in results[0].logits:
                assert torch.equal(res.logits[rid], results[0].logits[rid]), (r, rid)
                seen[0] += 1
        return results

    def no_step(*_, **__):
        raise AssertionError("a rank outside the DCP group ran a DCP step")

    for r in engine.runners[dcp:] if dcp is not None else ():
        r._step = no_step
    engine._execute = run
    return seen


def record_group_calls(monkeypatch, owner, name: str, group_arg: int = 0, calls: list | None = None) -> list:
    """Replace ``owner.name`` (a module's function, or a class's method: ``group_arg`` 1 skips ``self``) by a
    spy that appends ``(group.rank, group.size)`` of its group argument to ``calls`` (a new list unless given;
    returned) on every call, from any thread."""
    calls, lock, real = [] if calls is None else calls, threading.Lock(), getattr(owner, name)

    def spy(*args, **kw):
        group = args[group_arg]
        with lock:
            calls.append((group.rank, group.size))
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, spy)
    return calls
