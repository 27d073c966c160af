"""A damaged LMDB pool is a cold pool with one warning, never a crash; a pool that can never be opened is one line
before any rank starts.

Damage seen on real pools: a truncated ``data.mdb`` (mapped, it killed the process with SIGBUS on the first read of a
missing page), a garbage one (``lmdb.InvalidError``), a bookkeeping record of the wrong length (``struct.error``),
``--kv-pool lmdb:FILE`` with FILE a regular file (``FileExistsError`` inside the ranks). The opens of a damaged file
run in a child process: on a store without the header check they die of SIGBUS.
"""

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from cpattn.pool import KVPool, PoolDamagedWarning, PoolIdentity, PoolUnavailableWarning, check_pool_spec, open_pool
from cpattn.pool.spec import lmdb_file_damage

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")

from cpattn.pool.lmdb_store import LMDBStore  # noqa: E402

IDENT = PoolIdentity("tiny-damage", torch.float32, num_layers=1, block_size=16, row_width=256)
N = 40  # blocks of 16 KiB: the file spans many pages


def tokens():
    return list(range(16 * N))


def blocks(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(IDENT.block_shape, generator=g) for _ in range(N)]


def filled(path):
    with KVPool(LMDBStore(path), IDENT) as pool:
        assert pool.store(pool.keys(tokens()), blocks()) == N
    return os.path.join(path, "data.mdb")


