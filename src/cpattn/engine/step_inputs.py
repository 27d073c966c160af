"""Host-side inputs of a runner step that persist across steps: the block table rows, a replay's token and
length vectors (:class:`HostInts`, written in place), and the logits rows each sampled token came from,
sliced only when asked for; :func:`int64` (a host int64 tensor from ints without ``torch.tensor``'s
per-element conversion), :func:`flat` (a step's tokens in one list) and :class:`OneTokenRows` (one sampled
token per row, as the scheduler's update reads it, with no per-row objects until one is looked up).

A step loop's batch changes little from one step to the next: the same requests in the same rows, a block
id appended to a row every ``block_size * dcp_size`` tokens. :class:`BlockTableRows` keeps one
``[rows, width]`` int64 table and, per row, the block ids it holds (the tuple it was given); a step writes
only the rows whose tables changed -- an unchanged row (the same tuple object, as
:meth:`cpattn.engine.blocks.BlockManager.table_ids` hands out, or an equal one) costs one comparison, a
grown row its new columns, any other row is rewritten -- in one indexed write for the whole step; the
very tuple of tables of the last call (a steady decode step hands on the previous one) costs nothing.
(vLLM's persistent input batch keeps its block tables the same way; the code is ours.)

Example
-------
>>> rows = BlockTableRows(width=4, pad=9)
>>> rows.update([(0, 1), (2,)]).tolist()
[[0, 1, 9, 9], [2, 9, 9, 9]]
>>> rows.update([(0, 1, 3), (5, 6)]).tolist()    # row 0 grew (one cell written), row 1 was replaced
[[0, 1, 3, 9], [5, 6, 9, 9]]
>>> rows.writes                                   # cells written so far
6
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from itertools import chain

import torch

from cpattn.engine.scheduler import ModelOutput


def int64(values: Iterable[int]) -> torch.Tensor:
    """A [N] int64 CPU tensor of ``values`` (Python ints), built through an ``array('q')`` buffer: about
    1 us for 32 values against ~4 us for ``torch.tensor`` (measured on the shared CPU box). The tensor owns
    its buffer (a fresh one per call).

    >>> int64([3, 1, 2]).tolist(), int64([]).shape
    ([3, 1, 2], torch.Size([0]))
    """
    buf = array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.zeros(0, dtype=torch.int64)


def flat(rows: Iterable[Sequence[int]]) -> list[int]:
    """The tokens of ``rows`` (a step's ``input_ids``) in order; rows of one token each (a decode step's)
    unpacked in one pass, about twice as fast as ``chain.from_iterable``.

    >>> flat([(3,), (4,)]), flat([(3,), (4, 5)])
    ([3, 4], [3, 4, 5])
    """
    try:
        return [t for t, in rows]
    except ValueError:  # a row of several tokens (a prefill chunk, drafts) or none
        return list(chain.from_iterable(rows))


class HostInts:
    """A persistent [N] int64 host tensor written in place from Python ints: :meth:`write` copies the values
    into the ``array('q')`` the tensor shares its memory with (``torch.frombuffer``) and returns the view of
    its first ``len(values)`` entries -- made once per length -- valid until the next write. A step's
    inputs cost no tensor then (what :func:`int64` makes per call); it grows (doubling) past its capacity.

    >>> ints = HostInts(2)
    >>> a = ints.write([4, 5, 6]); a.tolist(), ints.write([7, 8]).tolist(), a.tolist()   # a: overwritten
    ([4, 5, 6], [7, 8], [7, 8, 6])
    """

    __slots__ = ("_buf", "_mem", "tensor", "_views")

    def __init__(self, capacity: int = 8) -> None:
        self._alloc(max(capacity, 1))

    def _alloc(self, n: int) -> None:
        self._buf = array("q", bytes(8 * n))  # exported to the tensor: the array can no longer resize
        self._mem, self.tensor, self._views = memoryview(self._buf), torch.frombuffer(self._buf, dtype=torch.int64), {}

    def write(self, values: Iterable[int]) -> torch.Tensor:
        vals = array("q", values)
        n = len(vals)
        if n > len(self._buf):
            self._alloc(max(n, 2 * len(self._buf)))
        self._mem[:n] = vals
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.tensor[:n]
        return view


class BlockTableRows:
    """A persistent ``[rows, width]`` int64 block table padded with ``pad`` (module docstring).

    :meth:`update` returns a view of its first B rows, valid until the next call: copy it to keep it.
    ``writes`` counts the cells written (a test's window into the incremental path).
    """

    def __init__(self, width: int, pad: int, rows: int = 8) -> None:
        self.width, self.pad = width, pad
        self.table = torch.full((max(rows, 1), width), pad, dtype=torch.int64)
        self._held: list[tuple] = [()] * self.table.shape[0]
        self.writes = 0
        self._last: tuple = ((), None)  # (tables, the view returned for them) of the last update

    def update(self, tables: Sequence[Sequence[int]], req_ids: Sequence[Hashable] = ()) -> torch.Tensor:
        """Rows ``0 .. B-1`` hold ``tables[b]`` (block ids, padded); returns ``table[:B]`` [B, width].

        req_ids: named in the error for a table wider than ``width``.
        """
        last, view = self._last
        if tables is last and view is not None:  # the same tuple of tables again (a steady decode step)
            return view
        n_rows, width = len(tables), self.width
        if n_rows > self.table.shape[0]:  # grow (doubling), the rows held so far kept
            grown = torch.full((max(n_rows, 2 * self.table.shape[0]), width), self.pad, dtype=torch.int64)
            grown[: self.table.shape[0]] = self.table
            self._held += [()] * (grown.shape[0] - self.table.shape[0])
            self.table = grown
        held, flat, vals, frozen = self._held, [], [], type(tables) is tuple
        for b, ids in enumerate(tables):
            old = held[b]
            if ids is old:
                continue
            if type(ids) is not tuple:  # a list may change in place: no shortcut for these tables next time
                frozen = False
            ids = tuple(ids)
            n, n_old = len(ids), len(old)
            if n == n_old and ids == old:
                held[b] = ids
                continue
            if n > width:
                who = f"request {req_ids[b]!r}" if b < len(req_ids) else f"row {b}"
                raise ValueError(f"{who} holds {n} blocks; the runner was built for max_model_len covering "
                                 f"{width}: raise max_model_len")
            start = n_old if n >= n_old and ids[:n_old] == old else 0
            base = b * width
            flat.extend(range(base + start, base + n))
            vals.extend(ids[start:])
            if n < n_old:  # a shorter table: the cells past it go back to the pad
                flat.extend(range(base + n, base + n_old))
                vals.extend([self.pad] * (n_old - n))
            held[b] = ids
        if flat:
            self.table.view(-1)[torch.tensor(flat, dtype=torch.int64)] = torch.tensor(vals, dtype=torch.int64)
            self.writes += len(flat)
        view = self.table[:n_rows]
        self._last = (tables, view) if frozen else ((), None)
        return view


class LogitRows(Mapping):
    """``{req_id: logits[lo:hi]}`` over one step's logits, each slice made when looked up.

    logits: [T, V]; spans: ``{req_id: (lo, hi)}`` -- the rows the request's sampled tokens came from.

    >>> rows = LogitRows(torch.arange(6.).view(3, 2), {"a": (2, 3)})
    >>> list(rows), rows["a"].tolist(), len(rows)
    (['a'], [[4.0, 5.0]], 1)
    """

    __slots__ = ("logits", "spans")

    def __init__(self, logits: torch.Tensor, spans: dict) -> None:
        self.logits, self.spans = logits, spans

    def __getitem__(self, req_id: Hashable) -> torch.Tensor:
        lo, hi = self.spans[req_id]
        return self.logits[lo:hi]

    def __iter__(self) -> Iterator:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.spans


class OneTokenRows(Mapping):
    """``{req_id: ModelOutput((token,))}`` of a step that sampled exactly one token in every row
    (``tokens[b]`` for ``req_ids[b]``, no drafts), each ModelOutput made only when looked up.
    :meth:`cpattn.engine.scheduler.Scheduler.update` commits it row by row without them.
    ``spans``: ``{req_id: (b, b + 1)}``, the logits row each token came from (for :class:`LogitRows`).

    >>> rows = OneTokenRows(("a", "b"), [5, 7])
    >>> rows["b"], list(rows), rows.spans["b"], "c" in rows
    (ModelOutput(sampled=(7,), drafts=()), ['a', 'b'], (1, 2), False)
    """

    __slots__ = ("req_ids", "tokens", "_index")
    one_token_per_row = True  # what Scheduler.update looks for (it does not import this module)

    def __init__(self, req_ids: Sequence[Hashable], tokens: Sequence[int]) -> None:
        if len(req_ids) != len(tokens):
            raise ValueError(f"OneTokenRows: {len(req_ids)} req_ids but {len(tokens)} tokens; pass one token per row")
        self.req_ids, self.tokens, self._index = req_ids, tokens, None

    def _where(self) -> dict:
        if self._index is None:
            self._index = dict(zip(self.req_ids, range(len(self.req_ids))))
        return self._index

    def __getitem__(self, req_id: Hashable) -> ModelOutput:
        return ModelOutput((self.tokens[self._where()[req_id]],))

    def __iter__(self) -> Iterator:
        return iter(self.req_ids)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._where()

    @property
    def spans(self) -> Mapping:
        return _UnitSpans(self)


class _UnitSpans(Mapping):
    """``{req_id: (b, b + 1)}`` of a :class:`OneTokenRows` (its index built at the first lookup)."""

    __slots__ = ("rows",)

    def __init__(self, rows: OneTokenRows) -> None:
        self.rows = rows

    def __getitem__(self, req_id: Hashable) -> tuple[int, int]:
        b = self.rows._where()[req_id]
        return b, b + 1

    def __iter__(self) -> Iterator:
        return iter(self.rows.req_ids)

    def __len__(self) -> int:
        return len(self.rows.req_ids)
