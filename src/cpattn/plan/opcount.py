"""One rank's op sequence without peers: :class:`EchoGroup` answers collectives locally, :func:`count_ops` counts
the aten ops (and the kernels a fusing compiler would launch) of a call; :func:`graph_program_ops` traces the
demo program's decode step that ``cpattn bench graph`` runs (used by :func:`cpattn.plan.bench_model.predict_graph`).

Example
-------
>>> count_ops(lambda: (torch.ones(4) + 1).sum())["kernels"] >= 1
True
"""

from __future__ import annotations

import torch

from cpattn.comm.group import Group, Pending


class EchoGroup(Group):
    """Rank 0 of a ``size``-rank group whose collectives are answered locally with the right shapes
    (every peer holds this rank's data), their own ops hidden from :func:`count_ops`: the op sequence
    of one rank of a real group, without peers.

    >>> g = EchoGroup(2)
    >>> g.all_gather(torch.ones(3, 2), dim=1).shape, g.reduce_scatter(torch.ones(4)).shape
    (torch.Size([3, 4]), torch.Size([2]))
    """

    def __init__(self, size: int):
        super().__init__()
        self.rank, self.size = 0, size
        self.trace: list[tuple[str, int]] = []  # (collective, this rank's input bytes), in call order

    @staticmethod
    def _quiet(fn):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return fn()

    def _all_gather(self, x):
        self.trace.append(("all_gather", x.nbytes))
        return self._quiet(lambda: torch.cat([x] * self.size))

    def _reduce_scatter(self, x):
        self.trace.append(("reduce_scatter", x.nbytes))
        return self._quiet(lambda: x.view(self.size, -1, *x.shape[1:]).sum(0))

    def _all_to_all(self, x):
        self.trace.append(("all_to_all", x.nbytes))
        return self._quiet(lambda: x.clone())

    def _all_reduce(self, x):
        self.trace.append(("all_reduce", x.nbytes))
        return self._quiet(lambda: x * self.size)

    def _ring_start(self, x, recv, shift):
        self.trace.append(("ring", x.nbytes))
        return Pending(lambda: self._quiet(lambda: recv.zero_()))


def count_ops(fn) -> dict:
    """Aten ops one call of ``fn`` dispatches: {"ops", "views", "kernels"} (kernels: what a fusing
    compiler would launch: each op that is not pointwise, plus one per run of pointwise ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seq: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tags = getattr(func, "tags", ())
            if torch.Tag.view_copy in tags or func._opname in ("view", "_unsafe_view", "transpose", "t", "select",
                                                               "slice", "unsqueeze", "squeeze", "expand", "permute",
                                                               "as_strided", "alias", "detach", "reshape", "unbind",
                                                               "split", "chunk", "narrow", "movedim", "lift_fresh"):
                seq.append("view")
            elif torch.Tag.pointwise in tags:
                seq.append("pointwise")
            else:
                seq.append("other")
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    kernels, prev = 0, None
    for kind in seq:
        if kind == "other" or (kind == "pointwise" and prev != "pointwise"):
            kernels += 1
        if kind != "view":
            prev = kind
    return {"ops": sum(k != "view" for k in seq), "views": seq.count("view"), "kernels": kernels}


def demo_step(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, context: int, batch: int,
              dcp: int, merge: str = "ag_rs", group: Group | None = None):
    """(step, state, inputs) of one eager decode step of the demo program (``cpattn bench graph``'s) on rank 0
    of ``dcp``: ``batch`` requests at ``context + 1`` tokens, 16-token blocks; ``group``: an
    :class:`EchoGroup` of ``dcp`` ranks unless given. The step has run once (warm).

    >>> step, state, x = demo_step(layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, context=16, batch=2, dcp=2)
    >>> step(state, x).shape
    torch.Size([2, 32])
    """
    from cpattn.graphs import demo_program as dp

    local = -(-(context + 1) // dcp)
    mb = -(-local // 16) + 1
    cfg = dp.ProgramConfig(num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=head_dim, block_size=16, interleave_size=1, max_blocks=mb, num_blocks=batch * mb,
                           merge=merge)
    state = dp.init_state(cfg, dp.init_params(cfg), 0, dcp, poison=0.0)
    step = dp.make_step(cfg, group if group is not None else EchoGroup(dcp))
    inputs = {"x": torch.randn(batch, hidden), "seq_lens": torch.full((batch,), context + 1),
              "block_table": torch.arange(batch * mb).view(batch, mb),
              "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32)}
    step(state, inputs)
    return step, state, inputs


def graph_program_ops(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2, head_dim: int = 32,
                      context: int = 256, batch: int = 8, dcp: int = 2, merge: str = "ag_rs") -> dict:
    """Ops of rank 0's eager decode step of the demo program (``cpattn bench graph``'s), traced with its
    collectives answered by an :class:`EchoGroup` of ``dcp`` ranks (they are priced apart), each request
    at ``context + 1`` tokens: :func:`count_ops`'s counts plus "collectives", the step's
    ``(collective, input bytes)`` in call order.

    >>> ops = graph_program_ops(layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, context=16, batch=2)
    >>> ops["ops"] > ops["kernels"] > 0 and ops["views"] > 0
    True
    >>> [kind for kind, _ in ops["collectives"]]  # ag_rs: query heads, LSE, merge, then the TP reduction
    ['all_gather', 'all_gather', 'reduce_scatter', 'all_reduce']
    """
    group = EchoGroup(dcp)
    step, state, inputs = demo_step(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    context=context, batch=batch, dcp=dcp, merge=merge, group=group)
    group.trace.clear()  # the warm-up step's
    return {**count_ops(lambda: step(state, inputs)), "collectives": list(group.trace)}
