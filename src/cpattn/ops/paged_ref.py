"""Plain reference math for the paged-cache ops of :mod:`cpattn.ops.paged`.

Slow and obvious: a loop over tokens for the cache writes; one gather of
every block slot of the block table plus an explicit mask for attention.
Computed in float64 for float64 inputs, else float32. No host sync, so the
attention reference also serves as the device-generic fallback kernel.
"""

from __future__ import annotations

import torch

from cpattn.ops.ref import acc_dtype


def write_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token i's k/v into slot ``slot_mapping[i]`` (skip -1), one token at a time.

    k_cache: [num_blocks, block_size, Hkv, Dk]; v_cache: [num_blocks, block_size, Hkv, Dv];
    k: [T, Hkv, Dk]; v: [T, Hkv, Dv]; slot_mapping: [T] (slot = block * block_size + offset).
    """
    bs = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, slot % bs] = k[i]
        v_cache[slot // bs, slot % bs] = v[i]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query row over the first ``kv_lens[t]`` local keys of its request.

    q: [T, Hq, Dk]; k_cache: [num_blocks, block_size, Hkv, Dk];
    v_cache: [num_blocks, block_size, Hkv, Dv]; block_table: [B, max_blocks];
    req_indices: [T] (< 0: padding row); kv_lens: [T]. Query head h reads kv
    head ``h // (Hq // Hkv)``. Returns out [T, Hq, Dv] (q's dtype) and lse
    [T, Hq] (float32, float64 for float64 q); rows that see nothing get (0, -inf).
    Keys past ``kv_lens`` are never read into the result (NaN there is harmless);
    NaN in a visible key or value makes the row NaN.
    """
    acc = acc_dtype(q.dtype)
    t, hq, _ = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_table.shape[1]
    group = hq // hkv
    j = torch.arange(mb * bs, device=q.device)  # [L]: every local index the table can address
    req = req_indices.long().clamp(0, max(block_table.shape[0] - 1, 0))  # [T]
    blocks = block_table[req].long()[:, j // bs]  # [T, L]
    slots = blocks.clamp(0, nb - 1) * bs + j % bs  # [T, L]
    visible = (j[None, :] < kv_lens.long()[:, None]) & (req_indices[:, None] >= 0) & (blocks >= 0)  # [T, L]
    k = k_cache.flatten(0, 1)[slots].to(acc)  # [T, L, Hkv, Dk]
    v = v_cache.flatten(0, 1)[slots].to(acc)  # [T, L, Hkv, Dv]
    k = torch.where(visible[..., None, None], k, 0.0)  # masked keys: NaN poison never enters
    v = torch.where(visible[..., None, None], v, 0.0)
    qg = q.to(acc).view(t, hkv, group, -1)  # [T, Hkv, G, Dk]: query head h = kv * G + g
    s = torch.einsum("tkgd,tlkd->tkgl", qg, k).reshape(t, hq, -1) * softmax_scale  # [T, Hq, L]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, Hq]; NaN where a visible key holds NaN
    live = lse != float("-inf")  # only a row that sees nothing is zeroed: NaN stays NaN
    p = torch.exp(s - torch.where(live, lse, 0.0)[..., None])  # [T, Hq, L]
    out = torch.einsum("tkgl,tlkd->tkgd", p.view(t, hkv, group, -1), v).reshape(t, hq, -1)  # [T, Hq, Dv]
    out = torch.where(live[..., None], out, 0.0)
    return out.to(q.dtype), lse.to(acc_dtype(acc))
