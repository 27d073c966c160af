"""An in-process simulated mesh: one thread per rank, real message passing.

:func:`simulate` is the reference semantics of a sharded program, in the
spirit of JAX's ``shard_map``: ``[fn(group_r, *args) for r in range(N)]``,
except that the ranks run concurrently and talk through :class:`SimGroup`
collectives. Every message carries the collective's kind and sequence number,
so ranks that call different collectives fail with a clear error instead of
exchanging the wrong data; a rank that waits longer than ``timeout_s`` for a
peer raises :class:`CommTimeout`; when one rank raises, the others stop and
:func:`simulate` re-raises the first error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from cpattn.comm.group import Group, Pending


class CommTimeout(TimeoutError):
    """A rank waited too long for a peer (dead, hung, or in another collective)."""


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives, or the same one with incompatible tensors."""


class PeerFailed(RuntimeError):
    """Another rank of the simulated mesh raised; this rank stops too."""


class SimMesh:
    """Shared state of ``size`` simulated ranks: one FIFO mailbox per ordered pair for collectives, one
    for point-to-point messages, and the sub-meshes :meth:`SimGroup.split` made."""

    def __init__(self, size: int, timeout_s: float = 120.0):
        if size < 1:
            raise ValueError(f"world_size must be >= 1; got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._boxes(size)
        self.failed = threading.Event()
        self.failure: tuple[int, BaseException] | None = None

    def _boxes(self, size: int) -> None:
        self.boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.p2p = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.lock = threading.Lock()
        self.splits: dict[int, tuple[tuple[int, ...], SimMesh]] = {}  # split call number -> (ranks, sub-mesh)

    def groups(self) -> list[SimGroup]:
        return [SimGroup(self, r) for r in range(self.size)]


class _SubMesh(SimMesh):
    """The mesh of a sub-group: its own mailboxes, the parent's failure (a rank that raises stops them all)."""

    def __init__(self, parent: SimMesh, size: int):
        self.size, self.timeout_s, self.parent = size, parent.timeout_s, parent
        self._boxes(size)
        self.failed = parent.failed

    @property
    def failure(self):
        return self.parent.failure

    @failure.setter
    def failure(self, value):
        self.parent.failure = value


class SimGroup(Group):
    """Rank ``rank`` of a :class:`SimMesh`. Messages are cloned when sent."""

    def __init__(self, mesh: SimMesh, rank: int):
        super().__init__()
        self.mesh, self.rank, self.size = mesh, rank, mesh.size
        self._seq = 0
        self._p2p_seq: dict[tuple[str, int], int] = {}  # ("to" | "from", peer) -> messages so far
        self._splits = 0

    # -- point to point with checks -------------------------------------------
    def _send(self, dst: int, tag: tuple, x: torch.Tensor) -> None:
        self.mesh.boxes[(self.rank, dst)].put((tag, x.clone()))

    def _recv(self, src: int, tag: tuple, boxes: dict | None = None) -> torch.Tensor:
        box = (self.mesh.boxes if boxes is None else boxes)[(src, self.rank)]
        deadline = time.monotonic() + self.mesh.timeout_s
        while True:
            if self.mesh.failed.is_set():
                bad, err = self.mesh.failure
                raise PeerFailed(f"rank {self.rank} stopped: rank {bad} raised {type(err).__name__}: {err}")
            try:
                got_tag, x = box.get(timeout=0.05)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise CommTimeout(
                        f"rank {self.rank} waited {self.mesh.timeout_s:.0f}s for rank {src} in "
                        f"{tag[0]} (call #{tag[1]}); the peer is dead, hung, or in another collective"
                    ) from None
        if got_tag != tag:
            raise CollectiveMismatch(
                f"rank {self.rank} is in {tag[0]} (call #{tag[1]}) but rank {src} sent "
                f"{got_tag[0]} (call #{got_tag[1]}); every rank must call the same collectives in the same order"
            )
        return x

    def _tag(self, kind: str) -> tuple:
        self._seq += 1
        return (kind, self._seq)

    def _exchange(self, kind: str, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send chunks[j] to rank j, return what every rank sent here (rank order)."""
        tag = self._tag(kind)
        for j in range(self.size):
            if j != self.rank:
                self._send(j, tag, chunks[j])
        return [chunks[j] if j == self.rank else self._recv(j, tag) for j in range(self.size)]

    def _check_same(self, kind: str, got: list[torch.Tensor]) -> None:
        mine = got[self.rank]
        for j, x in enumerate(got):
            if x.shape != mine.shape or x.dtype != mine.dtype:
                raise CollectiveMismatch(
                    f"{kind}: rank {j} sent {tuple(x.shape)} {x.dtype} but rank {self.rank} has "
                    f"{tuple(mine.shape)} {mine.dtype}; {kind} needs equal shapes and dtypes on every rank"
                )

    # -- collectives -------------------------------------------------------------
    def _all_gather(self, x):
        got = self._exchange("all_gather", [x] * self.size)
        self._check_same("all_gather", got)
        return torch.cat(got, 0)

    def _reduce_scatter(self, x):
        got = self._exchange("reduce_scatter", list(x.chunk(self.size, 0)))
        self._check_same("reduce_scatter", got)
        return torch.stack(got).sum(0)  # summed in rank order: identical on every rank

    def _all_to_all(self, x):
        got = self._exchange("all_to_all", list(x.chunk(self.size, 0)))
        self._check_same("all_to_all", got)
        return torch.cat(got, 0)

    def _all_reduce(self, x):
        got = self._exchange("all_reduce", [x] * self.size)
        self._check_same("all_reduce", got)
        return torch.stack(got).sum(0)

    def _ring_start(self, x, recv, shift):
        tag = self._tag(f"ring(shift={shift})")
        self._send((self.rank + shift) % self.size, tag, x)
        src = (self.rank - shift) % self.size

        def finish():
            got = self._recv(src, tag)
            if got.shape != recv.shape or got.dtype != recv.dtype:
                raise CollectiveMismatch(
                    f"ring: rank {self.rank} expected {tuple(recv.shape)} {recv.dtype} from rank {src} "
                    f"but got {tuple(got.shape)} {got.dtype}"
                )
            return got

        return Pending(finish)

    # -- point to point and sub-groups ------------------------------------------
    def _p2p_tag(self, way: str, peer: int) -> tuple:
        n = self._p2p_seq.get((way, peer), 0) + 1
        self._p2p_seq[(way, peer)] = n
        return ("p2p", n)

    def _p2p_send(self, x, dst):
        self.mesh.p2p[(self.rank, dst)].put((self._p2p_tag("to", dst), x.clone()))

    def _p2p_recv(self, out, src):
        got = self._recv(src, self._p2p_tag("from", src), self.mesh.p2p)
        if got.shape != out.shape or got.dtype != out.dtype:
            raise CollectiveMismatch(
                f"recv: rank {self.rank} expected {tuple(out.shape)} {out.dtype} from rank {src} but it sent "
                f"{tuple(got.shape)} {got.dtype}; pass recv the shape and dtype the sender's send had")
        return got

    def _split(self, ranks):
        self._splits += 1
        with self.mesh.lock:
            listed, sub = self.mesh.splits.setdefault(self._splits, (tuple(ranks), _SubMesh(self.mesh, len(ranks))))
        if listed != tuple(ranks):
            raise CollectiveMismatch(
                f"split (call #{self._splits}): rank {self.rank} lists ranks {list(ranks)} but another rank listed "
                f"{list(listed)}; every rank must call split with the same ranks")
        return SimGroup(sub, ranks.index(self.rank)) if self.rank in ranks else None


def simulate(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list:
    """Run ``fn(group, *args, **kwargs)`` on ``world_size`` simulated ranks; return the per-rank results.

    Arguments
    ---------
    world_size: number of ranks (threads). ``fn`` selects its shard with
        ``group.rank``; every rank gets the same ``args``/``kwargs``.
    timeout_s: how long a rank waits for a peer before :class:`CommTimeout`
        (a reserved keyword, not passed to ``fn``).

    Returns
    -------
    ``[result of rank 0, ..., result of rank world_size-1]``. If any rank
    raises, the first error is re-raised here (its rank in the message).

    Example
    -------
    >>> import torch, cpattn
    >>> cpattn.simulate(3, lambda g, x: g.all_reduce(x * g.rank), torch.ones(2))
    [tensor([3., 3.]), tensor([3., 3.]), tensor([3., 3.])]
    """
    mesh = SimMesh(world_size, timeout_s)
    return run_ranks(mesh, mesh.groups(), lambda g: fn(g, *args, **kwargs), what="simulate")


def run_ranks(mesh: SimMesh, groups: list[SimGroup], fn: Callable[[SimGroup], Any], *, what: str = "simulate") -> list:
    """Run ``fn(groups[r])`` on a thread per rank of ``mesh`` (groups kept across calls, e.g. an engine's
    step after step); the per-rank results, or the first error re-raised as ``RuntimeError`` naming ``what``
    and the rank (the mesh's failure flag stops the other ranks' waits).

    >>> mesh = SimMesh(2); groups = mesh.groups()
    >>> [run_ranks(mesh, groups, lambda g: int(g.all_reduce(torch.ones(1)))) for _ in range(2)]
    [[2, 2], [2, 2]]
    """
    n = len(groups)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(r: int) -> None:
        try:
            results[r] = fn(groups[r])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[r] = e
            if not mesh.failed.is_set() and not isinstance(e, PeerFailed):
                mesh.failure = (r, e)
                mesh.failed.set()

    if n == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if mesh.failure is not None:
        r, e = mesh.failure
        raise RuntimeError(f"{what}: rank {r} of {n} raised {type(e).__name__}: {e}") from e
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"{what}: rank {r} of {n} raised {type(e).__name__}: {e}") from e
    return results
