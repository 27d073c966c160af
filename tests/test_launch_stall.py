"""spawn never waits on a rank that cannot finish: stalled, raising and killed ranks end the run, named.

Real gloo processes; the stalled rank is stopped with SIGSTOP from the test.
"""

import os
import signal
import threading
import time

import pytest
import torch

from cpattn.comm.launch import GRACE_S, SpawnError, spawn

pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals"), pytest.mark.slow]


def loop_collectives(group, pid_dir):
    """Write this rank's pid, then all_reduce for up to a minute (the test stops a rank meanwhile)."""
    with open(os.path.join(pid_dir, f"{group.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    end = time.monotonic() + 60
    while time.monotonic() < end:
        group.all_reduce(torch.ones(4))
        time.sleep(0.01)
    return group.rank


def raise_on_rank1(group, pid_dir):
    """Both ranks write their pid and meet once (so each pid file exists), then rank 1 raises."""
    with open(os.path.join(pid_dir, f"{group.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    group.all_reduce(torch.ones(1))
    if group.rank == 1:
        raise ValueError("boom on purpose")
    return group.all_reduce(torch.ones(1))


def sigkill_rank1(group, pid_dir):
    """Both ranks write their pid and meet once, then rank 1 kills itself.

    Without the first meeting rank 1 could die while rank 0 is still connecting its mesh, and rank 0
    would fail before writing its pid (seen once in CI).
    """
    with open(os.path.join(pid_dir, f"{group.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    group.all_reduce(torch.ones(1))
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return group.all_reduce(torch.ones(1))


def _pids(pid_dir, n=2):
    return [int(open(os.path.join(pid_dir, f"{r}.pid")).read()) for r in range(n)]


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_stopped_rank_is_named_within_the_bound_and_no_worker_survives(tmp_path):
    timeout_s = 3.0
    stopped_at = []

    def stop_rank1():
        deadline = time.monotonic() + 120
        while not (tmp_path / "1.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # both ranks are in the collective loop
        os.kill(_pids(tmp_path)[1], signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    stopper = threading.Thread(target=stop_rank1)
    stopper.start()
    with pytest.raises(SpawnError) as info:
        spawn(2, loop_collectives, str(tmp_path), timeout_s=timeout_s)
    ended_at = time.monotonic()
    stopper.join()
    err = info.value
    assert err.failures[0].rank == 1 and err.failures[0].kind == "stalled", str(err)
    assert "rank 1 stopped responding" in str(err) and "process state: stopped" in str(err), str(err)
    waited = ended_at - stopped_at[0]
    assert timeout_s <= waited + 0.5 and waited < timeout_s + GRACE_S + 3, waited
    assert all(_gone(pid) for pid in _pids(tmp_path))


def test_rank_that_raises_is_named_with_its_traceback_once(tmp_path):
    with pytest.raises(SpawnError) as info:
        spawn(2, raise_on_rank1, str(tmp_path), timeout_s=30)
    msg = str(info.value)
    assert info.value.failures[0].rank == 1 and "rank 1 raised ValueError: boom on purpose" in msg, msg
    assert msg.count("Traceback (most recent call last)") == 1, msg
    assert all(_gone(pid) for pid in _pids(tmp_path))


def test_rank_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    with pytest.raises(SpawnError) as info:
        spawn(2, sigkill_rank1, str(tmp_path), timeout_s=30)
    msg = str(info.value)
    assert info.value.failures[0].rank == 1 and "rank 1 was killed by SIGKILL" in msg, msg
    assert all(_gone(pid) for pid in _pids(tmp_path))


def rank1_stuck_outside_collectives(group, pid_dir):
    """Rank 1 stays alive (its heartbeat runs) but never reaches the collective rank 0 waits in."""
    with open(os.path.join(pid_dir, f"{group.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if group.rank == 1:
        time.sleep(120)  # stuck in its own work, outside any collective
    return group.all_reduce(torch.ones(1))


def test_rank_alive_but_stuck_outside_a_collective_is_named_not_the_rank_waiting_for_it(tmp_path):
    started = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(2, rank1_stuck_outside_collectives, str(tmp_path), timeout_s=60, collective_timeout_s=3)
    err = info.value
    assert err.failures[0].rank == 1 and err.failures[0].kind == "stuck", str(err)
    assert str(err).splitlines()[0].startswith("spawn(2, rank1_stuck_outside_collectives): rank 1 "), str(err)
    assert "rank 0" in str(err)  # the waiting rank's timeout is still reported, after the cause
    assert time.monotonic() - started < 60  # named by the collective bound, not the 60 s stall bound
    assert all(_gone(pid) for pid in _pids(tmp_path))
