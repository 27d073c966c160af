"""The load generator of ``cpattn bench serve``: seeded workloads, Poisson arrivals, streamed requests, statistics.

- :func:`poisson_arrivals`: send times of ``n`` requests at ``rate`` requests/s (exponential gaps, seeded);
- :func:`mixed_workload` / :func:`fixed_workload`: the prompts (token ids) and output lengths;
- :func:`run_load`: sends every request at its time through the real ``openai.AsyncOpenAI`` client
  (streaming, ``temperature=0``), round-robin over the targets, and returns one :class:`Record` each:
  TTFT (the first chunk that carries tokens), the gaps between token-carrying chunks (ITL), e2e,
  output tokens;
- :func:`percentile` / :func:`summarize`: p50 / p90 / p99, throughput and goodput under SLOs (an empty
  list gives None, a zero duration gives None: nothing is divided by zero).

No torch here; ``openai`` is imported by :func:`run_load` only.

Example
-------
>>> arrivals = poisson_arrivals(4, rate=2.0, seed=0)
>>> arrivals[0], len(arrivals), arrivals == sorted(arrivals)
(0.0, 4, True)
>>> recs = [Record("short", 8, ttft_s=0.1, e2e_s=0.5, n_out=5, itl_s=[0.1] * 4),
...         Record("long", 64, ttft_s=0.3, e2e_s=0.7, n_out=3, itl_s=[0.2, 0.2])]
>>> s = summarize(recs, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.15)
>>> s["ttft_ms"]["p50"], s["tpot_ms"]["p50"], s["goodput_rps"], s["output_tokens_per_s"]
(200.0, 150.0, 0.5, 4.0)
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

PCTS = (50, 90, 99)


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt (token ids), the tokens to generate, its class."""

    prompt: tuple[int, ...]
    max_tokens: int
    kind: str = "fixed"


@dataclass
class Record:
    """What one request measured (seconds from its send); ``error`` set if it failed."""

    kind: str
    prompt_len: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    n_out: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (n_out - 1): the mean time per output token after the first (None below 2 tokens).

        >>> Record("x", 1, ttft_s=1.0, e2e_s=3.0, n_out=5).tpot_s, Record("x", 1, ttft_s=1.0, e2e_s=1.0, n_out=1).tpot_s
        (0.5, None)
        """
        if self.error is not None or self.ttft_s is None or self.e2e_s is None or self.n_out < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.n_out - 1)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (seconds) of ``n`` requests: a Poisson process of ``rate`` requests/s (exponential gaps
    of mean 1/rate, ``random.Random(seed)``), the first at 0; ``rate=inf``: every request at 0.

    >>> poisson_arrivals(3, float("inf"), 0)
    [0.0, 0.0, 0.0]
    >>> poisson_arrivals(3, 1.0, 7) == poisson_arrivals(3, 1.0, 7)
    True
    """
    if not rate > 0:
        raise ValueError(f"rate: saw {rate}; expected a rate > 0 requests/s (inf: all at once)")
    if n < 0:
        raise ValueError(f"n: saw {n}; expected >= 0 requests")
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def mixed_workload(n: int, seed: int, vocab: int, *, short: tuple[int, int] = (64, 256),
                   long: tuple[int, int] = (2048, 4096), long_fraction: float = 0.2,
                   output: tuple[int, int] = (16, 48), prefix_len: int = 64) -> list[Request]:
    """A long-context mix: each request is long with probability ``long_fraction`` (prompt length uniform in
    ``long``), else short (uniform in ``short``); output lengths uniform in ``output``; every prompt starts
    with the same ``prefix_len`` tokens (a shared system prompt: prefix-cache hits), then random ids.

    >>> reqs = mixed_workload(50, 0, 512, long_fraction=0.5)
    >>> sorted({r.kind for r in reqs}), all(r.prompt[:64] == reqs[0].prompt[:64] for r in reqs)
    (['long', 'short'], True)
    """
    rng = random.Random(seed)
    system = _ids(random.Random(seed ^ 0x5EED), prefix_len, vocab)  # the same for every run of this seed
    out = []
    for _ in range(n):
        kind = "long" if rng.random() < long_fraction else "short"
        lo, hi = long if kind == "long" else short
        length = max(rng.randint(lo, hi), prefix_len + 1)
        out.append(Request(tuple(system + _ids(rng, length - prefix_len, vocab)), rng.randint(*output), kind))
    return out


