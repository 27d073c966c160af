"""The distributed pool backend: Mooncake Store (``mooncake-transfer-engine-non-cuda``).

Facts this module rests on (from the package itself, version 0.3.13):

- ``mooncake_master`` (a binary inside the ``mooncake`` package) keeps the
  object index and decides placement and eviction. Started here with
  ``-rpc_address=127.0.0.1 -rpc_port=P -metrics_host=127.0.0.1
  -metrics_port=Q -enable_metric_reporting=false -default_kv_lease_ttl=MS``.
- Clients are ``mooncake.store.MooncakeDistributedStore`` objects set up
  with ``setup(local_hostname, metadata_server, global_segment_size,
  local_buffer_size, protocol, rdma_devices, master_server_addr)``. We use
  the TCP transport and ``metadata_server="P2PHANDSHAKE"`` (peers exchange
  segment descriptors directly; no etcd or HTTP metadata server is needed;
  the master's own HTTP metadata server binds every interface whatever its
  host flag says, so it is not used).
- ``global_segment_size`` is the memory a client *contributes* to the
  pool; objects are placed in the contributed segments and vanish when the
  client that mounted them exits. Pool clients here contribute nothing by
  default (``segment_bytes=0``): a long-lived process contributes the
  memory (:mod:`cpattn.pool.server`, ``cpattn pool serve``).
- ``put`` of a key that exists returns 0 and keeps the first value (first
  writer wins); ``batch_is_exist`` gives 1 / 0 per key, or a negative code;
  ``get_batch`` returns ``b""`` for a key it cannot read; ``remove(key,
  force=True)`` drops an object even under lease. Error codes seen: -900
  (RPC to the master failed), -200 (no space in the segments, until the
  master's background eviction frees some), -800 (transfer from the
  segment's owner failed), -704 (no such object).
- Eviction is the master's: above ``eviction_high_watermark_ratio`` (0.9) of
  the segments it evicts ``eviction_ratio`` (5 %) of the objects, oldest
  lease first; an object under lease (``default_kv_lease_ttl`` after a
  put or read) is not evicted. A put that finds no space is retried here for
  ``put_retry_s`` while eviction runs, then reported as not kept. A read
  whose transfer outlasts the lease fails (``LEASE_EXPIRED``): a miss, so the
  lease must be well above one block's transfer time (``cpattn pool serve``
  uses 1 s; a 9 MiB block moves in ~50 ms here).
- With the master gone a call fails with -900 within about 4.5 s (the
  client's own RPC timeouts); setting a client up against a missing master
  retries ``MC_STORE_CLIENT_SETUP_RETRIES`` times (default 20, ~90 s), which
  is set to 1 here unless the environment says otherwise, after a 2 s TCP
  probe of the master's port.
- Every client's transfer engine (the memory holder's of ``cpattn pool
  serve`` and every engine's) opens two listeners on all interfaces,
  whatever ``local_hostname`` says: the handshake listener
  (``findAvailableTcpPort`` and the socket handshake plugin bind
  ``INADDR_ANY`` / ``in6addr_any``) and the TCP transport's acceptor (asio,
  ``[::]`` dual-stack, else ``0.0.0.0``). They serve registered memory
  without authentication. No setting narrows them: ``MC_TCP_BIND_ADDRESS``
  only names the address *advertised* in the metadata-server mode,
  ``MC_LEGACY_RPC_PORT_BINDING`` only the advertised port; true of 0.3.13.post1
  (newest on the registry, both the ``-non-cuda`` and the CUDA wheel) and of the
  project's source as of 2026-08. Mitigation: a loopback-only network
  namespace (docs/kv_pool.md, "Security"). The master itself binds
  ``-rpc_address`` and ``-metrics_host`` as asked.
- The Python module links ``libibverbs.so.1`` (Debian package
  ``libibverbs1``) even for TCP; without it the import fails.

Example
-------
>>> from cpattn.pool.mooncake_store import MooncakeStore, start_master, free_port
>>> port = free_port()
>>> master = start_master(port)  # doctest: +SKIP
>>> store = MooncakeStore(f"127.0.0.1:{port}", segment_bytes=64 << 20)  # doctest: +SKIP
>>> store.put(["k"], [b"v"]), store.get(["k"])  # doctest: +SKIP
([True], [b'v'])
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from collections.abc import Sequence

from cpattn.pool.base import StoreUnavailable

RPC_FAIL = -900
NO_SPACE = -200
INSTALL_HINT = (
    "pip install 'cpattn[pool]' (mooncake-transfer-engine-non-cuda) and, on Debian/Ubuntu, "
    "apt-get install libibverbs1 (scripts/setup.sh does both when run as root)"
)


def _package_dir() -> str | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def mooncake_unavailable_reason() -> str | None:
    """Why the Mooncake backend cannot run here (a sentence), or None when it can.

    >>> isinstance(mooncake_unavailable_reason(), (str, type(None)))
    True
    """
    try:
        store_class()
    except ImportError as err:
        return str(err)
    if not os.path.exists(master_binary(check=False)):
        return f"the mooncake package has no mooncake_master binary; {INSTALL_HINT}"
    return None


def store_class():
    """``mooncake.store.MooncakeDistributedStore``, or ImportError with the reason and the fix."""
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines would fill reports; failures reach us as
    # return codes (set MC_LOG_LEVEL=INFO to see its whole log)
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - optional dependency
    except ImportError as err:
        raise ImportError(f"Mooncake Store is not importable ({err}); {INSTALL_HINT}") from err
    return MooncakeDistributedStore


def master_binary(check: bool = True) -> str:
    """Path of the ``mooncake_master`` binary shipped in the mooncake package."""
    d = _package_dir()
    path = os.path.join(d, "mooncake_master") if d else ""
    if check and not os.path.exists(path):
        raise FileNotFoundError(f"mooncake_master not found (mooncake package at {d!r}); {INSTALL_HINT}")
    return path


def mooncake_version() -> str:
    """The installed Mooncake distribution's version ("unknown" when none is installed).

    >>> isinstance(mooncake_version(), str)
    True
    """
    from importlib import metadata  # noqa: PLC0415

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections on ``host:port`` (within ``timeout_s``)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_master(
    port: int,
    *,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
    lease_ttl_ms: int = 1000,
    log_path: str | None = None,
    timeout_s: float = 15.0,
) -> subprocess.Popen:
    """Start ``mooncake_master`` listening on ``host:port`` and wait until it accepts connections.

    The admin/metrics HTTP server listens on ``host:metrics_port`` (a free
    port when None). Output goes to ``log_path`` (or is discarded). Raises
    RuntimeError (after killing it) if it is not up within ``timeout_s``.
    The caller stops it (``terminate()`` then ``wait()``).
    """
    metrics_port = metrics_port or free_port(host)
    args = [
        master_binary(), f"-rpc_address={host}", f"-rpc_port={port}", f"-metrics_host={host}",
        f"-metrics_port={metrics_port}", "-enable_metric_reporting=false", "-rpc_thread_num=2",
        f"-default_kv_lease_ttl={int(lease_ttl_ms)}",
    ]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log_path:
            out.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode} at start ({' '.join(args)})")
        if port_open(host, port, 0.2) and _holds_port(proc.pid, port):
            return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"mooncake_master did not listen on {host}:{port} within {timeout_s} s")


def _holds_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port`` (not another program that answers there); True where
    ``/proc`` cannot tell."""
    if not os.path.isdir(f"/proc/{pid}/fd"):
        return True
    from cpattn.comm.listeners import listening  # noqa: PLC0415 - Linux only

    return any(x.port == port for x in listening([pid]))


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class MooncakeStore:
    """A :class:`~cpattn.pool.base.BlockStore` on a Mooncake Store cluster (TCP transport).

    Arguments
    ---------
    master: ``"HOST:PORT"`` of ``mooncake_master``.
    segment_bytes: memory this client contributes to the pool (0: none;
        its objects would vanish with it, so long-lived memory comes from
        ``cpattn pool serve``).
    local_buffer_bytes: the client's transfer buffer; batches are split to fit half of it, and
        one entry must fit (a DeepSeek-V3 block of 128 tokens is 9 MiB).
    host: this client's address for the transfer engine.
    prefix: prepended to every key (one master can serve several pools).
    put_retry_s: how long a put that finds no space waits for eviction.

    Raises StoreUnavailable when the master does not answer within a few seconds.
    """

    def __init__(
        self,
        master: str,
        *,
        segment_bytes: int = 0,
        local_buffer_bytes: int = 64 << 20,
        host: str = "127.0.0.1",
        prefix: str = "cpattn/",
        put_retry_s: float = 0.5,
    ) -> None:
        cls = store_class()
        mhost, _, mport = master.rpartition(":")
        if not mhost or not mport.isdigit():
            raise ValueError(f"master must be 'HOST:PORT'; got {master!r}")
        if not port_open(mhost, int(mport)):
            raise StoreUnavailable(f"no Mooncake master answers at {master} (start one with `cpattn pool serve`)")
        self.master, self.prefix, self.put_retry_s = master, prefix, put_retry_s
        self.segment_bytes, self.local_buffer_bytes = int(segment_bytes), int(local_buffer_bytes)
        self._client = cls()
        rc = self._client.setup(host, "P2PHANDSHAKE", self.segment_bytes, int(local_buffer_bytes), "tcp", "", master)
        if rc != 0:
            raise StoreUnavailable(f"Mooncake client setup against {master} failed with code {rc}")
        self._closed = False

    def _k(self, keys: Sequence[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def _check(self, code: int, what: str) -> None:
        if code == RPC_FAIL:
            raise StoreUnavailable(f"Mooncake master at {self.master} did not answer ({what}: code {code})")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._client.batch_is_exist(self._k(keys))
        for c in codes:
            self._check(c, "batch_is_exist")
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = self._k(keys)
        size = self._client.get_size(names[0])  # a pool's entries all have one size
        self._check(size, "get_size")
        out: list[bytes | None] = []
        for chunk in self._chunks(names, max(size, 1)):  # a batch must fit the client's transfer buffer
            out += [v if v else None for v in self._client.get_batch(chunk)]
        return out

    def _chunks(self, names: list[str], entry_bytes: int) -> list[list[str]]:
        n = max(1, self.local_buffer_bytes // 2 // entry_bytes)
        return [names[i : i + n] for i in range(0, len(names), n)]

    def put(self, keys: Sequence[str], blobs: Sequence) -> list[bool]:
        if len(keys) != len(blobs):
            raise ValueError(f"put() got {len(keys)} keys but {len(blobs)} blobs")
        if not keys:
            return []
        names = self._k(keys)
        n = len(self._chunks(names, len(blobs[0]))[0])
        rc = 0
        for i in range(0, len(names), n):  # a batch must fit the client's transfer buffer
            rc = self._client.put_batch(names[i : i + n], [memoryview(b) for b in blobs[i : i + n]])
            self._check(rc, "put_batch")
            if rc != 0:
                break
        if rc == 0:
            return [True] * len(keys)
        kept = []
        for name, blob in zip(names, blobs):  # one by one, waiting for eviction where space ran out
            deadline = time.monotonic() + self.put_retry_s
            while True:
                rc = self._client.put(name, memoryview(blob))
                self._check(rc, "put")
                if rc != NO_SPACE or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            kept.append(rc == 0)
        return kept

    def discard(self, keys: Sequence[str]) -> None:
        for name in self._k(keys):
            self._check(self._client.remove(name, True), "remove")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
