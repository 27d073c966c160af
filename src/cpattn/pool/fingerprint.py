"""A model's fingerprint for the pool: a digest of what decides its KV -- the config and the weights.

Pool keys must change whenever the KV of a token would (:mod:`cpattn.pool.keys`),
so they name the model by its *content*, never by a name or a path: two
checkpoints both called ``model``, or new weights saved over the same
directory, get different fingerprints and so a cold pool each -- never
each other's KV.

``model_digest(params, cfg)`` hashes (BLAKE2b-128) the config (its type and
fields, canonical JSON) and every parameter tensor: its name, dtype, shape
and bytes, in name order. Hashing runs at roughly a GB/s per core; the
result is cached per process, keyed by the tensors themselves (their
identity, storage address and version counter, which every in-place
operation bumps), so a second run over the same params costs nothing and
any change through the tensors' own operations is seen. Writes through
``tensor.data`` bypass the version counter: call :func:`forget` after such
a write.

Example
-------
>>> import torch
>>> a = {"w": torch.ones(2, 3)}
>>> d = model_digest(a, {"hidden_size": 3})
>>> len(d), d == model_digest({"w": torch.ones(2, 3)}, {"hidden_size": 3})
(32, True)
>>> d == model_digest({"w": torch.ones(2, 3)}, {"hidden_size": 4})   # another config
False
>>> with torch.no_grad():
...     _ = a["w"].add_(1)                                             # an in-place change is seen
>>> d == model_digest(a, {"hidden_size": 3})
False
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

DIGEST_BYTES = 16
_CHUNK = 64 << 20  # bytes hashed per host copy of a device tensor
_CACHE_SIZE = 8

_LOCK = threading.Lock()
_CACHE: dict[tuple, tuple[list, str]] = {}  # signature -> (weakrefs to the tensors, digest)


def config_bytes(cfg: Any) -> bytes:
    """A canonical byte form of a model config: its type name and fields as sorted JSON.

    ``cfg`` is a dataclass (the family configs), a mapping (a config.json
    dict) or any object (its ``repr``).

    >>> config_bytes({"b": 1, "a": [2, 3]})
    b'dict:{"a":[2,3],"b":1}'
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        body = dataclasses.asdict(cfg)
    elif isinstance(cfg, Mapping):
        body = dict(cfg)
    else:
        body = repr(cfg)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=repr)
    return f"{type(cfg).__name__}:{text}".encode()


def _tensor_bytes(h, t: torch.Tensor) -> None:
    """Feed one tensor's raw bytes (C order) to the hash ``h``, a chunk at a time for device tensors."""
    if t.is_meta:
        raise ValueError("a parameter is on the meta device (no data); load the weights before pooling KV")
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    if raw.device.type == "cpu":
        if raw.numel():
            h.update(memoryview(raw.numpy()))
        return
    for i in range(0, raw.numel(), _CHUNK):
        h.update(memoryview(raw[i : i + _CHUNK].cpu().numpy()))


def _signature(items: list[tuple[str, torch.Tensor]], cfg_b: bytes) -> tuple:
    return (cfg_b, *((n, id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device))
                     for n, t in items))


def model_digest(params: Mapping[str, torch.Tensor], cfg: Any) -> str:
    """32 hex characters naming a model by its config and weights (see the module docstring).

    Arguments
    ---------
    params: name -> tensor (any devices and dtypes; non-tensor values are refused).
    cfg: the model's config (a dataclass, a dict, or anything with a stable ``repr``).

    Example
    -------
    >>> import torch
    >>> p = {"a": torch.zeros(2), "b": torch.zeros(2)}
    >>> model_digest(p, {}) == model_digest({"b": torch.zeros(2), "a": torch.zeros(2)}, {})  # name order
    True
    >>> model_digest(p, {}) == model_digest({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float64)}, {})
    False
    """
    items = sorted(params.items())
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"params[{name!r}] is a {type(t).__name__}; pass the model's tensors")
    cfg_b = config_bytes(cfg)
    sig = _signature(items, cfg_b)
    with _LOCK:  # one hashing per params even when the ranks of a simulated mesh ask together
        hit = _CACHE.get(sig)
        if hit is not None and all(r() is t for r, (_, t) in zip(hit[0], items)):
            return hit[1]
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"cpattn-model")
        h.update(struct.pack("<Q", len(cfg_b)))
        h.update(cfg_b)
        for name, t in items:
            head = f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}".encode()
            h.update(struct.pack("<Q", len(head)))
            h.update(head)
            _tensor_bytes(h, t)
        digest = h.hexdigest()
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[sig] = ([weakref.ref(t) for _, t in items], digest)
        return digest


def forget() -> None:
    """Drop the per-process cache of :func:`model_digest` (after writing weights through ``tensor.data``).

    >>> forget()
    """
    with _LOCK:
        _CACHE.clear()
