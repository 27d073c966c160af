"""The hand-off stage: prefill KV rows into the decode engine's DCP-sharded paged cache.

Token t of request b belongs to DCP rank ``(t // I) % N``
(:mod:`cpattn.layout.dcp`); every rank of the world knows the prefill plan,
so who sends which row where is known on the host, with no message about it.

Engines on the same ranks (prefill ranks ``[0, P)`` and decode ranks ``[0, N)``
of one world, N and P at most the world size: a prefill over the first P ranks
of a DCP group, whose other ranks send nothing, or a decode over the first N
ranks of the PCP world, whose other ranks receive nothing: ``runner_wide``):

- ``method="a2a"``: each rank groups its rows by owner and one all-to-all
  (every layer at once) brings every decode rank exactly its rows;
- ``method="allgather"``: every rank gathers all rows and keeps its own
  (about N times more bytes received; kept for comparison).

Engines on different ranks (P/D disaggregation, ``I == block_size``): whole
blocks of ``block_size`` tokens move (:func:`request_blocks`,
:func:`deal_blocks`): block j of a request goes to decode rank ``j % N`` as
its local block ``j // N`` -- in memory (:func:`place_blocks`) or point to
point over a :class:`~cpattn.comm.group.Group` (:func:`send_blocks` /
:func:`recv_blocks`; the drafter's prompt hidden states with them:
:func:`send_hidden` / :func:`recv_hidden`).
A KV pool stores and loads the same whole blocks.

Example
-------
>>> import torch
>>> blocks = request_blocks(torch.arange(10.)[:, None], [0, 10], block_size=4)
>>> [b.shape for b in blocks], [[(b, j) for b, j, _ in r] for r in deal_blocks(blocks, dcp_size=2)]
([torch.Size([3, 4, 1])], [[(0, 0), (0, 1)], [(0, 0)]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpattn._deprecation import renamed_kwargs
from cpattn.comm.group import Group
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.logits import acc_dtype
from cpattn.layout.dcp import HandoffFacts, dcp_owner, owned_blocks, reshard_kv_blocks
from cpattn.layout.rows import request_of

METHODS = ("a2a", "allgather")


def row_owners(plan, rank: int, *, dcp_size: int, interleave_size: int):
    """Request [T_r], position [T_r] and DCP owner [T_r] of prefill rank ``rank``'s rows (plan order)."""
    cu = plan.cu_seqlens.to(torch.int64)
    idx = plan.token_index[rank].to(torch.int64)
    req = request_of(cu, idx)  # [T_r]
    pos = plan.positions[rank].to(torch.int64)
    return req, pos, dcp_owner(pos, dcp_size, interleave_size)


@renamed_kwargs(prefill_size="pcp_size", decode_size="dcp_size")
def exchange(world: Group, rows: torch.Tensor | None, plan, *, pcp_size: int, dcp_size: int,
             interleave_size: int, width: int, dtype: torch.dtype, method: str = "a2a"):
    """Move prefill rows to their DCP owners over ``world`` (engines on the same ranks).

    rows: this rank's [T_r, F] prefill rows (None on a rank outside the
    prefill group, i.e. rank >= pcp_size); plan: the prefill plan (the
    same on every rank). Returns (rows [R, F], request [R], position [R],
    :class:`HandoffFacts`) of the R tokens this rank owns as a decode rank
    (R = 0 on ranks >= dcp_size).
    """
    if method not in METHODS:
        raise ValueError(f"hand-off method must be one of {METHODS}; got {method!r}")
    w, r = world.size, world.rank
    if not 1 <= pcp_size <= w or not 1 <= dcp_size <= w:
        raise ValueError(f"engines on the same {w} ranks need a prefill over ranks [0, pcp_size) and a decode over "
                         f"ranks [0, dcp_size), each size in 1..{w}; got pcp_size={pcp_size}, dcp_size={dcp_size}")
    moves = [row_owners(plan, j, dcp_size=dcp_size, interleave_size=interleave_size) if j < pcp_size
             else None for j in range(w)]
    if rows is None:
        rows = torch.zeros(0, width, dtype=dtype)
    before_sent, before_recv = world.stats.total_sent(), world.stats.total_recv()
    if method == "a2a":
        counts = torch.zeros(w, w, dtype=torch.int64)  # [sender, owner]
        for j, mv in enumerate(moves):
            if mv is not None:
                counts[j] = torch.bincount(mv[2], minlength=w)
        m = int(counts.max())
        buf = rows.new_zeros(w, m, width)  # slice d goes to rank d
        if moves[r] is not None:
            for d in range(w):
                mine = rows[moves[r][2] == d]
                buf[d, : mine.shape[0]] = mine
        recv = world.all_to_all(buf, dim=0)  # slice j came from rank j
        got = torch.cat([recv[j, : int(counts[j, r])] for j in range(w)])
    else:
        t_max = max(plan.num_tokens)
        pad = rows.new_zeros(t_max, width)
        pad[: rows.shape[0]] = rows
        every = world.all_gather(pad[None], dim=0)  # [W, t_max, F]
        got = torch.cat([every[j, : mv[0].numel()][mv[2] == r] for j, mv in enumerate(moves) if mv is not None])
    req = torch.cat([mv[0][mv[2] == r] for mv in moves if mv is not None])
    pos = torch.cat([mv[1][mv[2] == r] for mv in moves if mv is not None])
    kept = int((moves[r][2] == r).sum()) if moves[r] is not None else 0
    facts = HandoffFacts(rows_sent=int(rows.shape[0]) - kept, rows_kept=kept, rows_received=int(got.shape[0]) - kept,
                         bytes_sent=world.stats.total_sent() - before_sent,
                         bytes_received=world.stats.total_recv() - before_recv)
    return got, req, pos, facts


