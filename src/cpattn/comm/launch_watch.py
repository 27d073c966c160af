"""The parent's watch over :func:`cpattn.comm.launch.spawn`'s ranks: heartbeats, exits, result files, the verdict.

Finds every rank that did not finish and why (:class:`RankFailure`: stalled,
stuck, raised, died, not started, ended), the cause first; ends the ranks'
process groups; words the one message of the run's ``SpawnError``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from cpattn.comm.launch_rank import BEAT_S

STARTUP_S = 60.0  # allowance for a rank's start-up (interpreter, import torch) before its first heartbeat
GRACE_S = 5.0  # after one rank failed, how long the others may take to end on their own
POLL_S = 0.1  # how often the parent looks at the ranks


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
