"""``DecodeRunner``: FULL_DECODE_ONLY graph capture with an eager fallback (DESIGN.md §4.6).

A decode program is one pure step function::

    step(state, batch) -> outputs

- ``state``: a pytree (dict) of tensors that live across steps -- weights,
  KV caches. The runner passes the very same objects every time; the step
  updates caches in place through mutating ops (``write_kv``).
- ``batch``: ``dict[str, Tensor]`` of this step's inputs, each declared by a
  :class:`Field` (one row per query token, or one row per request), plus
  ``batch["cu_seqlens_q"]`` ([B+1] int32) which the runner adds (in a
  replay, B counts the padding requests too).
- ``outputs``: a tensor or a tuple/list/dict of tensors, each with one row
  per query token or one row per request.

Uniform decode batches (every request has ``1 + num_speculative_tokens``
query tokens, at most the largest capture size in total) are padded to the
next capture size, copied into persistent buffers and replayed; everything
else (prefill, mixed, oversized) calls ``step`` eagerly on the unpadded
batch -- the same function, the same ``torch.ops.cpattn.*`` ops::

    T tokens  ->  pick size S >= T  ->  rows T..S-1 get each field's pad value
                  (slot -1: no KV write; seq_len 0: no keys, LSE -inf)
              ->  replay graph[S]  ->  outputs[:T] (or [:B] per request)

Padding requests own no query rows: ``cu_seqlens_q`` stays at T after the
B real requests (``[0, q, 2q, .., T, T, .., T]``, as vLLM pads its
``query_start_loc``), so padding token rows belong to no request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cpattn.graphs import buckets
from cpattn.graphs.backends import Backend, get_backend
from cpattn.layout.rows import cu_seqlens

ROWS = ("token", "request")
CU_SEQLENS = "cu_seqlens_q"


@dataclass(frozen=True)
class Field:
    """Declaration of one per-step input held in a persistent buffer.

    rows: "token" -> the input is ``[T, *shape]`` (one row per query token);
        "request" -> ``[B, *shape]`` (one row per request).
    shape: trailing dims after the row dim, e.g. ``(hidden,)`` or
        ``(max_blocks,)``.
    dtype: buffer dtype (inputs are cast on copy).
    pad: value of padding rows. Choose it so a padding row is inert:
        ``slot_mapping`` -1 (no KV write), ``seq_lens`` 0 (no visible key,
        so attention gives out 0 and LSE -inf), block ids 0, activations 0.

    Example
    -------
    >>> import torch
    >>> Field("token", (), torch.int64, pad=-1)  # a slot mapping
    Field(rows='token', shape=(), dtype=torch.int64, pad=-1)
    """

    rows: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    pad: float | int = 0

    def __post_init__(self):
        if self.rows not in ROWS:
            raise ValueError(f"Field.rows must be one of {ROWS}; got {self.rows!r}")


@dataclass
class RunnerStats:
    """Which path each step took.

    graph / eager: step counts; sizes: replays per capture size; reasons:
    eager steps by cause ("prefill", "mixed", "oversized", "not_captured",
    "empty"); padded_tokens: padding rows replayed in total; last: the path
    of the latest step, e.g. "graph:8" or "eager:mixed".
    """

    graph: int = 0
    eager: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    padded_tokens: int = 0
    last: str = ""

    def as_dict(self) -> dict:
        return {
            "graph": self.graph, "eager": self.eager, "sizes": dict(self.sizes),
            "reasons": dict(self.reasons), "padded_tokens": self.padded_tokens, "last": self.last,
        }


class DecodeRunner:
    """Replays captured decode programs for uniform decode batches, runs the rest eagerly.

    Arguments
    ---------
    step: ``step(state, batch) -> outputs`` (see module doc). Inside a
        captured step nothing may sync to the host, allocate by data or
        change shape: see :func:`cpattn.graphs.check.check_static`.
    state: pytree of persistent tensors (weights, KV caches), passed as is.
    fields: name -> :class:`Field` for every per-step input.
    num_speculative_tokens: k; a decode request has ``1 + k`` query tokens.
    capture_sizes: sizes in query tokens (multiples of ``1 + k``); default
        :func:`cpattn.graphs.buckets.capture_sizes` up to ``max_size``.
    max_size: the largest default capture size, in tokens.
    backend: a name from :func:`cpattn.graphs.backends.backends` or a
        :class:`~cpattn.graphs.backends.Backend`; "auto" picks by device.
        Under the simulated mesh (``cpattn.simulate``, threads) use "eager":
        its collectives are not traceable.
    device: where the persistent buffers live (default: the first state tensor's).

    Example
    -------
    >>> import torch
    >>> from cpattn.graphs import DecodeRunner, Field
    >>> w = torch.randn(4, 4)
    >>> def step(state, batch):
    ...     return batch["x"] @ state["w"]
    >>> runner = DecodeRunner(step, {"w": w}, {"x": Field("token", (4,))},
    ...                       capture_sizes=[2, 4], backend="eager")
    >>> _ = runner.capture()
    >>> out = runner({"x": torch.randn(3, 4)}, query_lens=[1, 1, 1])  # padded to 4
    >>> out.shape, runner.stats.last
    (torch.Size([3, 4]), 'graph:4')
    >>> out = runner({"x": torch.randn(5, 4)}, query_lens=[5])  # prefill: eager
    >>> runner.stats.last
    'eager:prefill'
    """

    def __init__(
        self,
        step: Callable[[Any, dict[str, torch.Tensor]], Any],
        state: Any,
        fields: Mapping[str, Field],
        *,
        num_speculative_tokens: int = 0,
        capture_sizes: Sequence[int] | None = None,
        max_size: int = 32,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
    ):
        if CU_SEQLENS in fields:
            raise ValueError(f"field name {CU_SEQLENS!r} is reserved: the runner builds it from query_lens")
        for name, f in fields.items():
            if not isinstance(f, Field):
                raise TypeError(f"fields[{name!r}] must be a cpattn.graphs.Field; got {type(f).__name__}")
        self.step = step
        self.state = state
        self.fields = dict(fields)
        self.q_len = 1 + int(num_speculative_tokens)
        self.sizes = (
            buckets.capture_sizes(max_size, num_speculative_tokens)
            if capture_sizes is None
            else buckets.check_sizes(capture_sizes, num_speculative_tokens)
        )
        leaves = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        self.device = torch.device(device) if device is not None else (leaves[0].device if leaves else torch.device("cpu"))
        self.backend = get_backend(backend, self.device)
        self.stats = RunnerStats()
        self._buffers: dict[str, torch.Tensor] = {}
        self._programs: dict[int, Callable[[], Any]] = {}
        self._slices: dict[tuple, torch.Tensor] = {}  # (field, start, stop) -> that view of its buffer
        self._shapes: dict[tuple, tuple] = {}  # (tokens, requests) -> the shape each field's input must have

    # -- capture -----------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return bool(self._programs)

    def capture(self) -> DecodeRunner:
        """Allocate the persistent buffers and capture one program per size (largest first).

        Buffers are filled with each field's pad value, so capture-time runs
        write no KV and read no keys. Returns ``self``.
        """
        top = self.sizes[-1]
        self._buffers = {name: self._alloc(f, self._rows(f, top)) for name, f in self.fields.items()}
        # cu_seqlens_q of whole requests of q_len tokens, clamped at each step's
        # token count so padding requests own no rows (all zero: all padding)
        self._cu_full = torch.arange(0, top + 1, self.q_len, dtype=torch.int32, device=self.device)
        self._buffers[CU_SEQLENS] = torch.zeros_like(self._cu_full)
        self._dirty: dict[str, int] = {}  # per field: the rows past this one hold its pad (capture: all)
        self._cu_for: tuple | None = None  # (requests, tokens) that the cu_seqlens_q buffer was made for
        self._slices = {}  # the views of the old buffers are gone
        for size in reversed(self.sizes):
            batch = self._views(size)
            self._check_outputs(size, self._capture_one(size, batch))
        return self

    def _capture_one(self, size: int, batch: dict[str, torch.Tensor]) -> Any:
        try:
            replay = self.backend.capture(self.step, (self.state, batch), size)
        except Exception as e:
            raise RuntimeError(
                f"capturing the decode step for size {size} with backend {self.backend.name!r} failed: "
                f"{type(e).__name__}: {e}\nA captured step must have no host sync (.item(), .tolist(), "
                "Python branches on tensor values), no data-dependent shapes and no untraceable calls; "
                "cpattn.graphs.check.check_static(step, state, batch) finds them on CPU. Steps that use "
                "the simulated mesh (cpattn.simulate, threads) cannot be traced: use backend='eager' there."
            ) from e
        self._programs[size] = replay
        return replay()  # one replay on pad-filled buffers: outputs' shapes

    def _check_outputs(self, size: int, out: Any) -> None:
        n_req = size // self.q_len
        for leaf in pytree.tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] not in (size, n_req):
                shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise ValueError(
                    f"step outputs must be tensors with one row per query token ({size}) or per request "
                    f"({n_req}) at capture size {size}; got {shape}. Return per-token or per-request tensors only"
                )

    def _alloc(self, f: Field, rows: int) -> torch.Tensor:
        return torch.full((rows, *f.shape), f.pad, dtype=f.dtype, device=self.device)

    def _rows(self, f: Field, tokens: int) -> int:
        return tokens if f.rows == "token" else tokens // self.q_len

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        views = {name: self._buffers[name][: self._rows(f, size)] for name, f in self.fields.items()}
        views[CU_SEQLENS] = self._buffers[CU_SEQLENS][: size // self.q_len + 1]
        return views

    # -- run -----------------------------------------------------------------------
    def classify(self, query_lens: Sequence[int]) -> tuple[str, int | None]:
        """("graph", size) for a uniform decode batch that fits, else ("eager", reason)."""
        num_tokens = sum(query_lens)
        if not query_lens or num_tokens == 0:
            return "eager", "empty"
        decode = sum(1 for n in query_lens if n == self.q_len)
        if decode == 0:
            return "eager", "prefill"
        if decode < len(query_lens):
            return "eager", "mixed"
        size = buckets.pick_size(self.sizes, num_tokens)
        if size is None:
            return "eager", "oversized"
        if not self.captured:
            return "eager", "not_captured"
        return "graph", size

    def __call__(self, batch: Mapping[str, torch.Tensor], query_lens: Sequence[int] | torch.Tensor) -> Any:
        """Run one step: replay if ``batch`` is a uniform decode batch that fits, else eager.

        Arguments
        ---------
        batch: name -> tensor for every declared field; token fields ``[T, *shape]``,
            request fields ``[B, *shape]``, unpadded.
        query_lens: [B] query tokens per request, from the host-side scheduler
            (a device tensor costs one sync here, outside the captured region).

        Returns
        -------
        The step's outputs: per-token ``[T, ...]`` / per-request ``[B, ...]``.
        """
        if isinstance(query_lens, torch.Tensor):
            query_lens = query_lens.tolist()
        num_reqs = len(query_lens)
        if num_reqs and self._programs and query_lens.count(self.q_len) == num_reqs:  # a uniform decode batch
            num_tokens = self.q_len * num_reqs
            size = buckets.pick_size(self.sizes, num_tokens)
            if size is not None:  # what classify gives it: ("graph", size)
                self._check_batch(batch, num_tokens, num_reqs)
                return self._replay(batch, size, num_tokens, num_reqs)
        query_lens = [int(n) for n in query_lens]
        num_tokens = sum(query_lens)
        self._check_batch(batch, num_tokens, num_reqs)
        path, size = self.classify(query_lens)
        if path == "eager":
            return self._eager(batch, query_lens, size)
        return self._replay(batch, size, num_tokens, num_reqs)

    def _eager(self, batch, query_lens, reason):
        full = {k: v.to(self.device) for k, v in batch.items()}  # no-op when already there
        cu = torch.tensor(cu_seqlens(query_lens), dtype=torch.int32)
        full[CU_SEQLENS] = cu.to(self.device)
        out = self.step(self.state, full)
        self.stats.eager += 1
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
        self.stats.last = f"eager:{reason}"
        return out

    def _slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``self._buffers[name][start:stop]``, made once per range (a view of the persistent buffer)."""
        key = (name, start, stop)
        view = self._slices.get(key)
        if view is None:
            view = self._slices[key] = self._buffers[name][start:stop]
        return view

    def _replay(self, batch, size, num_tokens, num_reqs):
        dirty, n_req = self._dirty, size // self.q_len
        for name, f in self.fields.items():
            buf, n = self._buffers[name], (num_tokens if f.rows == "token" else num_reqs)
            src = batch[name]
            if src.data_ptr() != buf.data_ptr() or src.dtype != buf.dtype:  # not a view of the buffer already
                self._slice(name, 0, n).copy_(src)
            rows, was = (size if f.rows == "token" else n_req), dirty.get(name, 0)
            if was > n:  # stale rows of a bigger batch must not act
                self._slice(name, n, rows).fill_(f.pad)
            dirty[name] = max(n, was) if was > rows else n  # rows past it hold the pad
        if self._cu_for != (n_req, num_tokens):  # cu_seqlens_q is a function of the two
            torch.clamp(self._cu_full[: n_req + 1], max=num_tokens, out=self._buffers[CU_SEQLENS][: n_req + 1])
            self._cu_for = (n_req, num_tokens)
        out = self._programs[size]()
        self.stats.graph += 1
        self.stats.sizes[size] = self.stats.sizes.get(size, 0) + 1
        self.stats.padded_tokens += size - num_tokens
        self.stats.last = f"graph:{size}"

        def cut(t):
            return t[:num_tokens] if t.shape[0] == size else t[:num_reqs] if t.shape[0] == n_req else t

        if type(out) is tuple and all(type(t) is torch.Tensor for t in out):  # the common flat output
            return tuple([cut(t) for t in out])
        return pytree.tree_map(cut, out)

    def _check_batch(self, batch, num_tokens, num_reqs):
        shapes = self._shapes.get((num_tokens, num_reqs))
        if shapes is None:
            shapes = self._shapes[(num_tokens, num_reqs)] = tuple(
                (name, (num_tokens if f.rows == "token" else num_reqs, *f.shape)) for name, f in self.fields.items())
        if len(batch) == len(shapes):
            try:
                if all(batch[name].shape == want for name, want in shapes):
                    return
            except KeyError:
                pass
        missing = sorted(set(self.fields) - set(batch))
        extra = sorted(set(batch) - set(self.fields))
        if missing or extra:
            raise ValueError(
                f"batch keys must match the declared fields {sorted(self.fields)}; missing {missing}, "
                f"unexpected {extra}"
            )
        for name, f in self.fields.items():
            rows = num_tokens if f.rows == "token" else num_reqs
            want = (rows, *f.shape)
            if tuple(batch[name].shape) != want:
                raise ValueError(
                    f"batch[{name!r}] has shape {tuple(batch[name].shape)} but Field(rows={f.rows!r}) with "
                    f"sum(query_lens) = {num_tokens} tokens and {num_reqs} requests expects {want}"
                )
