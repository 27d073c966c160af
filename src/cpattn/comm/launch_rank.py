"""One rank of :func:`cpattn.comm.launch.spawn`, in its own process: heartbeat, rendezvous, ``fn``, its result file.

The rank makes its own process group (the parent ends it and everything it
started at once), dies with the parent (Linux), stamps its heartbeat every
``BEAT_S`` seconds, meets the others through a ``FileStore`` in the run's
private directory and writes ``{"ok": True, "result": ...}`` or the error
with its traceback to ``rank<r>.pt`` (atomically).
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback

import torch

BEAT_S = 0.5  # heartbeat period of every rank


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker(rank, world_size, parent, backend, threads, timeout_s, out_dir, beats, fn, args, kwargs, here=None):
    os.setpgrp()  # own process group: the parent ends this rank and everything it started at once
    _die_with_parent()  # forked from a forkserver: its death (which follows the parent's) ends this rank
    if not _alive(parent):  # the parent died while this rank started (before the death signal was armed)
        os._exit(1)
    if here is not None:  # the spawning process's environment, import path and directory, now
        env, path, cwd = here
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.chdir(cwd)
    if fn is None:  # the job by value (a forkserver start): bytes this rank's own parent pickled
        fn, args, kwargs = pickle.loads(args)  # noqa: S301
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
