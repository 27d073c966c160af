"""``cpattn serve`` on gloo ranks: started by this command (``mp``) or by torchrun (``external_launcher``).

``mp`` (:func:`launch`): ``--dcp N`` rank processes (one-server P/D: ``--pcp + --dcp``, :func:`world_size`) from
:func:`cpattn.comm.launch.spawn` (a forkserver start; they meet through a
private FileStore, gloo on loopback), each running
:func:`cpattn.serve.run.serve_rank`: rank 0 serves HTTP on ``--host`` /
``--port`` and mirrors each turn's engine calls to the others
(:mod:`cpattn.serve.ranks`). The ranks run in their own process groups, so
a signal to this command reaches only it: SIGINT / SIGTERM append a line to
a stop file in a private temporary directory (mode 0700), which rank 0
watches; the first stops its HTTP server gracefully (open requests finish),
a second at once. The command exits with rank 0's status (0 after a signal);
a rank that raises or dies ends every rank (spawn's watch) and the command
says so in one line, exit 1.

``external_launcher`` (:func:`torchrun_rank`): every torchrun worker runs
``cpattn serve`` (``--dcp`` workers; one-server P/D: ``--pcp + --dcp``, the same
:class:`~cpattn.serve.pd_ranks.RankPD` as ``mp``); the world comes from torchrun's environment
(:func:`cpattn.comm.dist.init_from_env`, gloo). Rank 0 serves and takes
torchrun's (or the terminal's) signals as the one-process server does; the
other ranks ignore SIGINT / SIGTERM and stop when rank 0's last turn says so. With a loopback
``MASTER_ADDR`` gloo's pairs listen on loopback (``GLOO_SOCKET_IFNAME=lo`` unless already set).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading

from cpattn.config import cli_args as cli
from cpattn.serve.run import PROG, request_stop, serve_rank

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TIMEOUT_S = 600.0  # spawn's bound on a silent rank and on one collective (an idle rank 0 sends a turn every 0.5 s)


def launch(a, sched) -> int:
    """``--distributed-executor-backend mp``: start the ranks, wait for them (module docstring)."""
    from cpattn.comm.launch import SpawnError, spawn

    n = world_size(a)
    got: dict = {}
    with tempfile.TemporaryDirectory(prefix="cpattn-serve-") as tmp:
        stop = os.path.join(tmp, "stop")

        def run() -> None:  # off the main thread: spawn then leaves the signals to this function
            try:
                got["results"] = spawn(n, serve_rank, a, sched, stop, timeout_s=TIMEOUT_S)
            except BaseException as e:  # noqa: BLE001 - reported below
                got["error"] = e

        previous = {s: signal.signal(s, lambda signum, frame: request_stop(stop))
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            t = threading.Thread(target=run, name="cpattn-serve-ranks", daemon=True)
            t.start()
            while t.is_alive():
                t.join(0.2)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    if "error" in got:
        e = got["error"]
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"{PROG}: the ranks failed: {first}", file=sys.stderr)
        if isinstance(e, SpawnError) and e.failures and getattr(e.failures[0], "traceback", None):
            print(e.failures[0].traceback, file=sys.stderr)
        return 1
    return _status(got["results"][0])


def world_size(a) -> int:
    """The ranks of the flags' layout: ``--dcp``, or ``--pcp + --dcp`` for one-server P/D (``kv_both``).

    >>> from types import SimpleNamespace as NS
    >>> world_size(NS(prefill_context_parallel_size=2, decode_context_parallel_size=1,
    ...               kv_transfer_config={"kv_role": "kv_both"}))
    3
    """
    dcp = a.decode_context_parallel_size
    pd = (a.kv_transfer_config or {}).get("kv_role") == "kv_both"
    return a.prefill_context_parallel_size + dcp if pd else dcp


def torchrun_rank(a, sched) -> int:
    """``--distributed-executor-backend external_launcher``: this torchrun worker's part (module docstring)."""
    from cpattn.comm.dist import init_from_env

    if os.environ.get("MASTER_ADDR") in LOOPBACK and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo's pairs on loopback too
    world = init_from_env("gloo", timeout_s=TIMEOUT_S)
    if world.rank > 0:  # rank 0 decides when the world stops
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    try:
        return _status(serve_rank(world, a, sched))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _status(result: dict) -> int:
    if "refused" in result:
        cli.usage_error(PROG, result["refused"])
    return result["status"]
