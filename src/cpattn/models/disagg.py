"""Prefill/decode disaggregation: a PCP prefill engine hands whole KV blocks to a DCP decode engine.

Two engines in one torch.distributed world of P + N processes::

    world ranks   0 .. P-1  prefill engine (kv_producer): PCP over P ranks
                  P .. P+N-1  decode engine (kv_consumer): DCP over N ranks, PCP = 1

Each engine has its own sub-group (``torch.distributed.new_group``) for its
collectives. With ``interleave_size == block_size`` (DESIGN.md §4.5) each
block of B consecutive tokens belongs wholly to one DCP rank, so the
transport moves whole blocks, point to point::

    request b, logical block j  --send--> decode rank j % N, local block j // N
    (sent by prefill rank j % P; one message per block carries every layer:
     [L, B, F] rows of :mod:`cpattn.models.kv_rows`)

After the PCP prefill every prefill rank holds the request's whole KV (the
all-gather that puts it in request order, :func:`prefill_on_rank`), so any
prefill rank can send any block; dealing block j to prefill rank j % P spreads
the sends. Prefill rank 0 also sends each decode rank a small header: every
request's first token and its logits. The decode engine places the blocks in
its paged shards and continues with :func:`cpattn.models.speculative.spec_decode_loop`
(plain DCP decode, or speculative).

The transport is real: gloo ``isend``/``irecv`` between the two process sets
(:func:`pd_generate_on_rank` under :func:`cpattn.comm.launch.spawn`). On the
simulated mesh, :func:`disagg_generate` runs the prefill engine, deals the
same blocks in memory, then runs the decode engine.

Configs follow the guide (:func:`pd_configs`): the decode side has PCP = 1,
and ``cp_kv_cache_interleave_size == block_size``.

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> out = disagg_generate(qwen3, qwen3.init_params(cfg), cfg, [[1, 2, 3, 4, 5]], 4, prefill_size=2, decode_size=2)
>>> out.tokens.shape
torch.Size([1, 4])
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import simulate
from cpattn.config import EngineConfig
from cpattn.layout.dcp import reshard_kv_blocks
from cpattn.models.dcp_cache import PagedShard
from cpattn.models.generate import (
    PrefillResult,
    _packed,
    check_layout,
    prefill,
    prefill_local,
    prefill_on_rank,
    uses_dsa,
)
from cpattn.models.kv_rows import pack_rows, row_layout, unpack_rows
from cpattn.models.speculative import SpecGeneration, _check_spec, shard_capacity, spec_decode_loop

_HEADER_TAG = 1 << 30


def attention_kind(cfg: Any) -> str:
    """"dsa", "mla" (values share the latent row) or "gqa" for a model config."""
    return "dsa" if uses_dsa(cfg) else "mla" if cfg.kv_dims[3] else "gqa"


def decode_engine_tp(cfg: Any, dcp_size: int) -> int:
    """The TP size that describes the models' DCP engine to :class:`~cpattn.config.ParallelConfig`.

    The models keep every KV head on every DCP rank and split the query
    heads (TP stand-in). For GQA that is a TP engine of ``N * num_kv_heads``
    ranks in which each group of N ranks shares one KV head, so
    ``tp // num_kv_heads == N``; MLA/DSA: ``tp == N``.
    """
    return dcp_size * (cfg.kv_dims[0] if attention_kind(cfg) == "gqa" else 1)


def pd_configs(cfg: Any, *, prefill_size: int, decode_size: int, block_size: int,
               interleave_size: int | None = None, decode_pcp_size: int = 1) -> tuple[EngineConfig, EngineConfig]:
    """The two engines' :class:`~cpattn.config.ParallelConfig` (producer, consumer), validated by the guide's rules.

    Raises ValueError when the decode side has ``decode_pcp_size > 1`` or
    ``interleave_size`` (default: ``block_size``) differs from ``block_size``.

    Example
    -------
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> prod, cons = pd_configs(cfg, prefill_size=2, decode_size=2, block_size=4)
    >>> prod.kv_transfer.kv_role, cons.kv_transfer.kv_role, cons.parallel.pcp_size
    ('kv_producer', 'kv_consumer', 1)
    """
    inter = block_size if interleave_size is None else interleave_size
    kind = attention_kind(cfg)
    heads = cfg.kv_dims[0] if kind == "gqa" else None
    common = dict(attention=kind, block_size=block_size, cp_kv_cache_interleave_size=inter, kv_transfer="pd")
    producer = EngineConfig.create(tp_size=1, pcp_size=prefill_size, kv_role="kv_producer", **common)
    consumer = EngineConfig.create(tp_size=decode_engine_tp(cfg, decode_size), pcp_size=decode_pcp_size,
                              dcp_size=decode_size, num_kv_heads=heads, kv_role="kv_consumer", **common)
    if inter != block_size:  # ParallelConfig checks this only with CP on; whole-block transfer always needs it
        raise ValueError(
            f"cp_kv_cache_interleave_size={inter} differs from block_size={block_size}; P/D moves whole blocks, "
            f"so set cp_kv_cache_interleave_size = block_size = {block_size}"
        )
    return producer, consumer


def request_blocks(pre: PrefillResult, block_size: int) -> list[torch.Tensor]:
    """Each request's KV as whole blocks: [num_blocks_b, L, block_size, F]; rows past the prompt are NaN."""
    rows = pack_rows(pre.k, pre.v, pre.ik)  # [T, L, F]
    cu = pre.cu_seqlens.tolist()
    out = []
    for a, b in zip(cu, cu[1:]):
        n = -(-(b - a) // block_size)
        blk = rows.new_full((n * block_size, *rows.shape[1:]), float("nan"))
        blk[: b - a] = rows[a:b]
        out.append(blk.view(n, block_size, *rows.shape[1:]).transpose(1, 2).contiguous())  # [n, L, B, F]
    return out


def deal_blocks(blocks: list[torch.Tensor], *, decode_size: int,
                block_size: int) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Per decode rank r: ``(request, local block, payload [L, B, F])`` for every block it owns (k % N == r)."""
    out: list[list] = [[] for _ in range(decode_size)]
    for b, blk in enumerate(blocks):
        parts = reshard_kv_blocks(blk.transpose(1, 2), dcp_size=decode_size, interleave_size=block_size,
                                  block_size=block_size)  # rank r: [n_r, B, L, F]
        for r, part in enumerate(parts):
            out[r].extend((b, i, part[i].transpose(0, 1)) for i in range(part.shape[0]))
    return out


def place_block(shard: PagedShard, cfg: Any, request: int, local_block: int, payload: torch.Tensor) -> None:
    """Copy one received block payload [L, B, F] into this rank's shard at ``block_table[request, local_block]``."""
    blk = int(shard.block_table[request, local_block])
    k, v, ik = unpack_rows(payload.transpose(0, 1), **row_layout(cfg))  # per layer [B, Hkv, D*]
    for layer in range(len(k)):
        shard.k[layer][blk] = k[layer]  # the explicit cache write: one whole block
        if v[layer] is not None:
            shard.v[layer][blk] = v[layer]
        if ik is not None:
            shard.ik[layer][blk] = ik[layer]


def _empty_shard(cfg, prompt_lens, steps, k, decode_size, block_size, dtype) -> PagedShard:
    return PagedShard.empty(cfg, seq_lens=shard_capacity(prompt_lens, steps, k), dcp_size=decode_size,
                            block_size=block_size, interleave_size=block_size, dtype=dtype)


@dataclass(frozen=True)
class PDResult:
    """A decode rank's :class:`~cpattn.models.speculative.SpecGeneration` plus transfer facts.

    ``prompt_logits`` of the generation is empty ([0, V]): the decode engine
    receives only the first tokens and their logits. blocks / bytes_received:
    KV blocks and payload bytes this decode rank received; ready_s: seconds
    from the start (all ranks together) until its KV was in place (TTFT).
    """

    generation: SpecGeneration
    blocks: int
    bytes_received: int
    ready_s: float


def decode_engine_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, prompts: list[list[int]],
                          steps: int, received, first: torch.Tensor, first_logits: torch.Tensor, *,
                          block_size: int, drafter=None, num_speculative_tokens: int = 0, merge: str = "ag_rs",
                          graph: bool = False) -> SpecGeneration:
    """The decode engine on one DCP rank: place ``received`` blocks, then decode (optionally speculative)."""
    k = num_speculative_tokens if drafter is not None else 0
    dtype = params["model.embed_tokens.weight"].dtype
    shard = _empty_shard(cfg, [len(p) for p in prompts], steps, k, group.size, block_size, dtype)
    for b, i, payload in received:
        place_block(shard, cfg, b, i, payload)
    toks, logs, stats = spec_decode_loop(group, model, params, cfg, shard, prompts, first, steps, drafter=drafter,
                                         num_speculative_tokens=k, merge=merge, graph=graph)
    tokens = torch.cat([first[:, None], toks], 1)
    logits = torch.cat([first_logits[:, None], logs], 1) if logs.numel() else first_logits[:, None]
    return SpecGeneration(tokens, logits, first_logits.new_zeros(0, first_logits.shape[-1]), stats)


