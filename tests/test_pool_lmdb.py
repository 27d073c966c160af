"""The LMDB pool backend for real: persistence, corruption, eviction, concurrent writers, a store gone."""

import multiprocessing
import os
import warnings

import pytest
import torch
from pool_blocks import random_blocks, same_blocks

from cpattn.pool import KVPool, PoolIdentity, PoolUnavailableWarning, codec, open_pool
from cpattn.pool.lmdb_store import LMDBStore

pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install 'cpattn[pool]')")

IDENT = PoolIdentity("tiny-lmdb", torch.bfloat16, num_layers=3, block_size=4, row_width=16)
BLOB = codec.encoded_size(IDENT.dtype, IDENT.block_shape)


def blocks(n, seed=0):
    return random_blocks(IDENT, n, seed)


same = same_blocks


def test_round_trip_survives_reopening(tmp_path):
    tokens = list(range(4 * 5 + 3))
    with KVPool(LMDBStore(tmp_path), IDENT) as pool:
        keys = pool.keys(tokens)
        assert len(keys) == 5 and pool.lookup(keys) == 0 and pool.load(keys) == []
        assert pool.store(keys[:3], blocks(5)[:3]) == 3
        assert pool.store(keys, blocks(5)) == 2  # the first three were there already
        assert pool.stats.already == 3
    with KVPool(LMDBStore(tmp_path), IDENT) as pool:  # a new environment on the same directory
        assert pool.lookup(keys) == 5
        assert same(pool.load(keys), blocks(5))
        other = KVPool(pool.backend, IDENT.with_model("another-model"))
        assert other.lookup(other.keys(tokens)) == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bit", "other-key", "other-dtype"])
def test_damaged_entry_is_a_miss_and_is_dropped(tmp_path, damage):
    store = LMDBStore(tmp_path)
    pool = KVPool(store, IDENT)
    keys = pool.keys(list(range(16)))
    data = blocks(4)
    pool.store(keys, data)
    kb = keys[2].encode()
    with store.env.begin(write=True) as txn:
        blob = bytearray(txn.get(kb, db=store.blocks_db))
        if damage == "garbage":
            blob = os.urandom(len(blob))
        elif damage == "truncated":
            blob = blob[: len(blob) // 2]
        elif damage == "bit":
            blob[codec.HEADER_BYTES + 100] ^= 0x01
        elif damage == "other-key":
            blob = codec.encode(keys[1], data[2])
        else:
            blob = codec.encode(keys[2], data[2].view(torch.float16))
        txn.put(kb, bytes(blob), db=store.blocks_db)
    assert pool.lookup(keys) == 4  # present ...
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # corruption is logged, not warned: only a dead store warns
        got = pool.load(keys)
    assert same(got, data[:2])  # ... but a miss from the damaged block on
    assert pool.stats.corrupt == 1 and pool.lookup(keys) == 2  # and dropped
    assert pool.store(keys[2:], data[2:]) == 1  # so it can be written again
    assert same(pool.load(keys), data)
    pool.close()


def test_lru_eviction_under_capacity(tmp_path):
    store = LMDBStore(tmp_path, capacity_bytes=3 * BLOB)
    pool = KVPool(store, IDENT)
    keys = [pool.keys([i] * 4)[0] for i in range(6)]  # six unrelated one-block requests
    data = blocks(6)
    for k, d in zip(keys[:3], data[:3]):  # one request each (the keys of one call are one chain)
        pool.store([k], [d])
    assert store.used_bytes() == 3 * BLOB
    assert same(pool.load(keys[:1]), data[:1])  # renews block 0: block 1 is now the oldest
    pool.store(keys[3:4], data[3:4])
    assert store.exists(keys[:4]) == [True, False, True, True]
    pool.store(keys[4:5], data[4:5])
    pool.store(keys[5:6], data[5:6])
    assert store.exists(keys) == [False, False, False, True, True, True]
    assert store.used_bytes() == 3 * BLOB
    assert all(same(pool.load([k]), [d]) for k, d in zip(keys[3:], data[3:]))
    # an entry that can never fit is not kept, and nothing else is evicted for it
    tiny = KVPool(LMDBStore(tmp_path / "tiny", capacity_bytes=BLOB - 1), IDENT)
    assert tiny.store(keys[:1], data[:1]) == 0 and tiny.stats.rejected == 1
    tiny.close()
    pool.close()


def test_eviction_accounting_is_shared_by_handles(tmp_path):
    a, b = LMDBStore(tmp_path, capacity_bytes=2 * BLOB), LMDBStore(tmp_path, capacity_bytes=2 * BLOB)
    assert a.env is b.env  # one environment per file per process
    pa, pb = KVPool(a, IDENT), KVPool(b, IDENT)
    keys = [pa.keys([i] * 4)[0] for i in range(3)]
    pa.store(keys[:1], blocks(1))
    pa.store(keys[1:2], blocks(2)[1:])
    pb.store(keys[2:], blocks(3)[2:])
    assert a.exists(keys) == [False, True, True] and b.used_bytes() == 2 * BLOB
    a.close()
    assert pb.lookup(keys[1:]) == 2  # b still works after a closed
    b.close()


def _writer(path, value):
    pool = KVPool(LMDBStore(path), IDENT)
    for k in pool.keys(list(range(4 * 40))):  # one block per transaction: the two writers interleave
        pool.store([k], [torch.full(IDENT.block_shape, value, dtype=IDENT.dtype)])
    pool.close()


def test_concurrent_writer_processes_of_the_same_keys(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the children inherit the imports: no second torch start-up
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), v)) for v in (1.0, 2.0)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    pool = KVPool(LMDBStore(tmp_path), IDENT)
    keys = pool.keys(list(range(4 * 40)))
    got = pool.load(keys)
    assert len(got) == 40 and pool.stats.corrupt == 0
    for t in got:  # every entry is one writer's whole block, never a mix
        assert torch.equal(t, torch.full_like(t, t.view(-1)[0].item())) and t.view(-1)[0].item() in (1.0, 2.0)
    pool.close()


def test_store_gone_is_one_warning_then_misses(tmp_path):
    pool = KVPool(LMDBStore(tmp_path), IDENT)
    keys = pool.keys(list(range(8)))
    pool.store(keys, blocks(2))
    pool.backend.close()  # the database goes away under the pool
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert pool.lookup(keys) == 0
        assert pool.load(keys) == [] and pool.store(keys, blocks(2)) == 0 and pool.lookup(keys) == 0
    assert [type(x.message) for x in w] == [PoolUnavailableWarning]
    assert not pool.available
    pool.close()


def test_store_rejects_payloads_of_another_shape(tmp_path):
    with open_pool(f"lmdb:{tmp_path}", IDENT) as pool:
        keys = pool.keys(list(range(4)))
        with pytest.raises(ValueError, match=r"\[num_layers, block_size, row_width\]"):
            pool.store(keys, [torch.zeros(3, 4, 8, dtype=torch.bfloat16)])
        with pytest.raises(ValueError, match="one payload per key"):
            pool.store(keys, [])
