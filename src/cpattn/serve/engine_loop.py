"""One thread owns the :class:`~cpattn.engine.llm.LLMEngine` and steps it while requests are pending.

The engine (its scheduler, block manager, runners) is not thread-safe, so
nothing but this thread touches it. The HTTP side talks to it through one
thread-safe inbox:

- ``submit(prompt, params)`` puts an *add* on the inbox and returns a
  :class:`Submission`: a future that resolves to the request id once the
  engine thread has called ``add_request`` (or to its ``ValueError`` for a
  bad prompt), and an ``asyncio.Queue`` on the caller's event loop that
  receives every :class:`~cpattn.engine.llm.RequestOutput` of the request
  as the steps produce them (the last one has ``finished`` set);
- ``abort(request_id)`` puts an *abort* (a client went away; counted in ``aborted``);
- the thread drains the inbox, runs one ``engine.step()`` if anything is
  unfinished, hands each output to its request's queue
  (``loop.call_soon_threadsafe``), and sleeps on the inbox when idle.

The engine may be an :class:`~cpattn.engine.llm.LLMEngine` or a
:class:`~cpattn.engine.pd_engine.PDEngine` (the same add_request / step /
has_unfinished / abort_request; its ``stats`` is a ``PDStats`` of both roles).

Per request the thread times the first token and the finish (monotonic clock, from the moment the
engine accepted it): :attr:`EngineLoop.ttft` and :attr:`EngineLoop.tpot` are :class:`Histogram` objects over
the requests that finished (not aborted): TTFT, and TPOT = (finish - first token) / (tokens - 1) for
requests of two tokens or more.

``stats`` is the engine's :class:`~cpattn.engine.llm.EngineStats` as of the latest step (a frozen
snapshot the engine thread replaces, so other threads read it safely). If a step raises, every pending request receives the exception, the loop
stops, and :attr:`EngineLoop.error` says why (``/health`` then answers 503).

Example
-------
>>> import asyncio
>>> from cpattn.engine.llm import LLMEngine, SamplingParams
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> loop = EngineLoop(LLMEngine("qwen3", qwen3.init_params(cfg), cfg, block_size=4, num_blocks=16))
>>> async def one():
...     sub = loop.submit([1, 2, 3], SamplingParams(max_tokens=3), asyncio.get_running_loop())
...     await asyncio.wrap_future(sub.request_id)
...     while not (out := await sub.outputs.get()).finished:
...         pass
...     return len(out.token_ids), out.finish_reason
>>> asyncio.run(one())
(3, 'length')
>>> loop.stop()
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


# vLLM's bucket bounds (seconds) for time-to-first-token and time-per-output-token
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


class Histogram:
    """A Prometheus histogram: ``observe(x)`` counts ``x`` in the first bucket whose upper bound is >= x;
    ``snapshot()`` -> (bounds, cumulative counts per bound, sum, count), thread-safe.

    >>> h = Histogram((0.1, 1.0))
    >>> h.observe(0.05); h.observe(0.5); h.observe(3.0)
    >>> h.snapshot()
    ((0.1, 1.0), (1, 2), 3.55, 3)
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, x: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, x)] += 1
            self._sum += x

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float, int]:
        with self._lock:
            cum = tuple(itertools.accumulate(self._counts))
            return self.bounds, cum[:-1], self._sum, cum[-1]