def place_rows(shard: PagedShard, rows: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor, *,
               rank: int, dcp_size: int) -> None:
    """Write rows [R, F] of (request, position) pairs into this DCP rank's shard; rows it does not own are skipped."""
    shard.write_rows(rows, shard.slots(positions, requests, rank, dcp_size))


def request_blocks(rows: torch.Tensor, cu_seqlens: list[int], block_size: int) -> list[torch.Tensor]:
    """Each request's rows [T, F] (request order) as whole blocks [n_b, block_size, F]; rows past its end are NaN."""
    out = []
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        n = -(-(b - a) // block_size)
        blk = rows.new_full((n * block_size, rows.shape[1]), float("nan"))
        blk[: b - a] = rows[a:b]
        out.append(blk.view(n, block_size, rows.shape[1]))
    return out


@renamed_kwargs(decode_size="dcp_size")
def deal_blocks(blocks: list[torch.Tensor], *, dcp_size: int) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Per decode rank d: ``(request, local block, payload [block_size, F])`` for each block j with j % N == d."""
    out: list[list] = [[] for _ in range(dcp_size)]
    for b, blk in enumerate(blocks):  # [n_b, block_size, F]: whole blocks, interleave = block size
        parts = reshard_kv_blocks(blk, dcp_size=dcp_size, interleave_size=blk.shape[1], block_size=blk.shape[1])
        for d, part in enumerate(parts):
            out[d].extend((b, i, payload) for i, payload in enumerate(part))
    return out


def place_blocks(shard: PagedShard, received: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy received ``(request, local block, payload)`` into the shard at ``block_table[request, local block]``."""
    for b, i, payload in received:
        shard.write_block(int(shard.block_table[b, i]), payload)


def _world(world: Group | None) -> Group:
    """The group point-to-point messages travel in: ``world``, or torch.distributed's world group (legacy)."""
    if world is not None:
        return world
    from cpattn.comm.dist import DistGroup

    return DistGroup()


def _pair_blocks(lens_blocks: list[int], p: int, pcp_size: int, d: int, dcp_size: int,
                 start: list[int] | None = None) -> list[tuple[int, int]]:
    """(request, global block) pairs prefill rank p sends decode rank d, in request then block order: blocks
    ``[start[b], lens_blocks[b])`` of request b (``start``: blocks the decode ranks already hold, default none)."""
    start = start or [0] * len(lens_blocks)
    return [(b, j) for b, nb in enumerate(lens_blocks) for j in owned_blocks(nb, d, dcp_size, start=start[b])
            if j % pcp_size == p]


@renamed_kwargs(prefill_size="pcp_size")
def send_block_pairs(world: Group, payload: Callable[[int, int], torch.Tensor], nblocks: list[int], *,
                     prefill_rank: int, pcp_size: int, decode_ranks: list[int],
                     start: list[int] | None = None) -> list[int]:
    """Send this prefill rank's share of whole blocks point to point: block j of request b (``start[b] <= j <
    nblocks[b]``, j % P == ``prefill_rank``) goes to decode rank j % N, ``payload(b, j) -> [block_size, F]``.

    One message per decode rank that gets any ([n, block_size, F], its blocks in request then block order),
    decode ranks in order, to ranks ``decode_ranks`` of ``world``; :func:`recv_block_pairs` takes them
    prefill ranks in order, so the sends and receives form no cycle. Returns the bytes sent per request.
    """
    sent = [0] * len(nblocks)
    for d, dst in enumerate(decode_ranks):
        mine = _pair_blocks(nblocks, prefill_rank, pcp_size, d, len(decode_ranks), start)
        if mine:
            rows = [payload(b, j) for b, j in mine]
            world.send(torch.stack(rows), dst)  # [n, block_size, F]
            for (b, _), row in zip(mine, rows):
                sent[b] += row.nbytes
    return sent


@renamed_kwargs(decode_size="dcp_size")
def recv_block_pairs(world: Group, nblocks: list[int], *, decode_rank: int, dcp_size: int,
                     prefill_ranks: list[int], block_size: int, width: int, dtype: torch.dtype,
                     start: list[int] | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """What :func:`send_block_pairs` sent this decode rank: ``{(request, global block): payload [block_size, F]}``
    (blocks j % N == ``decode_rank`` of ``[start[b], nblocks[b])``), from ranks ``prefill_ranks`` of ``world``."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    p = len(prefill_ranks)
    for i, src in enumerate(prefill_ranks):
        mine = _pair_blocks(nblocks, i, p, decode_rank, dcp_size, start)
        if mine:
            got.update(zip(mine, world.recv((len(mine), block_size, width), dtype, src).unbind(0)))
    return got


@renamed_kwargs(prefill_size="pcp_size")
def send_blocks(blocks: list[torch.Tensor], first_logits: torch.Tensor | None, *, prefill_rank: int,
                pcp_size: int, decode_ranks: list[int], world: Group | None = None,
                start: list[int] | None = None) -> HandoffFacts:
    """Send this prefill rank's share of the blocks (block j of every request when j % P == rank) to the
    decode ranks (ranks ``decode_ranks`` of ``world``) point to point (:meth:`~cpattn.comm.group.Group.send`);
    prefill rank 0 first sends every decode rank the first-token logits [B, V].

    The blocks go as :func:`send_block_pairs` sends them. world: the group ``decode_ranks`` index (default:
    torch.distributed's world). start: per request, the global index of its first block in ``blocks`` (the
    whole blocks of a cached prefix, which the decode ranks hold already: a prefill that started from it
    computed only the blocks after it); default 0.
    """
    world = _world(world)
    start = list(start) if start else [0] * len(blocks)
    nb = [s + int(blk.shape[0]) for s, blk in zip(start, blocks)]
    if first_logits is not None:
        for dst in decode_ranks:
            world.send(first_logits, dst)
    sent = send_block_pairs(world, lambda b, j: blocks[b][j - start[b]], nb, prefill_rank=prefill_rank,
                            pcp_size=pcp_size, decode_ranks=decode_ranks, start=start)
    n = sum(len(_pair_blocks(nb, prefill_rank, pcp_size, d, len(decode_ranks), start))
            for d in range(len(decode_ranks)))
    return HandoffFacts(blocks_sent=n, bytes_sent=sum(sent))


@renamed_kwargs(decode_size="dcp_size")
def recv_blocks(prompt_lens: list[int], *, decode_rank: int, dcp_size: int, prefill_ranks: list[int],
                block_size: int, width: int, dtype: torch.dtype, vocab_size: int, world: Group | None = None,
                start: list[int] | None = None):
    """Receive this decode rank's blocks (and the first-token logits from prefill rank 0) over ``world``
    (what :func:`send_blocks` sent; ``prefill_ranks``: ranks of ``world``, default torch.distributed's world;
    ``start``: per request, the blocks before it are not sent, as :func:`send_blocks` took it).

    Returns (received ``[(request, local block, payload [block_size, F])]`` in request then block order,
    first_logits [B, V] float32 (float64 in a float64 run), :class:`HandoffFacts`).
    """
    world = _world(world)
    first_logits = world.recv((len(prompt_lens), vocab_size), acc_dtype(dtype), prefill_ranks[0])  # as the prefill's
    nb = [-(-m // block_size) for m in prompt_lens]
    start = list(start) if start else [0] * len(nb)
    got = recv_block_pairs(world, nb, decode_rank=decode_rank, dcp_size=dcp_size, prefill_ranks=prefill_ranks,
                           block_size=block_size, width=width, dtype=dtype, start=start)
    received = [(b, j // dcp_size, got[(b, j)]) for b in range(len(nb))
                for j in owned_blocks(nb[b], decode_rank, dcp_size, start=start[b])]
    nbytes = sum(buf.numel() * buf.element_size() for _, _, buf in received)
    return received, first_logits, HandoffFacts(blocks_received=len(received), bytes_received=nbytes)


def send_hidden(hidden: dict, decode_ranks: list[int], world: Group | None = None) -> None:
    """P/D: prefill rank 0 sends the prompts' hidden states ``{name: [T, ...]}`` (layer indices ascending,
    then "norm") to every decode rank (ranks of ``world``), point to point: first each one's width F (int64
    [names]; a DeepSeek-V4 layer's row is its n_hc streams, n_hc * H), then the rows flattened to [T, F]."""
    world = _world(world)
    names = [*sorted(n for n in hidden if n != "norm"), "norm"]
    flat = [hidden[name].reshape(hidden[name].shape[0], -1) for name in names]  # [T, F] each
    widths = torch.tensor([h.shape[1] for h in flat], dtype=torch.int64)
    for r in decode_ranks:
        world.send(widths, r)
        for h in flat:
            world.send(h, r)


def recv_hidden(names: list, tokens: int, dtype: torch.dtype, src: int, world: Group | None = None) -> dict:
    """P/D: a decode rank receives what :func:`send_hidden` sent from rank ``src`` of ``world``: ``{name: [T, F]}``."""
    world = _world(world)
    widths = world.recv((len(names),), torch.int64, src)
    return {name: world.recv((tokens, f), dtype, src) for name, f in zip(names, widths.tolist())}