def fixed_workload(n: int, seed: int, vocab: int, *, input_len: int = 512, output_len: int = 32) -> list[Request]:
    """``n`` random prompts of ``input_len`` tokens, each generating ``output_len`` tokens (no shared prefix).

    >>> {(len(r.prompt), r.max_tokens) for r in fixed_workload(3, 0, 512, input_len=10, output_len=4)}
    {(10, 4)}
    """
    rng = random.Random(seed)
    return [Request(tuple(_ids(rng, input_len, vocab)), output_len, "fixed") for _ in range(n)]


def percentile(xs: list[float], p: float) -> float | None:
    """The ``p``-th percentile of ``xs`` by linear interpolation between closest ranks (numpy's default);
    None for an empty list.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99), percentile([], 50)
    (2.5, 5.0, None)
    """
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _pcts_ms(xs: list[float]) -> dict:
    out = {f"p{p}": (None if (v := percentile(xs, p)) is None else v * 1e3) for p in PCTS}
    out["mean"] = sum(xs) / len(xs) * 1e3 if xs else None
    return out


def _per_s(count: float, duration_s: float | None) -> float | None:
    return count / duration_s if duration_s and duration_s > 0 else None


def summarize(records: list[Record], duration_s: float | None, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Latency percentiles (ms), throughput and goodput of one run.

    goodput: requests per second that finished without error with TTFT <= ``slo_ttft_s`` and TPOT <=
    ``slo_tpot_s`` (a one-token request has no TPOT and meets that SLO); rates are None when the
    duration is 0 or unknown. Per request class (``by_kind``): TTFT percentiles and counts.
    """
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    good = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
               and (r.tpot_s is None or r.tpot_s <= slo_tpot_s))
    n_out = sum(r.n_out for r in ok)
    kinds = sorted({r.kind for r in records})
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error is not None})[:3],
        "duration_s": duration_s, "output_tokens": n_out, "input_tokens": sum(r.prompt_len for r in ok),
        "ttft_ms": _pcts_ms(ttft), "tpot_ms": _pcts_ms(tpot), "itl_ms": _pcts_ms(itl), "e2e_ms": _pcts_ms(e2e),
        "request_throughput_rps": _per_s(len(ok), duration_s),
        "output_tokens_per_s": _per_s(n_out, duration_s),
        "good_requests": good, "goodput_rps": _per_s(good, duration_s),
        "by_kind": {k: {"requests": sum(r.kind == k for r in records),
                        "ttft_ms": _pcts_ms([r.ttft_s for r in ok if r.kind == k and r.ttft_s is not None])}
                    for k in kinds},
    }


def _chunk_tokens(chunk: Any) -> int:
    """Tokens one streamed completion chunk carries: its ``token_ids`` (cpattn / vLLM's extension), else the
    ids in its text (without a tokenizer the text is the ids joined by spaces)."""
    if not chunk.choices:
        return 0
    choice = chunk.choices[0]
    ids = (choice.model_extra or {}).get("token_ids")
    if ids is not None:
        return len(ids)
    return len((choice.text or "").split())


async def _one(client: Any, model: str, req: Request, rec: Record) -> None:
    start = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(model=model, prompt=list(req.prompt), max_tokens=req.max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True})
        async for chunk in stream:
            n = _chunk_tokens(chunk)
            if not n:
                continue
            now = time.perf_counter()
            if last is None:
                rec.ttft_s = now - start
            else:
                rec.itl_s.append(now - last)
            last = now
            rec.n_out += n
        rec.e2e_s = time.perf_counter() - start
        if rec.n_out == 0:
            rec.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash of the benchmark
        rec.error = f"{type(e).__name__}: {str(e)[:200]}"


async def run_load(targets: list[tuple[str, str]], requests: list[Request], arrivals: list[float],
                   timeout_s: float = 600.0) -> tuple[list[Record], float | None]:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds to ``targets[i % len(targets)]`` ((base_url, model)
    pairs: round-robin, data parallel); wait for all. Returns (records in request order, seconds from the
    first send to the last completion; None if nothing ran)."""
    import openai

    if len(requests) != len(arrivals):
        raise ValueError(f"requests / arrivals: {len(requests)} vs {len(arrivals)}; expected one arrival per request")
    clients = [openai.AsyncOpenAI(base_url=url, api_key="cpattn-bench", max_retries=0, timeout=timeout_s)
               for url, _ in targets]
    records = [Record(r.kind, len(r.prompt)) for r in requests]
    tasks = []
    t0 = time.perf_counter()
    try:
        for i, (req, at) in enumerate(zip(requests, arrivals)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            j = i % len(targets)
            tasks.append(asyncio.ensure_future(_one(clients[j], targets[j][1], req, records[i])))
        if tasks:
            await asyncio.gather(*tasks)
        end = time.perf_counter()
    finally:
        for c in clients:
            await c.close()
    return records, (end - t0 if tasks else None)
