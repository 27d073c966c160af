"""A drafter's hidden rows across the P/D link: what a producer stages of a request's kept target hidden
states (a drafter that reads them: MTP, Eagle3, DSpark) and their wire form rank to rank.

:class:`~cpattn.engine.connector_pd.PDConnector` uses these: :func:`staged_hidden` cuts the rows of the
positions the consumer will not compute, :func:`send_hidden_rows` / :func:`recv_hidden_rows` carry them
over a :class:`~cpattn.comm.group.Group` (an int64 header, then one ``[sum rows, sum widths]`` tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpattn.comm.group import Group


def hidden_names(hidden_layers: tuple | None) -> list | None:
    """The names of the hidden rows an engine keeps for ``hidden_layers`` (a drafter's), in the order they
    travel: layer indices ascending, then "norm" (None: no rows kept).

    >>> hidden_names((3, 1)), hidden_names(()), hidden_names(None)
    ([1, 3, 'norm'], ['norm'], None)
    """
    return None if hidden_layers is None else [*sorted(hidden_layers), "norm"]


def staged_hidden(kept: tuple[int, dict] | None, upto: int, names: Sequence) -> tuple[int, dict | None]:
    """What a producer hands over of one request's kept hidden rows ``kept = (start, {name: [n, ...]})``
    (positions ``start .. start + n - 1``; None: none kept): ``(start, {name: [m, F]})``, the rows of positions
    ``start .. upto - 1`` (``upto``: the first position the consumer may compute, its usable blocks' end),
    flattened to [m, F] and cloned; ``(start, None)`` when there are none (a prefix the producer did not
    compute, or nothing the consumer lacks).

    >>> start, rows = staged_hidden((0, {"norm": torch.arange(12.0).view(6, 2)}), 4, ["norm"])
    >>> start, rows["norm"].shape
    (0, torch.Size([4, 2]))
    >>> staged_hidden((4, {"norm": torch.zeros(2, 2)}), 4, ["norm"])
    (4, None)
    """
    if kept is None or kept[0] >= upto:
        return (0 if kept is None else kept[0]), None
    start, rows = kept
    m = upto - start
    if next(iter(rows.values())).shape[0] < m:
        raise RuntimeError(f"the producer kept hidden rows of positions {start}.. but not up to {upto - 1}; "
                           "a finished prompt's rows are all kept (LLMEngine(hidden_layers=))")
    return start, {n: rows[n][:m].reshape(m, -1).clone() for n in names}


def send_hidden_rows(world: Group, dst: int, rows: Sequence[tuple[int, dict | None]], names: Sequence,
                     dtype: torch.dtype) -> list[int]:
    """Send one consumer rank (``dst`` of ``world``) the hidden rows of a hand-off's requests, ``rows[b] =
    (start, {name: [m_b, F]} or None)``: an int64 header ``[2B + len(names)]`` (each request's start and m_b,
    then each name's width F, 0 when no request has rows), then, if any, the rows ``[sum m_b, sum F]`` in
    ``dtype``. Returns the bytes sent per request. :func:`recv_hidden_rows` is its other side."""
    have = [r for _, r in rows if r is not None]
    widths = [have[0][n].shape[1] for n in names] if have else [0] * len(names)
    head = [v for start, r in rows for v in (start, 0 if r is None else next(iter(r.values())).shape[0])]
    world.send(torch.tensor(head + widths, dtype=torch.int64), dst)
    if not have:
        return [0] * len(rows)
    flat = torch.cat([torch.cat([r[n].to(dtype) for n in names], 1) for r in have])  # [sum m_b, sum F]
    world.send(flat, dst)
    return [0 if r is None else next(iter(r.values())).shape[0] * flat.shape[1] * flat.element_size() for _, r in rows]


def recv_hidden_rows(world: Group, src: int, num_requests: int, names: Sequence,
                     dtype: torch.dtype) -> list[tuple[int, dict | None]]:
    """What :func:`send_hidden_rows` sent from rank ``src`` of ``world``: ``[(start, {name: [m_b, F]} or None)]``
    for the hand-off's ``num_requests`` requests."""
    head = world.recv((2 * num_requests + len(names),), torch.int64, src).tolist()
    starts, counts, widths = head[0:2 * num_requests:2], head[1:2 * num_requests:2], head[2 * num_requests:]
    if not sum(counts):
        return [(s, None) for s in starts]
    flat = world.recv((sum(counts), sum(widths)), dtype, src)
    out, at = [], 0
    for start, m in zip(starts, counts):
        if not m:
            out.append((start, None))
            continue
        cols = torch.split(flat[at:at + m], widths, 1)
        out.append((start, dict(zip(names, cols))))
        at += m
    return out