def disagg_generate(model: ModuleType | str, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                    prefill_size: int, decode_size: int, block_size: int = 4, pcp_method: str = "ring",
                    drafter=None, num_speculative_tokens: int = 0, dcp_merge: str = "ag_rs",
                    graph: bool = False) -> SpecGeneration:
    """P/D on the simulated mesh: prefill on ``prefill_size`` ranks, blocks dealt in memory, decode on ``decode_size``.

    The same blocks and placement as :func:`pd_generate_on_rank`, whose
    transport is real. Returns the decode engine's :class:`SpecGeneration`
    (with the prefill's prompt logits).
    """
    pd_configs(cfg, prefill_size=prefill_size, decode_size=decode_size, block_size=block_size)
    _check_spec(drafter, num_speculative_tokens)
    check_layout(cfg, max_new_tokens, prefill_size, decode_size)
    tokens, cu = _packed(prompts)
    plist = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    pre = prefill(model, params, cfg, tokens, cu, pcp_size=prefill_size, pcp_method=pcp_method)
    first_logits = pre.logits[torch.tensor(cu[1:]) - 1]  # [B, V]
    dealt = deal_blocks(request_blocks(pre, block_size), decode_size=decode_size, block_size=block_size)

    def rank_fn(group):
        return decode_engine_on_rank(group, model, params, cfg, plist, max_new_tokens - 1, dealt[group.rank],
                                     first_logits.argmax(-1), first_logits, block_size=block_size, drafter=drafter,
                                     num_speculative_tokens=num_speculative_tokens, merge=dcp_merge, graph=graph)

    out = simulate(decode_size, rank_fn)[0]
    return SpecGeneration(out.tokens, out.logits, pre.logits, out.stats)


