"""Helpers the ``cpattn serve`` tests share (not a test module): a choice's token ids, and jobs run
through an :class:`~cpattn.serve.engine_loop.EngineLoop` the way concurrent clients would."""

from __future__ import annotations

import asyncio
import time


def ids(choice) -> list[int]:
    """A completion choice's token ids (the ``token_ids`` field cpattn adds, vLLM's ``return_token_ids``)."""
    return list(choice.model_extra["token_ids"])


def run_jobs(loop, jobs, *, arrive_after_s: float = 0.2, settle_s: float = 0.3) -> list:
    """``jobs``: (prompt, max_tokens, abort after k tokens or None) each, greedy, submitted to ``loop``; the
    first alone, the others ``arrive_after_s`` later (while it runs), all at once. Returns each job's final
    tokens (None: aborted), after ``settle_s`` of idle turns (heartbeats reach any follower). Stops ``loop``."""
    from cpattn.engine.sampling import SamplingParams

    async def one(prompt, n, cut):
        sub = loop.submit(prompt, SamplingParams(max_tokens=n), asyncio.get_running_loop())
        rid = await asyncio.wrap_future(sub.request_id)
        while not (out := await sub.outputs.get()).finished:
            if cut is not None and len(out.token_ids) >= cut:
                loop.abort(rid)
                return None
        return list(out.token_ids)

    async def all_jobs():
        first = asyncio.ensure_future(one(*jobs[0]))
        await asyncio.sleep(arrive_after_s)
        return [await first, *await asyncio.gather(*(one(*j) for j in jobs[1:]))]

    try:
        got = asyncio.run(all_jobs())
        time.sleep(settle_s)
    finally:
        loop.stop()
    return got
