"""Pool specs checked before any rank starts, and an LMDB file checked before it is mapped (no torch here).

``check_pool_spec(spec)`` is what a command line calls on ``--kv-pool``: it
raises ``ValueError`` (one line) for what can never work -- an unknown
kind, ``lmdb:FILE`` where FILE is not a directory, a directory that cannot
be written, ``mooncake:`` without ``HOST:PORT``. A *damaged* pool is not an
error: :func:`lmdb_file_damage` says why a ``data.mdb`` cannot be mapped
safely (a truncated file would kill the process with SIGBUS on the first
read of a missing page; a garbage one makes LMDB refuse it), and
:class:`~cpattn.pool.lmdb_store.LMDBStore` then moves it aside and starts
an empty pool with one warning.

LMDB's header: pages 0 and 1 are meta pages (page header 16 bytes, then
``mm_magic`` 0xBEEFC0DE, ``mm_version`` 1, the map address and size, two
database records -- the first one's ``md_pad`` holds the page size -- then
``mm_last_pg`` and ``mm_txnid``). The meta with the larger transaction id
is the live one; the file must hold pages ``0 .. mm_last_pg``.

Example
-------
>>> import os, tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     check_pool_spec(f"lmdb:{d}/pool")                 # fine: created when opened
...     open(f"{d}/file", "w").close()
...     check_pool_spec(f"lmdb:{d}/file")
Traceback (most recent call last):
...
ValueError: KV pool 'lmdb:.../file': '.../file' is a regular file, not a directory; pass a directory for the pool (it is created if missing)
>>> check_pool_spec("mooncake:localhost")
Traceback (most recent call last):
...
ValueError: KV pool 'mooncake:localhost': expected mooncake:HOST:PORT with a port 1..65535, e.g. mooncake:127.0.0.1:50051
"""

from __future__ import annotations

import os
import struct
import time

USAGE = "use lmdb:DIR or mooncake:HOST:PORT"

_META = struct.Struct("<QHH")  # mp_pgno, mp_pad, mp_flags
_P_META = 0x08
_MAGIC = 0xBEEFC0DE
_DATA = "data.mdb"


def split_spec(spec: str) -> tuple[str, str]:
    """(kind, rest) of ``lmdb:DIR`` / ``mooncake:HOST:PORT``; ValueError for anything else.

    >>> split_spec("lmdb:/tmp/p")
    ('lmdb', '/tmp/p')
    """
    kind, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind not in ("lmdb", "mooncake") or not rest:
        raise ValueError(f"unknown KV pool spec {spec!r}; {USAGE}")
    return kind, rest


def lmdb_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold an LMDB pool (not a directory, not writable), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        kind = "a regular file" if os.path.isfile(path) else "not a directory"
        return f"{path!r} is {kind}, not a directory; pass a directory for the pool (it is created if missing)"
    probe = path
    while not os.path.exists(probe):  # the nearest existing ancestor must be a writable directory
        parent = os.path.dirname(probe.rstrip(os.sep)) or "."
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe!r} is not a directory, so {path!r} cannot be created; pass a directory for the pool"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe!r} is not writable; pass a directory you can write for the pool"
    data = os.path.join(path, _DATA)
    if os.path.lexists(data) and not os.path.isfile(data):
        return f"{data!r} is not a regular file; remove it or pass another directory"
    return None


def pool_spec_problem(spec: str) -> str | None:
    """Why ``spec`` can never be opened (one clause, for a command line's usage error), or None.

    >>> pool_spec_problem("redis:x")
    'expected lmdb:DIR or mooncake:HOST:PORT'
    """
    try:
        kind, rest = split_spec(spec)
    except ValueError:
        return "expected lmdb:DIR or mooncake:HOST:PORT"
    if kind == "lmdb":
        return lmdb_path_problem(rest)
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "expected mooncake:HOST:PORT with a port 1..65535, e.g. mooncake:127.0.0.1:50051"
    return None


def check_pool_spec(spec: str) -> None:
    """Raise ValueError (one line) if ``spec`` can never be opened; a damaged pool passes (it is a cold pool).

    Cheap (a few ``stat`` calls, no import of torch, lmdb or Mooncake): a
    command line calls it (or :func:`pool_spec_problem`) on ``--kv-pool``
    before any rank starts.
    """
    split_spec(spec)
    why = pool_spec_problem(spec)
    if why is not None:
        raise ValueError(f"KV pool {spec!r}: {why}")


def lmdb_file_damage(directory: str) -> str | None:
    """Why ``directory/data.mdb`` must not be mapped (truncated, not LMDB), or None (absent or sound header).

    Safe while other processes write the pool: the header is read *before* the file's size (LMDB writes a
    commit's pages before its meta page and never shrinks the file, so a header read first never records
    pages past a size taken after it), and a file that looks damaged is read again twice, 50 ms apart,
    before it is called damaged (a new file's first pages may be landing).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     lmdb_file_damage(d) is None                              # no file yet: fine
    ...     with open(f"{d}/data.mdb", "wb") as f:
    ...         _ = f.write(b"not a database" * 100)
    ...     lmdb_file_damage(d).startswith("page 0 is not an LMDB meta page")
    True
    True
    """
    if struct.calcsize("P") != 8:  # the header layout below is the 64-bit one
        return None
    path = os.path.join(directory, _DATA)
    why = None
    for attempt in range(3):
        try:
            why = _header_damage(path)
        except FileNotFoundError:
            return None
        except OSError as err:
            return f"unreadable ({err.strerror or err})"
        if why is None:
            return None
        if attempt < 2:  # a writer between our reads (a commit, or a new file's first two pages): look again
            time.sleep(0.05)
    return why


def _header_damage(path: str) -> str | None:
    """One look at ``path``'s two meta pages, then its size (see :func:`lmdb_file_damage`)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # LMDB initialises an empty file as a new database
            return None
        metas = []
        for page in (0, 1):
            psize = 4096 if page == 0 else metas[0][0]
            f.seek(page * psize)
            raw = f.read(160)
            if len(raw) < 160:
                return f"{os.fstat(f.fileno()).st_size} bytes: truncated inside meta page {page}"
            _, _, flags = _META.unpack_from(raw, 0)
            magic, version = struct.unpack_from("<II", raw, 16)
            if not flags & _P_META or magic != _MAGIC:
                return f"page {page} is not an LMDB meta page (magic {magic:#x}, flags {flags:#x})"
            if version != 1:
                return f"LMDB format version {version}, this lmdb reads 1"
            psize = struct.unpack_from("<I", raw, 40)[0]
            if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
                return f"page size {psize} in meta page {page} is not a power of two in 512..65536"
            last, txnid = struct.unpack_from("<QQ", raw, 136)
            metas.append((psize, last, txnid))
        size = os.fstat(f.fileno()).st_size  # after the header: a commit landing meanwhile only grows it
    psize, last, _ = max(metas, key=lambda m: m[2])
    need = (last + 1) * psize
    if size < need:
        return f"{size} bytes, but its header records {last + 1} pages of {psize} bytes ({need} bytes): truncated"
    return None