def pd_generate_on_rank(world: Group, model: ModuleType | str, params: dict, cfg: Any, prompts: list,
                        max_new_tokens: int, *, prefill_size: int, decode_size: int, block_size: int = 4,
                        pcp_method: str = "ring", drafter=None, num_speculative_tokens: int = 0,
                        dcp_merge: str = "ag_rs", graph: bool = False) -> dict | PDResult:
    """One rank of a P/D pair in a torch.distributed world of ``prefill_size + decode_size`` processes.

    Run it on every world rank (``spawn(P + N, pd_generate_on_rank, "qwen3", params, cfg, prompts, 16,
    prefill_size=P, decode_size=N)``). World ranks < P form the prefill
    engine, the rest the decode engine; each gets its own sub-group. KV moves
    block by block with gloo ``isend``/``irecv`` (see module doc).

    Returns: prefill ranks a dict ``{"role": "prefill", "blocks_sent",
    "bytes_sent", "prefill_s"}``; decode ranks a :class:`PDResult`.
    """
    import torch.distributed as dist

    from cpattn.comm.dist import DistGroup

    p, n = prefill_size, decode_size
    if world.size != p + n:
        raise ValueError(f"the world has {world.size} ranks but prefill_size + decode_size = {p} + {n} = {p + n}")
    pd_configs(cfg, prefill_size=p, decode_size=n, block_size=block_size)
    _check_spec(drafter, num_speculative_tokens)
    check_layout(cfg, max_new_tokens, p, n)
    pg_prefill = dist.new_group(list(range(p)))  # every world rank creates both groups, in the same order
    pg_decode = dist.new_group(list(range(p, p + n)))
    tokens, cu = _packed(prompts)
    plist = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    vocab = params["model.embed_tokens.weight"].shape[0]
    dtype = params["model.embed_tokens.weight"].dtype
    world.all_reduce(torch.zeros(1))  # start together: times below are from here
    t0 = time.perf_counter()
    if world.rank < p:
        group = DistGroup(pg_prefill)
        if p > 1:
            pre = prefill_on_rank(group, model, params, cfg, tokens, cu, pcp_method=pcp_method)
        else:
            pre = prefill_local(model, params, cfg, tokens, cu)
        prefill_s = time.perf_counter() - t0
        blocks = request_blocks(pre, block_size)
        works, sent, nbytes = [], 0, 0
        if group.rank == 0:
            first_logits = pre.logits[torch.tensor(cu[1:]) - 1].contiguous()  # [B, V] float32
            for d in range(n):
                works.append(dist.isend(first_logits, p + d, tag=_HEADER_TAG))
        for b, blk in enumerate(blocks):
            for j in range(blk.shape[0]):
                if j % p == group.rank:
                    works.append(dist.isend(blk[j], p + j % n, tag=b * (1 << 20) + j))  # [L, B, F]
                    sent += 1
                    nbytes += blk[j].numel() * blk[j].element_size()
        for w in works:
            w.wait()
        return {"role": "prefill", "blocks_sent": sent, "bytes_sent": nbytes, "prefill_s": prefill_s}
    group = DistGroup(pg_decode)
    d = group.rank
    layout = row_layout(cfg)
    f = layout["kv_heads"] * layout["dk"] + (0 if layout["shared_v"] else layout["kv_heads"] * layout["dv"]) + \
        layout["index_dim"]
    first_logits = torch.empty(len(lens), vocab, dtype=torch.float32)
    works = [dist.irecv(first_logits, 0, tag=_HEADER_TAG)]
    received = []
    for b, m in enumerate(lens):
        for j in range(d, -(-m // block_size), n):
            buf = torch.empty(cfg.num_hidden_layers, block_size, f, dtype=dtype)
            works.append(dist.irecv(buf, j % p, tag=b * (1 << 20) + j))
            received.append((b, j // n, buf))
    for w in works:
        w.wait()
    ready_s = time.perf_counter() - t0
    gen = decode_engine_on_rank(group, model, params, cfg, plist, max_new_tokens - 1, received,
                                first_logits.argmax(-1), first_logits, block_size=block_size, drafter=drafter,
                                num_speculative_tokens=num_speculative_tokens, merge=dcp_merge, graph=graph)
    nbytes = sum(buf.numel() * buf.element_size() for _, _, buf in received)
    return PDResult(gen, len(received), nbytes, ready_s)
