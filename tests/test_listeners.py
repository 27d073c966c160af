"""Nothing cpattn starts listens beyond loopback by default (issue 23, points 5 and 6).

Real processes; their sockets are read from /proc (cpattn.comm.listeners).
"""

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from cpattn.comm.launch import spawn
from cpattn.comm.listeners import listen_table, listening, loopback_only_namespace, process_tree, reachable_beyond_loopback
from cpattn.pool.mooncake_store import free_port, mooncake_unavailable_reason

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"), pytest.mark.slow]


def my_listeners(group):
    """After the group is up and a collective ran (every gloo pair connected): this rank's listening sockets."""
    group.all_reduce(torch.ones(2))
    mine = [os.getpid()]
    return [(str(x), x.loopback) for x in listening(mine)], [str(x) for x in reachable_beyond_loopback(mine)]


def test_a_local_spawn_listens_on_loopback_only():
    results = spawn(2, my_listeners, timeout_s=60)
    for rank, (listeners, exposed) in enumerate(results):
        assert exposed == [], f"rank {rank} listens beyond loopback: {exposed} (all: {listeners})"


# --- cpattn pool serve (point 5): Mooncake's transfer engine listens on every interface whatever --host says
# (no setting of this release binds it); the server says so, and a loopback-only network namespace contains it.

MOONCAKE = mooncake_unavailable_reason()
needs_mooncake = pytest.mark.skipif(MOONCAKE is not None, reason=f"Mooncake Store unavailable: {MOONCAKE}")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _serve(prefix, port):
    """`cpattn pool serve` on 127.0.0.1:port (under ``prefix``, e.g. unshare); returns (proc, serving line)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "cpattn.pool.server", "--port", str(port), "--memory", "16MiB"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 90)
    line = proc.stdout.readline() if ready else ""
    if "serving" not in line:
        _stop(proc)
        raise RuntimeError(f"cpattn pool serve did not start: {line!r} {proc.stderr.read()[-2000:]!r}")
    return proc, line


def _stop(proc):
    tree = process_tree(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in tree[1:]:  # never leave a master behind
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mooncake_master" in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    return proc.stderr.read()


def _host_addresses():
    """This machine's non-loopback IPv4 addresses, from the host namespace's routing table."""
    out = set()
    try:
        with open("/proc/net/fib_trie") as f:
            rows = f.read().splitlines()
    except OSError:
        return out
    for prev, row in zip(rows, rows[1:]):
        if "/32 host LOCAL" in row:
            addr = prev.split()[-1]
            if not addr.startswith("127."):
                out.add(addr)
    return out


def _connects(addr, port):
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


@needs_mooncake
def test_pool_serve_names_every_socket_it_opens_beyond_loopback():
    proc, line = _serve([], free_port())
    try:
        tree = process_tree(proc.pid)
        everything = listening(tree)
        exposed = reachable_beyond_loopback(tree)
        time.sleep(0.5)
    finally:
        err = _stop(proc)
    master = [x for x in everything if x.pid != proc.pid]
    assert master and all(x.loopback for x in master), everything  # the master binds the host it is given
    warning = [x for x in err.splitlines() if x.startswith("cpattn pool serve: warning:")]
    if exposed:  # this Mooncake release: the transfer engine's two listeners on every interface, named plainly
        assert len(warning) == 1 and all(str(x) in warning[0] for x in exposed), (exposed, err)
        assert "loopback-only network namespace" in warning[0] and "without authentication" in warning[0]
    else:  # a release that binds --host: no warning
        assert warning == [], err


@needs_mooncake
@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")
                                                and shutil.which("ip")),
                    reason="the namespace mitigation is tested as root with unshare, nsenter and ip")
def test_loopback_only_namespace_leaves_no_listener_reachable_beyond_loopback_and_serves_engines():
    port = free_port()
    proc, line = _serve(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"'], port)
    try:
        tree = process_tree(proc.pid)
        everything = listening(tree)
        assert loopback_only_namespace(proc.pid)
        assert f"nsenter --net=/proc/{proc.pid}/ns/net" in line, line
        assert any(not x.loopback for x in everything), everything  # the wildcard listeners exist, contained
        assert reachable_beyond_loopback(tree) == [], everything
        host_ports = {p for _, p in listen_table(os.getpid()).values()}  # what the host namespace itself listens on
        for x in everything:  # nothing of it answers from this (the host's) namespace, on any address
            if x.port not in host_ports:
                for addr in sorted({"127.0.0.1", *_host_addresses()}):
                    assert not _connects(addr, x.port), (addr, x)
        # the pool works for an engine that joins the namespace
        client = subprocess.run(
            ["nsenter", f"--net=/proc/{proc.pid}/ns/net", sys.executable, "-c",
             "import sys; from cpattn.pool.mooncake_store import MooncakeStore as M; "
             "s = M(sys.argv[1]); print(s.put(['k'], [b'abc']), s.get(['k'])); s.close()",
             f"127.0.0.1:{port}"],
            capture_output=True, text=True, env=ENV, timeout=120,
        )
        assert client.returncode == 0 and client.stdout.split("\n")[0] == "[True] [b'abc']", client.stderr[-2000:]
    finally:
        err = _stop(proc)
    assert "cpattn pool serve: warning:" not in err, err
