"""A small multi-layer decode program with DCP, for tests, benchmarks and notebooks.

Each of L layers (params as plain dicts of tensors, this rank's TP slice)::

    h = rmsnorm(x) * norm                                  # [T, hidden]
    q = rope(h @ wq)  [T, Hl, D]     k = rope(h @ wk)  [T, Hkv, D]     v = h @ wv
    write_kv(k_cache, v_cache, k, v, slot_mapping[rank])   # only this rank's tokens
    a = dcp_decode(q, (k_cache, v_cache), meta, group)      # [T, Hl, D]
    x = x + all_reduce(a.flatten(1) @ wo)                  # row-parallel output projection

``merge`` picks the DCP layer, by the one merge vocabulary
(:mod:`cpattn.dcp.layer_merges`; collectives per layer, the TP all-reduce
included): "ag_rs" 4 (query all-gather, LSE all-gather, reduce-scatter,
all-reduce), "a2a" 3; with the group's query heads computed on every rank
(the hidden state is replicated over the TP = DCP group; wq is kept whole):
"local_a2a" 2 (one all-to-all, then this rank's heads through its wo slice),
"local_fold" 2 (one all-gather of the LSEs; each rank projects its rescaled
partial of every head through the whole wo, so the TP all-reduce is the
merge, :func:`cpattn.dcp.dcp_fold_weights`; ``"fold"`` is its old name) and
"local_ag" 1 (one all-gather of ``[O | L]``, every head merged on every rank
and projected through the whole wo: no all-reduce, as in the engine).

The DCP group is also the TP group: rank r holds query heads
``r*Hl .. (r+1)*Hl - 1`` (``Hl = num_heads / N``) and all ``num_kv_heads``
KV heads (ranks of one DCP group hold the same KV heads). The per-step
metadata (positions, per-rank local lengths, slot mappings) is computed on
the device from the persistent ``seq_lens`` / ``block_table`` /
``cu_seqlens_q`` by :func:`cpattn.dcp.plan_tensors`, so the same step runs
eagerly for prefill and mixed batches and inside a captured graph for
uniform decode batches.

Example
-------
>>> import torch
>>> from cpattn.comm import simulate
>>> from cpattn.graphs import DecodeRunner
>>> from cpattn.graphs import demo_program as dp
>>> cfg = dp.ProgramConfig(num_layers=1)
>>> params = dp.init_params(cfg)
>>> def run(group):
...     runner = DecodeRunner(dp.make_step(cfg, group), dp.init_state(cfg, params, group.rank, group.size),
...                           dp.fields(cfg), capture_sizes=[1, 2], backend="eager").capture()
...     x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(0))
...     batch = {"x": x, "seq_lens": torch.tensor([5]), "block_table": torch.tensor([[0, 1, 2, 3]])}
...     return runner(batch, query_lens=[5]).shape, runner.stats.last  # a prefill: eager
>>> simulate(2, run)[0]
(torch.Size([5, 64]), 'eager:prefill')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.dcp import DCPMeta, dcp_decode, dcp_fold_weights, dcp_partials, plan_tensors
from cpattn.dcp.decode import rescaled
from cpattn.dcp.layer_merges import LAYER_MERGES, PROGRAM_MERGES, layer_merge
from cpattn.graphs.runner import Field
from cpattn.ops.rows import write_kv


@dataclass(frozen=True)
class ProgramConfig:
    """Shapes of the demo program (global, before the TP/DCP split).

    num_heads must be a multiple of the DCP size; max_blocks is the block
    table width (local blocks per request on each rank); num_blocks the
    blocks of each rank's cache per layer.
    """

    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 16
    block_size: int = 16
    interleave_size: int = 1
    max_blocks: int = 4
    num_blocks: int = 32
    merge: str = "ag_rs"
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "merge", layer_merge(self.merge, PROGRAM_MERGES, what="ProgramConfig.merge"))


def init_params(cfg: ProgramConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Global weights: ``{"layers": [{"norm", "wq", "wk", "wv", "wo"}, ...]}``.

    norm: [hidden]; wq: [hidden, Hq*D]; wk, wv: [hidden, Hkv*D]; wo: [Hq*D, hidden].

    Example
    -------
    >>> init_params(ProgramConfig(num_layers=1))["layers"][0]["wq"].shape
    torch.Size([64, 64])
    """
    g = torch.Generator().manual_seed(seed)
    hd, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def w(*shape, fan_in):
        return (torch.randn(*shape, generator=g) * fan_in**-0.5).to(dtype)

    layers = [
        {
            "norm": (1.0 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(dtype),
            "wq": w(cfg.hidden, hq * hd, fan_in=cfg.hidden),
            "wk": w(cfg.hidden, hkv * hd, fan_in=cfg.hidden),
            "wv": w(cfg.hidden, hkv * hd, fan_in=cfg.hidden),
            "wo": w(hq * hd, cfg.hidden, fan_in=hq * hd),
        }
        for _ in range(cfg.num_layers)
    ]
    return {"layers": layers}


MERGES = PROGRAM_MERGES  # every name of cpattn.dcp.layer_merges
LOCAL_QUERY = tuple(m for m, (query, _) in LAYER_MERGES.items() if query == "local")  # wq kept whole
WHOLE_WO = ("local_fold", "local_ag")  # every head reaches the projection on every rank (wo kept whole)


def shard_params(cfg: ProgramConfig, params: dict, rank: int, size: int) -> dict:
    """Rank ``rank``'s TP slice: query heads ``rank*Hl .. (rank+1)*Hl-1`` of wq / wo; the rest replicated.

    With a "local_*" merge wq stays whole (every rank computes the group's
    query heads); with "local_fold" and "local_ag" wo stays whole too.

    Example
    -------
    >>> cfg = ProgramConfig(num_layers=1)
    >>> shard_params(cfg, init_params(cfg), 1, 2)["layers"][0]["wq"].shape
    torch.Size([64, 32])
    """
    if cfg.num_heads % size:
        raise ValueError(f"num_heads ({cfg.num_heads}) must be a multiple of the DCP/TP size ({size})")
    hl = cfg.num_heads // size
    cols = slice(rank * hl * cfg.head_dim, (rank + 1) * hl * cfg.head_dim)
    whole_q, whole_o = cfg.merge in LOCAL_QUERY, cfg.merge in WHOLE_WO
    return {
        "layers": [
            {**p, "wq": p["wq"] if whole_q else p["wq"][:, cols].contiguous(),
             "wo": p["wo"] if whole_o else p["wo"][cols].contiguous()} for p in params["layers"]
        ]
    }


def init_state(
    cfg: ProgramConfig, params: dict, rank: int = 0, size: int = 1, *, poison: float = float("nan"),
    device: torch.device | str = "cpu",
) -> dict:
    """This rank's state on ``device``: ``{"params": shard, "kv": [(k_cache, v_cache) per layer]}``.

    Caches are [num_blocks, block_size, Hkv, D], filled with ``poison``
    (NaN by default): a slot that is read before it is written shows up.
    """
    dtype = params["layers"][0]["wq"].dtype
    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)

    def cache():
        return torch.full(shape, poison, dtype=dtype, device=device)

    shard = shard_params(cfg, params, rank, size)
    shard = {"layers": [{k: v.to(device) for k, v in p.items()} for p in shard["layers"]]}
    return {"params": shard, "kv": [(cache(), cache()) for _ in range(cfg.num_layers)]}


