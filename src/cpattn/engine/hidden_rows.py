"""A drafter's hidden rows across the P/D link: what a producer stages of a request's kept target hidden
states (a drafter that reads them: MTP, Eagle3, DSpark) and their wire form rank to rank.

:class:`~cpattn.engine.connector_pd.PDConnector` uses these: :func:`staged_hidden` cuts the rows of the
positions the consumer will not compute, :func:`send_hidden_rows` / :func:`recv_hidden_rows` carry them
over a :class:`~cpattn.comm.group.Group` (an int64 header, then one ``[sum rows, sum widths]`` tensor).
:class:`HiddenRowsMixin` is the connector side every P/D connector kind shares (the paged one, DeepSeek-V4's,
the hybrid one): stage at save, send after the payload, receive after it, give them to the engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

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


def handed_hidden(connector, request_id: Hashable, begin: int, end: int) -> dict:
    """A P/D consumer runner's hidden rows for a prompt row it computes none of (DeepSeek-V4, hybrid: the
    producer handed the state over): ``{name: [end - begin, F]}``, the handed rows of positions ``begin ..
    end - 1`` (``connector.hidden_rows``), which the step hands back as if it had computed them.

    >>> class Held(HiddenRowsMixin):
    ...     _hidden_in = {"r": (0, {"norm": torch.arange(10.0).view(5, 2)})}
    >>> handed_hidden(Held(), "r", 2, 4)["norm"].tolist()
    [[4.0, 5.0], [6.0, 7.0]]
    """
    got = connector.hidden_rows(request_id, end)
    if got is None or got[0] > begin:
        raise RuntimeError(f"request {request_id!r}: the P/D producer handed over no hidden rows of positions "
                           f"{begin}..{end - 1}; both roles keep the drafter's hidden_layers (PDEngine, run_rank)")
    start, rows = got
    return {n: r[begin - start:] for n, r in rows.items()}


def _in_memory(link) -> bool:
    from cpattn.engine.connector_pd import MemoryLink  # (it imports this module)

    return isinstance(link, MemoryLink)


class HiddenRowsMixin:
    """The hidden rows side of a P/D connector (module doc), for a drafter that reads the target's hidden
    states; inert when the engine keeps none (``side.hidden_layers`` None). Uses the connector's ``side``,
    ``link`` (a ``MemoryLink``: one copy in memory; a ``GroupLink``: consumer rank d from producer rank
    ``d % P``), ``dtype`` and ``_stats``. The producer's rows go after its payload, so a kind sends (and its
    consumer receives) them last.

    >>> from types import SimpleNamespace
    >>> held = HiddenRowsMixin()
    >>> held._bind_hidden(SimpleNamespace(hidden_layers=(1,)))
    >>> held.hidden_names, held.hidden_rows("r", 3)
    ([1, 'norm'], None)
    """

    hidden_names: list | None = None

    def _bind_hidden(self, side) -> None:
        """Start empty for ``side``'s engine: the names of the rows it keeps, none staged or held."""
        self.hidden_names = hidden_names(side.hidden_layers)
        self._hidden_out, self._hidden_in = {}, {}

    def _stage_hidden(self, request_id: Hashable, upto: int) -> None:
        """Producer, at save: stage the kept rows of positions before ``upto`` (:func:`staged_hidden`)."""
        if self.hidden_names is not None:
            self._hidden_out[request_id] = staged_hidden(self.side.hidden(request_id), upto, self.hidden_names)

    def _send_hidden(self, handed: Sequence) -> None:
        """Producer, at send: the rows staged for ``handed`` to the consumer ranks this rank serves, counted
        (``bytes_by_request``, ``bytes_sent``, ``hidden_bytes_sent``); the rows of requests not handed dropped."""
        if self.hidden_names is not None and handed:
            st = self._stats
            for h, nbytes in zip(handed, self._send_hidden_rows(handed)):
                st.bytes_by_request[h.request_id] = st.bytes_by_request.get(h.request_id, 0) + nbytes
                st.bytes_sent += nbytes
                st.hidden_bytes_sent += nbytes
        if self.hidden_names is not None:
            self._hidden_out.clear()

    def _send_hidden_rows(self, handed: Sequence) -> list[int]:
        rows = [self._hidden_out.get(h.request_id, (0, None)) for h in handed]
        sent = [0] * len(handed)
        if _in_memory(self.link):
            self.link._hidden.append(rows)  # one copy, as every consumer rank would get it
            return [0 if r is None else self.link.consumer_size * sum(t.nbytes for t in r.values()) for _, r in rows]
        s, world, p = self.side, self.link.world, len(self.link.producers)
        for d, dst in enumerate(self.link.consumers):
            if d % p == s.rank:
                n = send_hidden_rows(world, dst, rows, self.hidden_names, self.dtype)
                sent = [a + b for a, b in zip(sent, n)]
        return sent

    def _recv_hidden(self, handed: Sequence) -> None:
        """Consumer, at recv: take the rows :meth:`_send_hidden` sent this rank (every rank, in memory)."""
        if self.hidden_names is None or not handed:
            return
        if _in_memory(self.link):
            if not self.link._hidden:
                raise RuntimeError("MemoryLink: no hidden rows were sent; call the producer's send first")
            rows = self.link._hidden.popleft()
        else:
            src = self.link.producers[self.side.rank % len(self.link.producers)]
            rows = recv_hidden_rows(self.link.world, src, len(handed), self.hidden_names, self.dtype)
        for h, (start, r) in zip(handed, rows):
            if r is not None:
                self._hidden_in[h.request_id] = (start, r)
                nbytes = sum(t.nbytes for t in r.values()) * (self.link.consumer_size if self.side.rank is None else 1)
                self._stats.hidden_bytes_received += nbytes
                self._stats.bytes_received += nbytes

    def hidden_rows(self, request_id, context_len):
        """Consumer: the handed rows of positions before ``context_len`` (``KVConnector.hidden_rows``)."""
        held = getattr(self, "_hidden_in", None)
        got = held.get(request_id) if held else None
        if got is None:
            return None
        start, rows = got
        n = next(iter(rows.values())).shape[0]
        if not start < context_len <= start + n:  # they do not reach (or continue to) the first computed row
            return None
        return start, {k: v[:context_len - start] for k, v in rows.items()}
