"""``Group``: the one communication interface every cpattn primitive takes.

All collectives are functional: a tensor goes in, a new tensor comes out, and
the input is never modified. Two implementations share this base class:
:class:`cpattn.comm.sim.SimGroup` (threads in one process, for tests and
notebooks) and :class:`cpattn.comm.dist.DistGroup` (torch.distributed
functional collectives: gloo, NCCL, HCCL).

Each group counts the logical bytes a rank sends and receives per collective
kind (what a ring or pairwise algorithm moves; the same formula for both
implementations), in ``group.stats``. Counting happens in eager code only;
inside a torch.compile trace it is skipped, since a trace runs once.

Besides the collectives, a group moves tensors point to point
(:meth:`Group.send` / :meth:`Group.recv`, counted as kind ``"p2p"``) and
splits into sub-groups (:meth:`Group.split`), which is what a P/D run needs:
its prefill ranks and decode ranks are two sub-groups of one world, and the
KV travels from one to the other point to point.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass
class CommStats:
    """Per collective kind: number of calls and logical bytes sent / received by this rank."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_recv: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, sent: int, recv: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(sent)
        self.bytes_recv[kind] = self.bytes_recv.get(kind, 0) + int(recv)

    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    def total_recv(self) -> int:
        return sum(self.bytes_recv.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.bytes_recv.clear()

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "bytes_sent": dict(self.bytes_sent), "bytes_recv": dict(self.bytes_recv)}


class Pending:
    """A ring exchange in flight; ``wait()`` returns the received tensor."""

    def __init__(self, finish):
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish()
        return self._result