def fields(cfg: ProgramConfig, dtype: torch.dtype = torch.float32) -> dict[str, Field]:
    """The per-step inputs of :func:`decode_step` for a :class:`~cpattn.graphs.DecodeRunner`.

    x: [T, hidden] token activations; seq_lens: [B] tokens per request after
    this step (pad 0: a padding request sees nothing); block_table:
    [B, max_blocks] (pad block 0, never read since seq_len is 0).
    """
    return {
        "x": Field("token", (cfg.hidden,), dtype, pad=0.0),
        "seq_lens": Field("request", (), torch.int64, pad=0),
        "block_table": Field("request", (cfg.max_blocks,), torch.int64, pad=0),
    }


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split (NeoX) rotary embedding. x: [T, H, D], positions: [T] (-1 for padding rows)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) * 2 / d)  # [D/2]
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def decode_step(state: dict, batch: dict[str, torch.Tensor], *, cfg: ProgramConfig, group: Group) -> torch.Tensor:
    """One step of the demo program on this rank: [T, hidden] -> [T, hidden].

    Arguments
    ---------
    state: from :func:`init_state` (caches written in place).
    batch: ``x`` [T, hidden], ``seq_lens`` [B], ``block_table`` [B, max_blocks],
        ``cu_seqlens_q`` [B+1] (added by the runner; requests past the real
        ones have zero query rows, so padding rows belong to no request).
    group: the DCP (= TP) group; any Group, or a size-1 one for one device.

    Returns
    -------
    x after L layers, [T, hidden]; padding rows carry garbage-free values
    (their attention is 0) and are dropped by the runner.
    """
    x = batch["x"]  # [T, hidden]
    t = x.shape[0]
    cu = batch["cu_seqlens_q"]  # [B+1]
    query_lens = cu[1:] - cu[:-1]  # [B]
    tensors = plan_tensors(
        batch["seq_lens"], query_lens, batch["block_table"], num_tokens=t, dcp_size=group.size,
        interleave_size=cfg.interleave_size, block_size=cfg.block_size,
    )
    meta = DCPMeta(
        dcp_size=group.size, interleave_size=cfg.interleave_size, block_size=cfg.block_size,
        block_table=batch["block_table"], seq_lens=batch["seq_lens"], query_lens=query_lens, **tensors,
    )
    slots = meta.slot_mapping[group.rank]  # [T]
    hd, hkv = cfg.head_dim, cfg.num_kv_heads
    for p, (k_cache, v_cache) in zip(state["params"]["layers"], state["kv"]):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * p["norm"]  # [T, hidden]
        q = rope((h @ p["wq"]).view(t, -1, hd), meta.positions, cfg.rope_theta)  # [T, Hl, D]
        k = rope((h @ p["wk"]).view(t, hkv, hd), meta.positions, cfg.rope_theta)  # [T, Hkv, D]
        v = (h @ p["wv"]).view(t, hkv, hd)  # [T, Hkv, D]
        write_kv(k_cache, v_cache, k, v, slots)
        if cfg.merge == "local_fold":  # the TP all-reduce merges: sum_r (w_r * O_r) @ wo
            o, lse = dcp_partials(q, k_cache, v_cache, meta.block_table, meta.req_indices,
                                  meta.kv_lens[group.rank], softmax_scale=hd**-0.5)  # [T, Hq, D], [T, Hq]
            w, _ = dcp_fold_weights(lse, group=group)  # [T, Hq]; 0 where this rank's partial is empty
            a = rescaled(o, lse, w).to(x.dtype)  # [T, Hq, D]: w_r * O_r, an empty partial zeroed
        else:  # "local_ag": every head merged on every rank [T, Hq, D]; otherwise this rank's heads [T, Hl, D]
            query, merge = LAYER_MERGES[cfg.merge]
            a = dcp_decode(q, (k_cache, v_cache), meta, group=group, merge=merge, query=query)
        y = a.flatten(1) @ p["wo"]  # [T, hidden]: a partial sum over the group's heads, or (local_ag) the whole
        x = x + (y if cfg.merge == "local_ag" else group.all_reduce(y))  # [T, hidden]
    return x


def make_step(cfg: ProgramConfig, group: Group):
    """``step(state, batch)`` for a :class:`~cpattn.graphs.DecodeRunner`, bound to ``cfg`` and ``group``."""
    return functools.partial(decode_step, cfg=cfg, group=group)