@dataclass
class Submission:
    """What :meth:`EngineLoop.submit` returns: ``request_id`` resolves once the engine has the request
    (or raises its ValueError); ``outputs`` receives its RequestOutputs (or an exception) on ``loop``."""

    request_id: Future
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    """The engine's own thread (module docstring). ``stop()`` ends it; pending requests then get a
    RuntimeError."""

    def __init__(self, engine: Any, *, idle_wait_s: float = 0.5, mirror: Any = None) -> None:
        self.engine = engine
        self.mirror = mirror  # real ranks: sends each turn's engine calls to the other ranks (serve.ranks)
        self.error: BaseException | None = None
        self.stats = engine.stats  # the engine's counters after the latest step (set by the engine thread)
        self.aborted = 0  # requests aborted because their client went away
        self.ttft = Histogram(TTFT_BUCKETS)  # seconds, finished requests
        self.tpot = Histogram(TPOT_BUCKETS)
        self._times: dict[Any, list] = {}  # engine thread only: rid -> [accepted at, first token at or None]
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[Any, Submission] = {}  # engine thread only
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpattn-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt: list[int], params: Any, loop: asyncio.AbstractEventLoop) -> Submission:
        """Hand a request to the engine thread (thread-safe; call from the event loop ``loop``)."""
        sub = Submission(Future(), asyncio.Queue(), loop)
        if not self.alive:
            sub.request_id.set_exception(RuntimeError(f"the engine loop has stopped ({self.error or 'stopped'})"))
            return sub
        self._inbox.put(("add", f"req-{next(self._ids)}", list(prompt), params, sub))
        return sub

    def abort(self, request_id: Any) -> None:
        """Stop a request (its blocks freed); nothing happens if it already finished."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout_s)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                calls = self._drain(block=not busy)
                stop = self._stopping.is_set()  # decided once: the other ranks hear the same
                if self.mirror is not None:
                    self.mirror.send(calls, stop)  # every turn, even empty: the other ranks step when this one does
                if stop:
                    break
                if not self.engine.has_unfinished():
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self.stats = self.engine.stats
        except BaseException as e:  # noqa: BLE001 - every waiting request hears it
            self.error = e
        finally:
            why = self.error or RuntimeError("the server is shutting down")
            for rid in list(self._subs):
                self._deliver(rid, why)
            while True:  # requests that never reached the engine
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "add":
                    item[4].request_id.set_exception(RuntimeError(f"the engine loop has stopped ({why})"))

    def _drain(self, block: bool) -> list[tuple]:
        """Apply every pending add / abort; wait for one first if the engine is idle. Returns the engine
        calls made, in order: ``("add", rid, prompt, params)`` (accepted ones only) and ``("abort", rid)``."""
        calls: list[tuple] = []
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return calls
        while True:
            call = self._apply(item)
            if call is not None:
                calls.append(call)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return calls

    def _apply(self, item: tuple) -> tuple | None:
        if item[0] == "add":
            _, rid, prompt, params, sub = item
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except ValueError as e:
                sub.request_id.set_exception(e)
                return None
            self._subs[rid] = sub
            self._times[rid] = [time.monotonic(), None]
            self.stats = self.engine.stats
            sub.request_id.set_result(rid)
            return ("add", rid, prompt, params)
        if item[0] == "abort" and item[1] in self._subs:
            self.engine.abort_request(item[1])
            self._subs.pop(item[1])
            self._times.pop(item[1], None)
            self.aborted += 1
            self.stats = self.engine.stats
            return ("abort", item[1])
        return None

    def _deliver(self, rid: Any, item: Any) -> None:
        sub = self._subs.get(rid)
        if sub is None:
            return
        if not isinstance(item, BaseException):
            self._time(rid, item)
        if isinstance(item, BaseException) or item.finished:
            self._subs.pop(rid)
            self._times.pop(rid, None)
        try:
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop has closed
            pass

    def _time(self, rid: Any, out: Any) -> None:
        """The first token's time, and at a (not aborted) finish the request's TTFT and TPOT observed."""
        t = self._times.get(rid)
        if t is None:
            return
        now = time.monotonic()
        if t[1] is None and out.token_ids:
            t[1] = now
        if out.finished and out.finish_reason != "abort" and t[1] is not None:
            self.ttft.observe(t[1] - t[0])
            if len(out.token_ids) >= 2:
                self.tpot.observe((now - t[1]) / (len(out.token_ids) - 1))
