"""Writes into paged caches, in place and without a host sync: ``write_kv`` (GQA keys and values),
``write_kv_mla`` (one MLA latent row per token) and ``write_rows`` (any row shape).

A slot is ``block * block_size + offset`` (DESIGN.md §3); slot -1 writes
nothing (a token another DCP rank owns, a ring row overwritten later in the
same write, a padding row). Each op mutates its cache (``mutates_args``), so
a captured graph sees the write. DeepSeek-V4 keeps several small per-layer
caches with one row per token or per compressed entry (the sliding-window
ring ``[kv]``, the compressor rings ``[kv | gate]``, the compressed entries,
the indexer keys), all ``[num_blocks, block_size, *row]``: ``write_rows``
serves them all.
"""

from __future__ import annotations

import torch

from cpattn.ops import checks, registry


def scatter_rows(flat: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """flat[slots[i]] = src[i] for slots >= 0, in place, without a host sync.

    flat: [S, ...] cache rows (a flat view of a paged cache); src: [T, ...]
    (cast to flat's dtype); slots: [T] int, -1 skips the row. Rows with slot
    -1 are redirected to a harmless duplicate write: the first valid row's
    (slot, value), or slot 0's current value when no row is valid. Duplicate
    writes carry identical values, so their order cannot matter.

    Example
    -------
    >>> flat = torch.zeros(4, 2)
    >>> scatter_rows(flat, torch.ones(2, 2), torch.tensor([3, -1]))
    >>> flat[:, 0].tolist()
    [0.0, 0.0, 0.0, 1.0]
    """
    if slots.numel() == 0:
        return
    slots = slots.long()
    valid = slots >= 0  # [T]
    first = torch.argmax(valid.to(torch.int8)).view(1)  # [1]: first valid row (0 if none)
    anyv = valid.any()
    src = src.to(flat.dtype)
    tgt_slot = torch.where(anyv, slots.index_select(0, first), 0)  # [1]
    tgt_val = torch.where(anyv, src.index_select(0, first), flat[:1])  # [1, H, D]
    idx = torch.where(valid, slots, tgt_slot)  # [T]
    val = torch.where(valid.view(-1, *([1] * (src.dim() - 1))), src, tgt_val)  # [T, H, D]
    flat.index_copy_(0, idx, val)


@registry.define("write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    scatter_rows(k_cache.view(-1, *k_cache.shape[2:]), k, slot_mapping)
    scatter_rows(v_cache.view(-1, *v_cache.shape[2:]), v, slot_mapping)


registry.generic("write_kv")


@registry.kernel("write_kv", "cpu")
def _write_kv_cpu(k_cache, v_cache, k, v, slot_mapping):
    # host-side row selection (fine inside a CPU kernel): two index_copy_ calls
    rows = (slot_mapping >= 0).nonzero().view(-1)  # [T'] tokens this cache keeps
    slots = slot_mapping[rows].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[rows].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[rows].to(v_cache.dtype))


@registry.fake("write_kv")
def _write_kv_fake(k_cache, v_cache, k, v, slot_mapping):
    return None


@registry.define("write_kv_mla", mutates_args=("kv_cache",))
def _write_kv_mla_op(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    latent = torch.cat([kv_c, k_pe], dim=-1)[:, None, :]  # [T, 1, Dc + Dr]
    scatter_rows(kv_cache.view(-1, *kv_cache.shape[2:]), latent, slot_mapping)


registry.generic("write_kv_mla")


@registry.fake("write_kv_mla")
def _write_kv_mla_fake(kv_cache, kv_c, k_pe, slot_mapping):
    return None


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D]; got shape {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written through a flat view); call .contiguous() once")


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' keys and values into a paged cache, in place.

    Arguments
    ---------
    k_cache: [num_blocks, block_size, Hkv, Dk]; v_cache: [num_blocks, block_size, Hkv, Dv]
        (contiguous; modified in place).
    k: [T, Hkv, Dk]; v: [T, Hkv, Dv] -- cast to the cache dtype.
    slot_mapping: [T] int -- ``block * block_size + offset``, or -1 to skip the
        token (owned by another DCP rank, or a padding row). Valid slots must
        be distinct (-1 may repeat). A repeated slot, or any other value (below
        -1, or past the cache), is a ValueError naming the first one (not
        checked while tracing or capturing). Every tensor on one device.

    Example
    -------
    >>> import torch
    >>> kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    >>> write_kv(kc, vc, torch.ones(3, 1, 8), torch.ones(3, 1, 8), torch.tensor([5, -1, 0]))
    >>> kc[1, 1, 0, 0].item(), kc[0, 1, 0, 0].item()
    (1.0, 0.0)
    """
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    checks.same_device("k_cache", k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    if k.dim() != 3 or k.shape[1:] != k_cache.shape[2:] or v.shape != (k.shape[0], *v_cache.shape[2:]):
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D] matching the caches' "
            f"[.., {', '.join(map(str, k_cache.shape[2:]))}] / [.., {', '.join(map(str, v_cache.shape[2:]))}]"
        )
    checks.slots("slot_mapping", slot_mapping, k.shape[0], "k_cache", k_cache)
    registry.call("write_kv", k_cache, v_cache, k, v, slot_mapping)


def write_kv_mla(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write MLA latents into one latent cache, in place: ``cache[slot] = [kv_c | k_pe]``.

    Arguments
    ---------
    kv_cache: [num_blocks, block_size, 1, Dc + Dr] (DeepSeek: 576 = 512 + 64), contiguous.
    kv_c: [T, Dc] compressed latent (the values); k_pe: [T, Dr] rope key part.
    slot_mapping: [T] int, -1 skips a token; other slots must lie in the cache
        and be distinct (a ValueError names the first one; not checked while
        tracing or capturing).

    Example
    -------
    >>> import torch
    >>> cache = torch.zeros(2, 4, 1, 576)
    >>> write_kv_mla(cache, torch.ones(2, 512), torch.full((2, 64), 2.0), torch.tensor([-1, 6]))
    >>> cache[1, 2, 0, 511].item(), cache[1, 2, 0, 512].item()
    (1.0, 2.0)
    """
    _check_cache("kv_cache", kv_cache)
    checks.same_device("kv_cache", kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache must hold one latent head [.., .., 1, D]; got shape {tuple(kv_cache.shape)}")
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0] or (
        kv_c.shape[1] + k_pe.shape[1] != kv_cache.shape[3]
    ):
        raise ValueError(
            f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} must be [T, Dc] and [T, Dr] with "
            f"Dc + Dr = {kv_cache.shape[3]} (the cache's last dim)"
        )
    checks.slots("slot_mapping", slot_mapping, kv_c.shape[0], "kv_cache", kv_cache)
    registry.call("write_kv_mla", kv_cache, kv_c, k_pe, slot_mapping)


