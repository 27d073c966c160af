"""Micro-benchmark of the pool backends: store and load time per block vs block size (part 1 of
``cpattn bench pool``; was ``cpattn.pool.bench``).

For each sample, every (backend, block size) pair stores ``blocks`` fresh
blocks (new keys, so every store writes) and then looks them up and loads
them; the pairs take turns within a sample (interleaved), so a slow moment of
this shared machine hits all of them alike. Reported per pair: the best
sample and the spread (median / best - 1) of milliseconds per block, and
MB/s at the best sample. No timing is asserted anywhere.

A block is ``[num_layers, block_size, row_width]`` in bfloat16: DeepSeek-V3's
latent row is 576 columns over 61 layers (V3.2 adds a 128-column indexer key).

Example
-------
>>> rows = run_bench({"dict": _dict_pool}, block_sizes=(4,), num_layers=2, row_width=8, blocks=2, samples=2)
>>> sorted(rows[0])
['backend', 'block_bytes', 'block_size', 'load_best_ms', 'load_mb_s', 'load_spread', 'store_best_ms', 'store_mb_s', 'store_spread']
>>> print(table(rows).splitlines()[0])
backend  block  MiB/blk  store ms  store spread  store MB/s  load ms  load spread  load MB/s
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from cpattn.bench.common import table as _table
from cpattn.pool import codec
from cpattn.pool.base import DictStore
from cpattn.pool.keys import PoolIdentity
from cpattn.pool.kv_pool import KVPool


def _dict_pool(ident: PoolIdentity) -> KVPool:
    return KVPool(DictStore(), ident)


def run_bench(
    backends: dict[str, Callable[[PoolIdentity], KVPool]],
    *,
    block_sizes=(16, 64, 128),
    num_layers: int = 61,
    row_width: int = 576,
    dtype: torch.dtype = torch.bfloat16,
    blocks: int = 8,
    samples: int = 5,
) -> list[dict]:
    """Time store and load per block for every backend and block size (see the module docstring).

    ``backends`` maps a name to a function that opens a :class:`KVPool` for an
    identity. Returns one dict per (backend, block size).
    """
    pools = {(name, bs): open_(PoolIdentity(f"bench-{name}", dtype, num_layers, bs, row_width))
             for name, open_ in backends.items() for bs in block_sizes}
    times: dict[tuple, dict[str, list[float]]] = {k: {"store": [], "load": []} for k in pools}
    g = torch.Generator().manual_seed(0)
    for sample in range(samples):
        for (name, bs), pool in pools.items():
            tokens = torch.randint(0, 1 << 30, (bs * blocks,), generator=g)  # fresh keys every sample
            keys = pool.keys(tokens)
            payloads = [torch.randn(pool.identity.block_shape, generator=g).to(dtype) for _ in keys]
            t0 = time.perf_counter()
            wrote = pool.store(keys, payloads)
            t1 = time.perf_counter()
            got = pool.load(keys[: pool.lookup(keys)])
            t2 = time.perf_counter()
            if wrote != len(keys) or len(got) != len(keys):
                raise RuntimeError(f"{name} block {bs}: stored {wrote}, loaded {len(got)} of {len(keys)} blocks")
            times[(name, bs)]["store"].append((t1 - t0) / len(keys))
            times[(name, bs)]["load"].append((t2 - t1) / len(keys))
    rows = []
    for (name, bs), pool in pools.items():
        nbytes = codec.encoded_size(dtype, pool.identity.block_shape)
        row = {"backend": name, "block_size": bs, "block_bytes": nbytes}
        for op in ("store", "load"):
            best, med = min(times[(name, bs)][op]), statistics.median(times[(name, bs)][op])
            row[f"{op}_best_ms"] = best * 1e3
            row[f"{op}_spread"] = med / best - 1
            row[f"{op}_mb_s"] = nbytes / best / 1e6
        rows.append(row)
        pool.close()
    return rows


COLUMNS = ["backend", "block", "MiB/blk", "store ms", "store spread", "store MB/s", "load ms", "load spread",
           "load MB/s"]


def table(rows: list[dict]) -> str:
    """The rows as the benchmarks' fixed-width table: sizes in MiB, times in ms, spreads in percent."""
    shown = [{"backend": r["backend"], "block": r["block_size"], "MiB/blk": f"{r['block_bytes'] / 2**20:.2f}",
              **{f"{op} {k}": v for op in ("store", "load") for k, v in (
                  ("ms", f"{r[f'{op}_best_ms']:.2f}"), ("spread", f"{r[f'{op}_spread']:.0%}"),
                  ("MB/s", f"{r[f'{op}_mb_s']:.0f}"))}} for r in rows]
    return _table(shown, COLUMNS)


@contextlib.contextmanager
def bench_stores(names: list[str], tmp: str):
    """``(pools, specs)``: ``pools[name](identity)`` opens a pool of the named backend ("dict"; "lmdb" in
    ``tmp``; "mooncake" served by a ``cpattn pool serve`` started here and stopped on exit, skipped with a note
    when Mooncake is unavailable); ``specs[name]`` is its ``open_pool`` spec (lmdb and mooncake)."""
    backends: dict[str, Callable] = {}
    specs: dict[str, str] = {}
    serve = None
    if "dict" in names:
        backends["dict"] = _dict_pool
    if "lmdb" in names:
        from cpattn.pool.lmdb_store import LMDBStore

        backends["lmdb"] = lambda ident: KVPool(LMDBStore(os.path.join(tmp, "lmdb"), capacity_bytes=8 << 30), ident)
        specs["lmdb"] = f"lmdb:{os.path.join(tmp, 'lmdb')}"
    if "mooncake" in names:
        from cpattn.pool.mooncake_store import MooncakeStore, free_port, mooncake_unavailable_reason

        reason = mooncake_unavailable_reason()
        if reason:
            print(f"skipping mooncake: {reason}", file=sys.stderr)
        else:
            port = free_port()
            serve = subprocess.Popen([sys.executable, "-m", "cpattn.pool.server", "--port", str(port),
                                      "--memory", "4GiB"], stdout=subprocess.PIPE, text=True)
            line = serve.stdout.readline()
            if "serving" not in line:
                serve.kill()
                raise RuntimeError(f"cpattn pool serve did not start: {line!r}")
            backends["mooncake"] = lambda ident: KVPool(MooncakeStore(f"127.0.0.1:{port}"), ident)
            specs["mooncake"] = f"mooncake:127.0.0.1:{port}"
    try:
        yield backends, specs
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)


