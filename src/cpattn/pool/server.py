"""``cpattn pool serve``: a Mooncake master plus a long-lived process holding the pool's memory.

A Mooncake client's objects live in the memory segment that client mounts
and vanish when it exits, so a pool that outlives one run needs a process
that only contributes memory. This command is that process:

1. checks that ``--host:--port`` is free -- a port in use (another pool
   server, or any program) ends it at once with one line naming the port
   and exit status 1 (an environment error; 2 stays for usage errors) --
   then starts ``mooncake_master`` there (127.0.0.1:50051 by default; its
   admin server on a free port of the same host);
2. mounts ``--memory`` bytes (default 1 GiB) into the pool as a Mooncake
   client of that master;
3. prints one line saying how to connect -- ``cpattn pool serving:
   mooncake:127.0.0.1:50051 ...`` -- and waits. Mooncake's transfer engine
   listens on every interface whatever ``--host`` says (no setting of
   this release binds it): a second line on stderr names those sockets,
   unless the server runs in a network namespace with only loopback
   (then the first line says how engines join it; docs/kv_pool.md,
   "Security");
4. on SIGINT or SIGTERM unmounts the memory, stops the master and exits 0;
   if the master dies it exits 1.

Engines then connect with ``MooncakeStore("127.0.0.1:50051")`` (or the
spec ``mooncake:127.0.0.1:50051``) and contribute no memory themselves, so
a second run finds what the first stored.

Example
-------
>>> main(["--port", "50051", "--memory", "2GiB"])  # doctest: +SKIP
cpattn pool serving: mooncake:127.0.0.1:50051 (2048 MiB, master pid 1234, lease 1000 ms); Ctrl-C stops it
0
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import socket
import sys
import threading

from cpattn.config import cli_args as cli

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"512MiB"`` / ``"2GiB"`` / ``"1048576"`` -> bytes (binary units).

    >>> parse_bytes("2GiB"), parse_bytes("16m"), parse_bytes("100")
    (2147483648, 16777216, 100)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a size such as 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


port = cli.port  # argparse type: a TCP port, 1..65535 (:func:`cpattn.config.cli_types.port`)


def port_in_use(host: str, port: int) -> bool:
    """Whether a socket already listens on ``host:port`` (a test bind, as a server would do it).

    >>> import socket
    >>> s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    >>> port_in_use("127.0.0.1", s.getsockname()[1])
    True
    >>> s.close()
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: a TIME_WAIT socket is no conflict
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def exposure_warning(pid: int | None = None) -> str | None:
    """What of ``pid``'s process tree (default: this one) listens beyond loopback, as one warning; None if nothing.

    Mooncake's transfer engine (every client's, the memory holder's too) listens on every interface
    whatever ``local_hostname`` says, and serves the registered memory without authentication
    (docs/kv_pool.md, "Security"). Inside a network namespace with only ``lo`` nothing is reachable
    from beyond loopback, and this returns None.

    >>> exposure_warning() is None or exposure_warning().startswith("warning: ")
    True
    """
    from cpattn.comm.listeners import process_tree, reachable_beyond_loopback
    from cpattn.pool.mooncake_store import mooncake_version

    exposed = reachable_beyond_loopback(process_tree(pid or os.getpid()))
    if not exposed:
        return None
    names = ", ".join(str(x) for x in exposed)
    return (f"warning: Mooncake {mooncake_version()}'s transfer engine also listens on every interface ({names}) "
            f"and serves the pool's memory there without authentication; no setting of this release binds it to "
            f"--host. Run the server and its engines in one loopback-only network namespace (docs/kv_pool.md, "
            "'Security')")


def parser() -> argparse.ArgumentParser:
    p = cli.parser("cpattn pool serve", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="address the master and the memory holder use")
    p.add_argument("--port", type=port, default=50051, help="the master's RPC port")
    p.add_argument("--memory", type=parse_bytes, default=1 << 30, metavar="SIZE",
                   help="pool memory to contribute, e.g. 512MiB or 2GiB (default: 1GiB)")
    p.add_argument("--lease-ttl-ms", type=cli.positive_int, default=1000, metavar="MS",
                   help="how long a read or written object is protected from eviction")
    p.add_argument("--master-log", default=None, metavar="PATH", type=cli.output_file,
                   help="file for mooncake_master's log (default: discarded)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the pool server until SIGINT / SIGTERM; returns the exit status (0 stopped, 1 failed, 2 unusable)."""
    args = parser().parse_args(argv)
    from cpattn.comm.listeners import loopback_only_namespace
    from cpattn.pool.base import StoreUnavailable
    from cpattn.pool.mooncake_store import MooncakeStore, mooncake_unavailable_reason, start_master, stop_process

    reason = mooncake_unavailable_reason()
    if reason:
        print(f"cpattn pool serve: {reason}", file=sys.stderr)
        return 2
    try:
        in_use = port_in_use(args.host, args.port)
    except OSError as err:
        print(f"cpattn pool serve: --host {args.host!r} cannot be bound here ({err}); give an address of this "
              "machine, e.g. 127.0.0.1", file=sys.stderr)
        return 2
    if in_use:
        print(f"cpattn pool serve: port {args.port} on {args.host} is in use (another pool server or program "
              f"listens there); stop it or choose another --port", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    master = None
    holder = None
    try:
        master = start_master(args.port, host=args.host, lease_ttl_ms=args.lease_ttl_ms, log_path=args.master_log)
        holder = MooncakeStore(f"{args.host}:{args.port}", segment_bytes=args.memory, host=args.host)
        where = ""
        if loopback_only_namespace():
            where = f"; loopback-only network namespace, engines join it with: nsenter --net=/proc/{os.getpid()}/ns/net"
        print(
            f"cpattn pool serving: mooncake:{args.host}:{args.port} ({args.memory >> 20} MiB, "
            f"master pid {master.pid}, lease {args.lease_ttl_ms} ms){where}; Ctrl-C stops it",
            flush=True,
        )
        exposed = exposure_warning()
        if exposed:
            print(f"cpattn pool serve: {exposed}", file=sys.stderr, flush=True)
        while not stop.wait(0.2):
            if master.poll() is not None:
                print(f"cpattn pool serve: mooncake_master exited with {master.returncode}", file=sys.stderr,
                      flush=True)
                return 1
        return 0
    except (RuntimeError, StoreUnavailable, OSError) as err:
        print(f"cpattn pool serve: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        if holder is not None and master is not None and master.poll() is None:
            holder.close()  # unmounting needs the master; after its death the OS frees the memory
        if master is not None:
            stop_process(master)
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
