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
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from cpattn.comm.launch_rank import BEAT_S, _worker
from cpattn.comm.launch_watch import (GRACE_S, POLL_S, STARTUP_S, RankFailure, _kill, _message, _Watch, _watch,
                                      process_state)

__all__ = ["BEAT_S", "GRACE_S", "POLL_S", "STARTUP_S", "RankFailure", "SpawnError", "process_state", "spawn"]


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


def start_method() -> str:
    """How ranks start: ``forkserver`` where the platform has it (the server imports torch once, and every
    rank forks from it in a fraction of a second instead of importing torch itself, 2-3 s on 2 cores),
    else ``spawn``; ``CPATTN_START_METHOD=spawn`` asks for spawn. A forked rank takes this process's
    environment, ``sys.path`` and working directory at its start (:func:`cpattn.comm.launch_rank._worker`),
    as a spawned one would.

    >>> start_method() in ("forkserver", "spawn")
    True
    """
    want = os.environ.get("CPATTN_START_METHOD", "forkserver")
    if want not in ("forkserver", "spawn"):
        raise ValueError(f"CPATTN_START_METHOD={want!r}; use forkserver or spawn")
    return want if want in mp.get_all_start_methods() else "spawn"


def _context():
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read when the server first starts
    return ctx


def _run(world_size, fn, args, kwargs, backend, threads, timeout_s, collective_timeout_s) -> list:
    ctx = _context()
    here = (dict(os.environ), list(sys.path), os.getcwd())
    job = (fn, args, kwargs)
    if ctx.get_start_method() == "forkserver":  # by value: a forkserver takes at most 256 fds per process, and
        job = (None, pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL), None)  # tensors in args would each be
        # an fd (torch shares storages by fd); the rank unpickles this process's own bytes
    beats = ctx.Array("d", world_size, lock=False)  # monotonic time of each rank's last heartbeat; 0: none yet
    with tempfile.TemporaryDirectory(prefix="cpattn-spawn-") as out_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.getpid(), backend, threads, collective_timeout_s, out_dir, beats, *job, here),
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