@registry.define("write_rows", mutates_args=("cache",))
def _write_rows_op(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    scatter_rows(cache.view(-1, *cache.shape[2:]), rows, slots)


registry.generic("write_rows")  # sync-free body: every device, and the CPU decomposition


@registry.kernel("write_rows", "cpu")
def _write_rows_cpu(cache, rows, slots):
    keep = (slots >= 0).nonzero().view(-1)  # host-side selection: fine inside a CPU kernel
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots[keep].long(), rows[keep].to(cache.dtype))


@registry.fake("write_rows")
def _write_rows_fake(cache, rows, slots):
    return None


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache.view(-1, *row)[slots[i]] = rows[i]`` for every ``slots[i] >= 0``, in place.

    Arguments
    ---------
    cache: [num_blocks, block_size, *row] contiguous; rows: [T, *row] (cast to
    the cache's dtype); slots: [T] int, distinct where >= 0, -1 skips a row
    (a repeat or a slot past the cache is a ValueError; not checked while
    tracing or capturing).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.rows import write_rows
    >>> cache = torch.zeros(2, 2, 3)
    >>> write_rows(cache, torch.ones(2, 3), torch.tensor([3, -1]))
    >>> cache[1, 1].tolist(), cache[0, 0].tolist()
    ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    """
    if cache.dim() < 3 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [num_blocks, block_size, *row] tensor; got {tuple(cache.shape)}")
    if rows.shape[1:] != cache.shape[2:]:
        row = ", ".join(map(str, cache.shape[2:]))
        raise ValueError(f"rows {tuple(rows.shape)} must be [T, {row}] like the cache rows")
    checks.same_device("cache", cache, rows=rows, slots=slots)
    checks.slots("slots", slots, rows.shape[0], "cache", cache, row="row")
    registry.call("write_rows", cache, rows, slots)
