"""Spawn N real torch.distributed processes on this machine and collect their results.

Used by the tests (real gloo ranks), the CLI and the benchmarks. Each rank
runs ``fn(group, *args, **kwargs)`` with a :class:`~cpattn.comm.dist.DistGroup`
and ``torch.set_num_threads(threads)``; results travel back through
``torch.save`` files.

The parent watches every rank until all have finished, and never waits on
a rank that cannot finish:

- each rank runs a heartbeat thread that stamps a shared clock every
  ``BEAT_S`` seconds. A stopped process (SIGSTOP, a debugger, swapped out)
  stops all its threads, so a rank whose stamp is older than ``timeout_s``
  is reported as stalled, with its process state from ``/proc`` on Linux;
- every collective waits at most ``timeout_s`` (the torch.distributed
  timeout; ``collective_timeout_s`` sets it apart), so ranks that are alive
  but wait on each other forever end in an error;
- a rank that raises or dies ends the run: the others get ``GRACE_S``
  seconds to finish on their own, then every rank still running is killed
  with its whole process group (compile workers included). A rank that
  raised is reported with its traceback, a rank killed by a signal with the
  signal's name;
- a rank alive and beating that never joins the collective another rank
  waits in is named as the cause ("stuck"), not the rank whose collective
  timed out waiting for it;
- stopping the launcher stops its ranks: SIGINT (KeyboardInterrupt),
  SIGTERM and SIGHUP end every rank's process group before the signal takes
  its usual effect, and a rank whose launcher died before the kernel's
  death signal was armed exits on its own at start.

Nothing listens beyond loopback: the ranks meet through a ``FileStore`` in
the run's private temporary directory (mode 0700, removed afterwards), not a
TCPStore (which listens on every interface), and gloo's pairs use the
loopback interface unless ``GLOO_SOCKET_IFNAME`` names another. torchrun
runs keep torchrun's own rendezvous (:func:`cpattn.comm.dist.init_from_env`).

Worker processes write their stdout to stderr, so the parent's stdout
carries only what the parent prints (``--json -`` stays pure JSON).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

BEAT_S = 0.5  # heartbeat period of every rank
STARTUP_S = 60.0  # allowance for a rank's start-up (interpreter, import torch) before its first heartbeat
GRACE_S = 5.0  # after one rank failed, how long the others may take to end on their own
POLL_S = 0.1  # how often the parent looks at the ranks


class SpawnError(RuntimeError):
    """A spawned rank failed, died or stalled.

    ``failures`` holds one :class:`RankFailure` per rank that did not
    finish, the cause first (a stalled rank, or the first rank that
    raised or died); ``ranks`` their rank numbers in that order.
    """

    def __init__(self, message: str, failures: list[RankFailure] | None = None):
        super().__init__(message)
        self.failures = list(failures or [])
        self.ranks = [f.rank for f in self.failures]


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not finish: ``kind`` is "stalled", "stuck", "raised", "died", "not started" or "ended".

    "stuck": alive and beating, but it never joined the collective another
    rank waited in until that collective's bound ran out (``waited``).
    """

    rank: int
    kind: str
    detail: str  # one line
    traceback: str = ""
    at: float = 0.0  # time.monotonic() when it failed (or was found failed)
    waited: bool = False  # it raised because a collective waited out its bound


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when the parent dies (no orphans after a SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _heartbeat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(BEAT_S)


def _local_network_env() -> None:
    """Gloo pairs of a local spawn on loopback (unless the environment names an interface)."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _collective_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a collective that waited out its bound (gloo, NCCL and HCCL word it differently)."""
    backend_error = getattr(torch.distributed, "DistBackendError", ())
    return isinstance(e, backend_error) or (isinstance(e, RuntimeError) and re.search(r"timed? ?out", str(e), re.I))


def _worker(rank, world_size, parent, backend, threads, timeout_s, out_dir, beats, fn, args, kwargs):
    os.setpgrp()  # own process group: the parent ends this rank and everything it started at once
    _die_with_parent()
    if os.getppid() != parent:  # the parent died while this rank started (before the death signal was armed)
        os._exit(1)
    threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True, name="cpattn-heartbeat").start()
    os.dup2(2, 1)  # stdout belongs to the parent
    sys.stdout = sys.stderr
    import torch.distributed as dist

    from cpattn.comm.dist import DistGroup

    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.set_num_threads(threads)
        _local_network_env()
        # the rendezvous is a file in the run's private directory (mode 0700, removed afterwards): no TCPStore,
        # so nothing listens on any interface for it
        store = dist.FileStore(os.path.join(out_dir, "rendezvous"), world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            result = fn(DistGroup(), *args, **kwargs)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        record = {"ok": True, "result": result}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        record = {"ok": False, "error": (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:300],
                  "traceback": traceback.format_exc(), "at": time.monotonic(), "waited": bool(_collective_timeout(e))}
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent never reads half a file


def process_state(pid: int) -> str:
    """A process's state in words, from ``/proc/<pid>/stat`` (Linux); "unknown" elsewhere.

    Example
    -------
    >>> import os
    >>> process_state(os.getpid()) in ("running", "sleeping", "unknown")
    True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    names = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped", "t": "stopped by a tracer",
             "Z": "zombie", "X": "dead"}
    return names.get(code, code)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Watch:
    """The parent's view of the ranks: processes, heartbeats, result files."""

    def __init__(self, procs, beats, out_dir, timeout_s, started):
        self.procs, self.beats, self.out_dir = procs, beats, out_dir
        self.timeout_s, self.started = timeout_s, started
        self.records: dict[int, dict] = {}

    def record(self, r: int) -> dict | None:
        if r not in self.records:
            path = os.path.join(self.out_dir, f"rank{r}.pt")
            if os.path.exists(path):
                self.records[r] = torch.load(path, weights_only=False)
        return self.records.get(r)

    def silent_for(self, r: int, now: float) -> float:
        """Seconds since rank r's last heartbeat (since the launch if it never beat)."""
        last = self.beats[r]
        return now - (last if last > 0 else self.started)

    def stalled(self, r: int, now: float, bound: float) -> RankFailure | None:
        p = self.procs[r]
        if not p.is_alive():
            return None
        silent = self.silent_for(r, now)
        state = process_state(p.pid)
        if self.beats[r] <= 0:
            if silent > bound + STARTUP_S:
                return RankFailure(r, "not started", f"rank {r} did not start within {silent:.0f} s "
                                   f"(process state: {state})", at=now)
            return None
        if silent > bound:
            return RankFailure(r, "stalled", f"rank {r} stopped responding (no heartbeat for {silent:.0f} s, "
                               f"bound {self.timeout_s:g} s; process state: {state})", at=now - silent)
        return None

    def exited(self, r: int) -> RankFailure | None:
        """A failure for a rank that has exited without a result; None while it runs or when it succeeded."""
        p = self.procs[r]
        if p.is_alive():
            return None
        rec = self.record(r)
        if rec is not None:
            if rec["ok"]:
                return None
            return RankFailure(r, "raised", f"rank {r} raised {rec['error']}", rec["traceback"], rec["at"],
                               rec.get("waited", False))
        code = p.exitcode
        died = self.beats[r] if self.beats[r] > 0 else time.monotonic()  # it died within BEAT_S of its last beat
        if code is not None and code < 0:
            return RankFailure(r, "died", f"rank {r} was killed by {_signal_name(code)} (exit code {code})", at=died)
        return RankFailure(r, "died", f"rank {r} exited with code {code} without a result", at=died)


def _kill(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # started ones
    for p in procs:
        try:  # the rank's whole group, also after the rank itself ended (its compile workers)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if p.is_alive():  # it had not made its own group yet
                p.kill()
    for p in procs:
        p.join(10.0)
        if p.is_alive():  # pragma: no cover - the kernel did not reap it in time
            p.kill()
            p.join()


class _Stopped(BaseException):
    """The launcher got SIGTERM or SIGHUP while its ranks ran (raised in the main thread by the handler)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """While the ranks run, SIGTERM / SIGHUP end them first: the signal raises :class:`_Stopped` in the
    main thread (so ``finally`` kills every rank), then the previous handler is restored. SIGINT already
    raises KeyboardInterrupt. Only the main thread can take signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def on_signal(signum, frame):
        if not got:  # once: a second signal must not interrupt the clean-up
            got.append(signum)
            raise _Stopped(signum)

    previous = {}
    for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if s is not None and signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _still_running(w: _Watch, r: int, waiter: RankFailure | None, now: float) -> RankFailure:
    """A rank still alive, beating, ``GRACE_S`` after the first failure.

    If another rank's collective waited out its bound (``waiter``), every
    rank waiting in that collective has raised by now too (they share the
    bound), so one still running never joined it: it is the stuck one.
    """
    if waiter is None:
        return RankFailure(r, "ended", f"rank {r} was still running and was ended", at=now)
    return RankFailure(
        r, "stuck", f"rank {r} is alive (heartbeat {w.silent_for(r, now):.1f} s ago, process state: "
        f"{process_state(w.procs[r].pid)}) but never joined the collective rank {waiter.rank} waited in "
        f"until its bound ran out; it was ended", at=waiter.at - 1e-3)


def _watch(w: _Watch) -> list[RankFailure]:
    """Poll until every rank has finished or one failed; return the failures, the cause first."""
    n = len(w.procs)
    failures: dict[int, RankFailure] = {}
    first_failure_at = None
    while True:
        now = time.monotonic()
        for r in range(n):
            if r in failures:
                continue
            f = w.exited(r) or w.stalled(r, now, w.timeout_s)
            if f is not None:
                failures[r] = f
                first_failure_at = first_failure_at or now
        running = [r for r in range(n) if w.procs[r].is_alive() and r not in failures]
        if not running:
            break
        if first_failure_at is not None:
            # a live rank silent for a while is the likely cause of the others' errors: name it now
            for r in running:
                if w.beats[r] > 0 and w.silent_for(r, now) > max(10 * BEAT_S, w.timeout_s / 2):
                    failures[r] = w.stalled(r, now, 0.0)
            if now - first_failure_at > GRACE_S or all(r in failures for r in running):
                waiter = next((f for f in failures.values() if f.waited), None)
                for r in running:
                    failures.setdefault(r, _still_running(w, r, waiter, now))
                break
        time.sleep(POLL_S)
    order = {"stalled": 0, "not started": 0, "stuck": 0, "raised": 1, "died": 1, "ended": 2}
    return sorted(failures.values(), key=lambda f: (order[f.kind], f.at, f.rank))


def _message(world_size: int, fn, failures: list[RankFailure]) -> str:
    name = getattr(fn, "__name__", repr(fn))
    cause, rest = failures[0], failures[1:]
    lines = [f"spawn({world_size}, {name}): {cause.detail}"]
    if rest:
        lines.append("then: " + "; ".join(f.detail for f in rest))
    if cause.traceback:
        lines.append(f"rank {cause.rank}'s traceback:\n{cause.traceback.rstrip()}")
    return "\n".join(lines)


def spawn(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 300.0,
    collective_timeout_s: float | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(group, *args, **kwargs)`` in ``world_size`` fresh processes; return per-rank results.

    ``fn`` must be importable (a module-level function) and its arguments and
    results picklable. ``threads`` sets each rank's intra-op threads.
    ``timeout_s`` bounds every wait (module doc): a rank silent (no
    heartbeat) for that long, or a collective waiting that long, ends the
    run with a :class:`SpawnError` naming the rank; a whole run may take
    longer as long as every rank keeps responding. ``collective_timeout_s``
    (default ``timeout_s``) sets the collectives' bound alone, for programs
    where some ranks legitimately wait long (e.g. while rank 0 alone runs a
    one-rank baseline); a stopped or dead rank is still named after
    ``timeout_s``.

    Raises
    ------
    SpawnError
        A rank raised (its traceback is in the message, once), died (with
        the signal's name), stalled, was stuck outside a collective the others
        waited in, or did not start; ``.failures`` lists every rank that did
        not finish, the cause first. Also after SIGTERM / SIGHUP to this
        process, once the previous handler returned (by default the signal
        ends the process instead). No worker process outlives the call.

    Example
    -------
    >>> from cpattn.comm.launch import spawn
    >>> def ranks(group):
    ...     return group.rank
    >>> spawn(2, ranks)  # doctest: +SKIP
    [0, 1]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be an int >= 1; got {world_size!r}")
    collective_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if not value > 0:
            raise ValueError(f"spawn: {name} must be > 0 seconds; got {value!r}")
    try:
        return _run(world_size, fn, args, kwargs, backend, threads, timeout_s, collective_timeout_s)
    except _Stopped as stop:  # every rank is ended and the temporary directory removed
        name = signal.Signals(stop.signum).name
        signal.raise_signal(stop.signum)  # now the signal does what it did before (by default: end this process)
        raise SpawnError(f"spawn({world_size}, {getattr(fn, '__name__', fn)!s}): stopped by {name}; "
                         "every rank was ended") from None


def _run(world_size, fn, args, kwargs, backend, threads, timeout_s, collective_timeout_s) -> list:
    ctx = mp.get_context("spawn")
    beats = ctx.Array("d", world_size, lock=False)  # monotonic time of each rank's last heartbeat; 0: none yet
    with tempfile.TemporaryDirectory(prefix="cpattn-spawn-") as out_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.getpid(), backend, threads, collective_timeout_s, out_dir, beats, fn, args,
                      kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        watch = _Watch(procs, beats, out_dir, timeout_s, time.monotonic())
        with _stop_on_signals():
            try:
                for p in procs:
                    p.start()
                failures = _watch(watch)
            finally:
                _kill(procs)
        if failures:
            raise SpawnError(_message(world_size, fn, failures), failures)
        return [watch.record(r)["result"] for r in range(world_size)]
