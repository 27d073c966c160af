"""Stopping the launcher stops its ranks : a real `cpattn demo`, signalled from here.

The demo's ranks are found in /proc while it runs (processes of the demo's tree started by multiprocessing's
spawn, or forked by its forkserver); after SIGTERM or SIGINT to the demo alone, none of them (nor the
forkserver) may be left alive.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from cpattn.comm.listeners import process_tree

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"), pytest.mark.slow]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ranks(tree):
    """The rank processes: spawned (their own interpreter) or forked by the launcher's forkserver (children of
    the server, whose command line they keep)."""
    return [p for p in tree if "multiprocessing.spawn" in _cmdline(p) or
            ("multiprocessing.forkserver" in _cmdline(p) and "multiprocessing.forkserver" in _cmdline(_parent(p)))]


@pytest.mark.parametrize("signum, after_s", [(signal.SIGTERM, 0.0), (signal.SIGINT, 1.5)],
                         ids=["SIGTERM-while-ranks-start", "SIGINT-while-ranks-run"])
def test_signal_to_the_demo_leaves_no_rank_running(signum, after_s):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    demo = subprocess.Popen(
        [sys.executable, "-m", "cpattn", "demo", "--no-progress", "--prompt-len", "64", "--max-new-tokens", "256",
         "--graph-mode", "none"],  # 255 eager decode steps: seconds of running ranks, whatever the compile cache holds
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(seen)) < 2 and time.monotonic() < deadline and demo.poll() is None:
            seen |= set(process_tree(demo.pid)) - {demo.pid}
            time.sleep(0.02)
        assert len(_ranks(seen)) >= 2, f"the demo started no ranks within 120 s (exit {demo.poll()})"
        end = time.monotonic() + after_s
        while time.monotonic() < end:
            seen |= set(process_tree(demo.pid)) - {demo.pid}
            time.sleep(0.05)
        assert demo.poll() is None, f"the demo ended (exit {demo.returncode}) before it could be signalled"
        demo.send_signal(signum)
        demo.wait(timeout=60)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: _cmdline(p)[:80] for p in seen if _alive(p)}
        assert not left, f"still running 5 s after the demo ended ({demo.returncode}): {left}"
        if signum == signal.SIGTERM:
            assert demo.returncode == -signal.SIGTERM  # the signal still ends the demo as it did
        else:
            assert demo.returncode == 130 and b"interrupted" in demo.stderr.read()
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in seen:
            if _alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
