"""Which TCP sockets a process tree listens on, and whether anything beyond loopback can reach them (Linux).

Read from ``/proc``: a process's sockets are the ``socket:[INODE]`` links in
``/proc/PID/fd``; ``/proc/PID/net/tcp`` and ``tcp6`` (the tables of the
process's own network namespace) give each inode's local address and state.
Used by ``cpattn pool serve`` (to say which sockets a Mooncake release opens
on every interface) and by the tests that prove nothing listens beyond
loopback by default.

A listener on a wildcard address (``0.0.0.0`` / ``::``) is still reachable
from loopback only when its network namespace has no interface but ``lo``
(e.g. a namespace made with ``unshare -n``): :func:`reachable_beyond_loopback`
says so.

Example
-------
>>> import os, socket
>>> s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
>>> mine = listening([os.getpid()])
>>> any(x.port == s.getsockname()[1] and x.loopback for x in mine)
True
>>> s.close()
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: the process holding it, its local address (text) and port."""

    pid: int
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        """Bound to a loopback address (127.0.0.0/8, ::1 or ::ffff:127.x)."""
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def _decode(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:  # one little-endian 32-bit word
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (empty when it is gone or not ours to read)."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def listen_table(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN sockets in ``pid``'s network namespace."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == LISTEN:
                addr, port = cols[1].split(":")
                table[int(cols[9])] = (_decode(addr), int(port, 16))
    return table


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc/*/stat``)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(name))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    return tree


def listening(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state held by one of ``pids``."""
    out = []
    for pid in pids:
        inodes = socket_inodes(pid)
        if inodes:
            out += [Listener(pid, a, p) for ino, (a, p) in listen_table(pid).items() if ino in inodes]
    return sorted(set(out), key=lambda x: (x.pid, x.port, x.address))


def interfaces(pid: int | str = "self") -> list[str]:
    """Network interfaces of ``pid``'s network namespace (from ``/proc/PID/net/dev``)."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            rows = f.read().splitlines()[2:]
    except OSError:
        return []
    return [row.split(":", 1)[0].strip() for row in rows if ":" in row]


def loopback_only_namespace(pid: int | str = "self") -> bool:
    """Whether ``pid``'s network namespace has no interface but ``lo``.

    >>> isinstance(loopback_only_namespace(), bool)
    True
    """
    names = interfaces(pid)
    return bool(names) and set(names) == {"lo"}


def reachable_beyond_loopback(pids: Iterable[int]) -> list[Listener]:
    """The listeners of ``pids`` that something beyond loopback could connect to.

    A socket bound to a loopback address never is; a wildcard one is unless
    its process's network namespace has only ``lo``.

    >>> import os
    >>> reachable_beyond_loopback([]) == []
    True
    """
    return [x for x in listening(pids) if not x.loopback and not loopback_only_namespace(x.pid)]
