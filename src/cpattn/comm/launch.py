"""Spawn N real torch.distributed processes on this machine and collect their results.

Used by the tests (real gloo ranks), the CLI and the benchmarks. Each rank
runs ``fn(group, *args, **kwargs)`` with a :class:`~cpattn.comm.dist.DistGroup`
and ``torch.set_num_threads(threads)``; results travel back through
``torch.save`` files. A rank that raises, dies or exceeds ``timeout_s`` makes
:func:`spawn` raise with that rank's traceback, never hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


class SpawnError(RuntimeError):
    """A spawned rank failed, died, or timed out."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, threads, timeout_s, out_dir, fn, args, kwargs):
    import torch.distributed as dist

    from cpattn.comm.dist import DistGroup

    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.set_num_threads(threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            result = fn(DistGroup(), *args, **kwargs)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)


def spawn(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> list:
    """Run ``fn(group, *args, **kwargs)`` in ``world_size`` fresh processes; return per-rank results.

    ``fn`` must be importable (a module-level function) and its arguments and
    results picklable. ``threads`` sets each rank's intra-op threads.

    Example
    -------
    >>> from cpattn.comm.launch import spawn
    >>> def ranks(group):
    ...     return group.rank
    >>> spawn(2, ranks)  # doctest: +SKIP
    [0, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cpattn-spawn-") as out_dir:
        port = _free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, threads, timeout_s, out_dir, fn, args, kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 60.0  # + start-up
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                why = "timed out" if r in alive else f"died with exit code {p.exitcode}"
                errors.append(f"rank {r} {why} without a result")
                results.append(None)
                continue
            rec = torch.load(path, weights_only=False)
            if rec["ok"]:
                results.append(rec["result"])
            else:
                errors.append(f"rank {r} raised:\n{rec['error']}")
                results.append(None)
        if errors:
            raise SpawnError(f"spawn({world_size}, {getattr(fn, '__name__', fn)}) failed:\n" + "\n".join(errors))
        return results
