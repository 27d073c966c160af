"""The Mooncake pool backend for real: a master on 127.0.0.1 started by `cpattn pool serve`, TCP transport.

Skips (with the reason) only when Mooncake's Python module cannot be
imported, e.g. without Debian's libibverbs1; scripts/setup.sh installs it
when run as root, so CI runs these.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from pool_blocks import random_blocks, same_blocks

from cpattn.pool import PoolIdentity, PoolUnavailableWarning, block_keys, codec, open_pool
from cpattn.pool.mooncake_store import free_port, mooncake_unavailable_reason

REASON = mooncake_unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"Mooncake Store unavailable: {REASON}"), pytest.mark.slow]

IDENT = PoolIdentity("tiny-mooncake", torch.bfloat16, num_layers=4, block_size=16, row_width=64)
BLOB = codec.encoded_size(IDENT.dtype, IDENT.block_shape)  # ~8 KiB
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def blocks(n, seed=0):
    return random_blocks(IDENT, n, seed)


same = same_blocks


class Served:
    """`python -m cpattn.pool.server` in a subprocess: its port and its master's pid."""

    def __init__(self, memory="64MiB", lease_ms=50):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cpattn.pool.server", "--port", str(self.port), "--memory", memory,
             "--lease-ttl-ms", str(lease_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
        )
        line = self._readline(90)
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"cpattn pool serve did not start: {line!r}")
        self.line = line
        self.master_pid = int(line.split("master pid ")[1].split(",")[0])
        self.spec = f"mooncake:127.0.0.1:{self.port}"

    def _readline(self, timeout_s):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else ""

    def stop(self, sig=signal.SIGTERM, timeout_s=20):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.kill_master()  # never leave a master behind
        return self.proc.returncode

    def kill_master(self):
        """SIGKILL our master, checking first that the pid still names a mooncake_master."""
        try:
            with open(f"/proc/{self.master_pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"mooncake_master" in cmdline and f"-rpc_port={self.port}".encode() in cmdline:
                os.kill(self.master_pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            pass


@pytest.fixture(scope="module")
def served():
    s = Served(memory="32MiB", lease_ms=300)  # short leases: eviction frees space fast
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pool(served):
    p = open_pool(served.spec, IDENT)
    assert p.available
    yield p
    p.close()


FIRST_RUN = textwrap.dedent("""
    import sys, torch
    from cpattn.pool import PoolIdentity, open_pool
    ident = PoolIdentity("tiny-mooncake", torch.bfloat16, num_layers=4, block_size=16, row_width=64)
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(ident.block_shape, generator=g).to(ident.dtype) for _ in range(5)]
    pool = open_pool(sys.argv[1], ident)
    keys = pool.keys(list(range(16 * 5 + 3)))
    print(pool.lookup(keys), pool.store(keys, data), flush=True)
    pool.close()
""")


def test_second_process_finds_what_a_first_one_stored(served):
    out = subprocess.run([sys.executable, "-c", FIRST_RUN, served.spec], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "5"]  # cold, then stored five blocks, and exited
    with open_pool(served.spec, IDENT) as pool:
        keys = pool.keys(list(range(16 * 5 + 3)))
        assert pool.lookup(keys) == 5
        assert same(pool.load(keys), blocks(5, seed=7))


def test_round_trip_and_put_if_absent(pool):
    keys = pool.keys(list(range(1000, 1000 + 16 * 3)))
    data = blocks(3, seed=1)
    assert pool.lookup(keys) == 0 and pool.load(keys) == []
    assert pool.store(keys, data) == 3
    assert pool.store(keys, blocks(3, seed=2)) == 0  # present: skipped, first entry stays
    # a raw second writer of the same key cannot replace it either
    assert pool.backend.put(keys[:1], [codec.encode(keys[0], blocks(1, seed=3)[0])]) == [True]
    assert same(pool.load(keys), data)


def test_concurrent_writers_of_the_same_keys(served):
    keys = block_keys(list(range(5000, 5000 + 16 * 20)), IDENT)
    errors = []

    def write(value):
        try:
            with open_pool(served.spec, IDENT) as p:
                for k in keys:
                    p.store([k], [torch.full(IDENT.block_shape, value, dtype=IDENT.dtype)])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    with open_pool(served.spec, IDENT) as p:
        got = p.load(keys)
        assert len(got) == 20 and p.stats.corrupt == 0
        for t in got:
            v = t.view(-1)[0].item()
            assert v in (1.0, 2.0) and torch.equal(t, torch.full_like(t, v))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-dtype"])
def test_damaged_entry_is_a_miss_and_is_dropped(pool, damage):
    keys = pool.keys([len(damage)] + list(range(16 * 3 - 1)))  # a request of its own per case
    data = blocks(3, seed=4)
    corrupt = pool.stats.corrupt
    pool.store(keys[:2], data[:2])
    good = codec.encode(keys[2], data[2])
    bad = {
        "garbage": os.urandom(len(good)),
        "truncated": bytes(good[: len(good) // 2]),
        "other-dtype": codec.encode(keys[2], data[2].view(torch.float16)),
    }[damage]
    assert pool.backend.put(keys[2:], [bad]) == [True]
    assert pool.lookup(keys) == 3
    assert same(pool.load(keys), data[:2])
    assert pool.stats.corrupt == corrupt + 1 and pool.lookup(keys) == 2  # dropped
    assert pool.store(keys[2:], data[2:]) == 1 and same(pool.load(keys), data)


def test_batches_larger_than_the_transfer_buffer(served):
    ident = PoolIdentity("tiny-mooncake-5mib", torch.bfloat16, num_layers=40, block_size=64, row_width=1024)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(ident.block_shape, generator=g).to(ident.dtype) for _ in range(5)]  # 5 x 5 MiB
    with open_pool(served.spec, ident, local_buffer_bytes=16 << 20) as pool:  # 25 MiB > one 16 MiB buffer
        keys = pool.keys(list(range(64 * 5)))
        assert pool.store(keys, data) == 5
        assert same(pool.load(keys), data)


def test_eviction_under_the_memory_limit(served):
    ident = PoolIdentity("tiny-mooncake-big", torch.bfloat16, num_layers=8, block_size=64, row_width=1024)
    blob = codec.encoded_size(ident.dtype, ident.block_shape)  # ~1 MiB
    with open_pool(served.spec, ident) as pool:
        keys = [pool.keys([i] * 64)[0] for i in range(80)]  # 80 MiB through a 32 MiB pool
        data = [torch.full(ident.block_shape, float(i), dtype=ident.dtype) for i in range(80)]
        stored = sum(pool.store([k], [d]) for k, d in zip(keys, data))
        assert same(pool.load(keys[-1:]), data[-1:])  # the newest block is kept (still under lease)
        present = [i for i, p in enumerate(pool.backend.exists(keys)) if p]
        assert stored > (32 << 20) // blob  # eviction made room for more than fit at once
        assert len(present) * blob <= 32 << 20  # never more than the memory
        for i in present:  # eviction may still run: a block is then a miss, never other data
            got = pool.load([keys[i]])
            assert got == [] or same(got, [data[i]])


def test_master_killed_mid_run_degrades_to_misses_with_one_warning():
    served = Served()
    try:
        pool = open_pool(served.spec, IDENT)
        keys = pool.keys(list(range(16 * 4)))
        assert pool.store(keys, blocks(4)) == 4 and pool.lookup(keys) == 4
        served.kill_master()
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            results = [pool.lookup(keys), pool.load(keys), pool.store(keys, blocks(4)), pool.lookup(keys)]
            pool.close()
        assert results == [0, [], 0, 0]
        assert [type(x.message) for x in w] == [PoolUnavailableWarning]
        assert time.monotonic() - t0 < 30  # bounded: one failing call, then no store traffic
        assert served.proc.wait(30) == 1  # the server notices its master died and exits 1
    finally:
        served.stop()


def test_no_master_is_one_warning_and_a_cold_pool():
    port = free_port()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pool = open_pool(f"mooncake:127.0.0.1:{port}", IDENT)
        assert pool.lookup(pool.keys(list(range(32)))) == 0
    assert [type(x.message) for x in w] == [PoolUnavailableWarning] and not pool.available
    assert time.monotonic() - t0 < 10


def test_second_server_on_a_port_in_use_fails_at_once_naming_the_port(served):
    t0 = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "cpattn.pool.server", "--port", str(served.port), "--memory", "16MiB"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )
    assert second.returncode == 1, (second.returncode, second.stdout, second.stderr)
    assert "serving" not in second.stdout, second.stdout
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {served.port} on 127.0.0.1 is in use" in lines[0], second.stderr
    assert time.monotonic() - t0 < 30  # at once (interpreter start-up only), not after attaching to the first
    assert served.proc.poll() is None  # the first server is untouched and still serves
    with open_pool(served.spec, IDENT) as pool:
        keys = pool.keys(list(range(16)))
        assert pool.store(keys, blocks(1, seed=5)) in (0, 1) and same(pool.load(keys), blocks(1, seed=5))


def test_serve_stops_cleanly_on_sigterm(served):
    assert served.line.startswith(f"cpattn pool serving: mooncake:127.0.0.1:{served.port} (32 MiB")
    assert served.stop(signal.SIGTERM) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(served.master_pid, 0)  # the master is gone too