CHILD = r"""
import json, sys, warnings
import torch
from cpattn.pool import PoolIdentity, open_pool
ident = PoolIdentity("tiny-damage", torch.float32, num_layers=1, block_size=16, row_width=256)
out = {}
for path in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pool = open_pool(f"lmdb:{path}", ident)
        keys = pool.keys(list(range(16 * 40)))
        cold = pool.lookup(keys), len(pool.load(keys))
        data = [torch.full(ident.block_shape, float(j)) for j in range(len(keys))]
        stored = pool.store(keys, data)
        got = pool.load(keys)
        warm = pool.lookup(keys), len(got), all(torch.equal(a, b) for a, b in zip(got, data))
        pool.close()
    out[path] = {"warnings": [f"{type(x.message).__name__}: {x.message}" for x in w], "cold": cold,
                 "stored": stored, "warm": warm}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_truncated_or_garbage_data_file_is_a_cold_pool_with_one_warning(tmp_path):
    truncated, garbage = str(tmp_path / "truncated"), str(tmp_path / "garbage")
    f = filled(truncated)
    os.truncate(f, os.path.getsize(f) // 2)
    f = filled(garbage)
    with open(f, "r+b") as fh:
        fh.write(os.urandom(os.path.getsize(f)))
    assert "truncated" in lmdb_file_damage(truncated) and "meta page" in lmdb_file_damage(garbage)
    r = subprocess.run([sys.executable, "-c", CHILD, truncated, garbage], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"the process died (rc {r.returncode}): {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for path in (truncated, garbage):
        got = out[path]
        assert len(got["warnings"]) == 1 and got["warnings"][0].startswith("PoolDamagedWarning"), got["warnings"]
        assert "data.mdb is damaged" in got["warnings"][0]
        assert got["cold"] == [0, 0]  # cold, never a crash or wrong KV ...
        assert got["stored"] == N and got["warm"] == [N, N, True]  # ... and a working pool afterwards
        assert os.path.exists(os.path.join(path, "data.mdb.damaged"))
        assert lmdb_file_damage(path) is None


def test_a_sound_pool_passes_the_header_check(tmp_path):
    f = filled(str(tmp_path))
    assert lmdb_file_damage(str(tmp_path)) is None
    with KVPool(LMDBStore(tmp_path), IDENT) as pool:  # more commits: the file grows, the header follows
        keys = pool.keys(list(range(10_000, 10_000 + 16 * N)))
        pool.store(keys, blocks(1))
    assert lmdb_file_damage(str(tmp_path)) is None
    os.truncate(f, os.path.getsize(f) - 4096)  # one page short
    assert "truncated" in lmdb_file_damage(str(tmp_path))


def _committing(path, stop):
    with KVPool(LMDBStore(path), IDENT) as pool:  # one block per commit: the file grows all the time
        for j, key in enumerate(pool.keys(list(range(16 * 4000)))):
            if stop.is_set():
                return
            pool.store([key], [torch.full(IDENT.block_shape, float(j))])


def test_a_pool_another_process_is_writing_is_never_called_damaged(tmp_path):
    # the two gloo ranks of `cpattn demo --kv-pool` open one fresh pool at once: a header check that took the
    # file's size before its header saw a commit land in between, called the file truncated and moved it aside,
    # and the two ranks wrote two pools (each found only its own blocks: the demo's pool check failed, 1 in 6)
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_committing, args=(str(tmp_path), stop))
    writer.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "data.mdb") and time.monotonic() < deadline:
            time.sleep(0.001)
        seen = [lmdb_file_damage(str(tmp_path)) for _ in range(3000)]
    finally:
        stop.set()
        writer.join(timeout=60)
    assert writer.exitcode == 0
    assert [w for w in seen if w is not None] == []


@pytest.mark.parametrize("record", ["clock", "used", "stamp", "lru"])
def test_a_damaged_bookkeeping_record_is_rebuilt_with_one_warning(tmp_path, record):
    """A record of the wrong length, found when the pool opens: rebuilt from the stored entries, one warning; the
    intact blocks are still served exactly."""
    filled(str(tmp_path))
    store = LMDBStore(tmp_path)
    keys = KVPool(store, IDENT).keys(tokens())
    with store.env.begin(write=True) as txn:
        if record in ("clock", "used"):
            txn.put(record.encode(), b"\x01\x02\x03", db=store._meta)
        elif record == "stamp":
            txn.put(keys[3].encode(), b"\x07", db=store._stamps)
        else:
            txn.put(b"\x01", b"", db=store._lru)
    store.close()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pool = open_pool(f"lmdb:{tmp_path}", IDENT)
        assert pool.lookup(keys) == N
        got = pool.load(keys)
        assert len(got) == N and all(torch.equal(a, b) for a, b in zip(got, blocks()))
        more = pool.keys(list(range(50_000, 50_016)))
        assert pool.store(more, blocks(2)[:1]) == 1 and pool.lookup(more) == 1
        pool.close()
    assert [type(x.message) for x in w] == [PoolDamagedWarning], [str(x.message) for x in w]
    assert "rebuilt" in str(w[0].message)


def test_a_record_damaged_while_the_pool_is_open_is_one_warning_then_misses(tmp_path):
    filled(str(tmp_path))
    pool = open_pool(f"lmdb:{tmp_path}", IDENT)
    keys = pool.keys(tokens())
    with pool.backend.env.begin(write=True) as txn:  # another process damages the clock under us
        txn.put(b"clock", b"\x01\x02\x03", db=pool.backend._meta)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert pool.load(keys) == []  # a read that renews stamps meets the damage: a miss
        assert pool.store(keys, blocks()) == 0 and pool.lookup(keys) == 0
    assert [type(x.message) for x in w] == [PoolUnavailableWarning]
    assert "damaged" in str(w[0].message)
    pool.close()


def test_a_pool_path_that_is_a_regular_file_is_one_line_before_any_work(tmp_path, capsys):
    from cpattn.bench import demo
    from cpattn.engine.pooling import PoolSpec
    from cpattn.pool import open_store

    f = tmp_path / "pool"
    f.write_text("")
    spec = f"lmdb:{f}"
    for call in (check_pool_spec, open_store, lambda s: open_pool(s, IDENT), PoolSpec):
        with pytest.raises(ValueError, match="is a regular file, not a directory") as e:
            call(spec)
        assert "\n" not in str(e.value) and str(f) in str(e.value)
    with pytest.raises(ValueError, match="is not a directory, so"):
        check_pool_spec(f"lmdb:{f}/sub")
    with pytest.raises(ValueError, match="port 1..65535"):
        check_pool_spec("mooncake:127.0.0.1:http")
    check_pool_spec(f"lmdb:{tmp_path / 'new' / 'pool'}")  # a directory to be created is fine
    with pytest.raises(SystemExit) as e:
        demo.main(["--kv-pool", spec, "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --kv-pool" in err and "is a regular file" in err, err