class Group(abc.ABC):
    """A communication group of ``size`` ranks; this object is rank ``rank``.

    Collectives (all functional, equal shapes on every rank unless stated):

    - ``all_gather(x, dim)``: [..., n, ...] -> [..., size*n, ...], rank order.
    - ``reduce_scatter(x, dim)``: sum over ranks, rank r keeps chunk r of
      ``dim`` (``x.shape[dim] % size == 0``).
    - ``all_to_all(x, dim)``: chunk j of ``dim`` goes to rank j; the result is
      the chunks received from ranks 0..size-1, concatenated along ``dim``.
    - ``all_reduce(x)``: elementwise sum over ranks.
    - ``ring_exchange(x, recv_shape, shift=1)``: send x to ``rank+shift`` and
      receive a tensor of ``recv_shape`` from ``rank-shift``; returns a
      :class:`Pending` so compute can overlap the transfer.

    Point to point and sub-groups (ranks of this group, not of a parent):

    - ``send(x, dst)`` / ``recv(shape, dtype, src)``: one tensor from this
      rank to rank ``dst``; messages between two ranks arrive in the order
      sent. ``send`` may block until the peer receives (NCCL's does), so
      order the calls so that no cycle of ranks waits on itself.
    - ``split(ranks)``: the sub-group of the listed ranks (rank i of it is
      the i-th smallest listed); every rank calls it with the same list,
      and ranks outside the list get ``None`` (as torch.distributed's
      ``new_group``).

    Example
    -------
    >>> import torch, cpattn
    >>> cpattn.simulate(2, lambda g: g.all_gather(torch.tensor([g.rank]))[1].item())
    [1, 1]
    """

    rank: int
    size: int
    traceable: bool = False  # torch.compile can trace its collectives (torch.distributed: yes; threads: no)

    def __init__(self) -> None:
        self.stats = CommStats()

    # -- what subclasses implement (dim 0, contiguous input) -------------------
    @abc.abstractmethod
    def _all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _ring_start(self, x: torch.Tensor, recv: torch.Tensor, shift: int) -> Pending: ...

    # point to point and sub-groups: optional (a group that only prices collectives need not move tensors)
    def _p2p_send(self, x: torch.Tensor, dst: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point send; use SimGroup or DistGroup")

    def _p2p_recv(self, out: torch.Tensor, src: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point recv; use SimGroup or DistGroup")

    def _split(self, ranks: list[int]) -> Group | None:
        raise NotImplementedError(f"{type(self).__name__} cannot split into sub-groups; use SimGroup or DistGroup")

    # -- the public, dim-aware, counted interface ------------------------------
    def _count(self, kind: str, sent: float, recv: float) -> None:
        if not torch.compiler.is_compiling():
            self.stats.add(kind, int(sent), int(recv))

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        n = self.size
        self._count("all_gather", x.nbytes * (n - 1), x.nbytes * (n - 1))
        if n == 1:
            return x.clone()
        out = self._all_gather(x.movedim(dim, 0).contiguous())
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._split_dim("reduce_scatter", self._reduce_scatter, x, dim)

    def all_to_all(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._split_dim("all_to_all", self._all_to_all, x, dim)

    def _split_dim(self, kind: str, impl, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A collective that splits ``x``'s ``dim`` into one slice per rank (``impl`` on dim 0, contiguous);
        each rank sends and receives (n - 1) / n of ``x``."""
        n = self.size
        if x.shape[dim] % n:
            raise ValueError(f"{kind}: x.shape[{dim}] = {x.shape[dim]} is not divisible by the group size {n}; pad it")
        self._count(kind, x.nbytes * (n - 1) / n, x.nbytes * (n - 1) / n)
        if n == 1:
            return x.clone()
        return impl(x.movedim(dim, 0).contiguous()).movedim(0, dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        n = self.size
        self._count("all_reduce", 2 * x.nbytes * (n - 1) / n, 2 * x.nbytes * (n - 1) / n)
        if n == 1:
            return x.clone()
        return self._all_reduce(x.contiguous())

    def ring_exchange(
        self, x: torch.Tensor, recv_shape: tuple[int, ...] | torch.Size, shift: int = 1
    ) -> Pending:
        """Send ``x`` to rank ``(rank+shift) % size``, receive ``recv_shape`` from ``(rank-shift) % size``."""
        recv = x.new_empty(tuple(recv_shape))
        self._count("ring", x.nbytes, recv.nbytes)
        if self.size == 1 or shift % self.size == 0:
            same = x.clone()
            return Pending(lambda: same)
        return self._ring_start(x.contiguous(), recv, shift)

    def _peer(self, what: str, peer: int) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{what}: rank {peer!r} is not another rank of this group (rank {self.rank} of "
                             f"{self.size}); pass a rank in [0, {self.size}) other than {self.rank}")
        return peer

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` (any shape; not modified) to rank ``dst`` of this group; :meth:`recv` there takes it.

        >>> import torch, cpattn
        >>> def rank(g):
        ...     if g.rank == 0:
        ...         return g.send(torch.arange(3.), 1)
        ...     return g.recv((3,), torch.float32, 0).tolist(), g.stats.bytes_recv["p2p"]
        >>> cpattn.simulate(2, rank)
        [None, ([0.0, 1.0, 2.0], 12)]
        """
        self._peer("send", dst)
        self._count("p2p", x.nbytes, 0)
        self._p2p_send(x.contiguous(), dst)

    def recv(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        """The next tensor rank ``src`` sent here with :meth:`send`: a new tensor of ``shape`` and ``dtype``
        (the sender's must match: the simulated mesh checks it, torch.distributed trusts it)."""
        self._peer("recv", src)
        out = torch.empty(tuple(shape), dtype=dtype)
        self._count("p2p", 0, out.nbytes)
        return self._p2p_recv(out, src)

    def split(self, ranks) -> Group | None:
        """The sub-group of ``ranks`` (ranks of this group; rank i of the sub-group is the i-th smallest),
        or None on a rank not listed. Every rank of this group must call it, with the same list.

        >>> import cpattn
        >>> cpattn.simulate(3, lambda g: (lambda s: s and (s.rank, s.size))(g.split([0, 2])))
        [(0, 2), None, (1, 2)]
        """
        got = list(ranks)
        if not got or len(set(got)) != len(got) or any(
                not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.size for r in got):
            raise ValueError(f"split: ranks {got!r} must be distinct ranks of this group, in [0, {self.size}), "
                             "at least one; pass e.g. list(range(P))")
        return self._split(sorted(got))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"
