"""``DistGroup``: the :class:`~cpattn.comm.group.Group` interface over torch.distributed.

Collectives use ``torch.distributed._functional_collectives`` (traceable by
``torch.compile(fullgraph=True)``); the ring exchange uses
``batch_isend_irecv`` so the transfer runs while the caller computes. Works
with gloo (CPU), NCCL (CUDA) and HCCL (Ascend, via torch_npu).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cpattn.comm.group import Group, Pending

# newer torch names these *_single; older releases only have *_tensor
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class DistGroup(Group):
    """A torch.distributed process group seen as a cpattn ``Group``.

    Arguments
    ---------
    process_group: a ``ProcessGroup`` (default: the world group).

    Example
    -------
    >>> # under torchrun, after dist.init_process_group("gloo"):
    >>> # group = DistGroup(); y = group.all_gather(x)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistGroup needs an initialised torch.distributed; call cpattn.comm.init_from_env() "
                "under torchrun, or torch.distributed.init_process_group(...) first"
            )
        self.pg = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)

    # Results are waited on at once (``wait_tensor`` is traceable), so callers
    # always get a plain tensor, in eager code and in graphs alike.
    def _all_gather(self, x):
        return funcol.wait_tensor(_ALL_GATHER(x, 0, self.pg))

    def _reduce_scatter(self, x):
        return funcol.wait_tensor(_REDUCE_SCATTER(x, "sum", 0, self.pg))

    def _all_to_all(self, x):
        return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, self.pg))

    def _all_reduce(self, x):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.pg))

    def _ring_start(self, x, recv, shift):
        to = dist.get_global_rank(self.pg, (self.rank + shift) % self.size)
        frm = dist.get_global_rank(self.pg, (self.rank - shift) % self.size)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, to, self.pg), dist.P2POp(dist.irecv, recv, frm, self.pg)]
        )

        def finish():
            for w in works:
                w.wait()
            return recv

        return Pending(finish)


def default_backend(device: torch.device | str | None = None) -> str:
    """gloo for CPU, nccl for CUDA, hccl for Ascend NPUs."""
    kind = torch.device(device).type if device is not None else "cpu"
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> DistGroup:
    """Initialise torch.distributed from torchrun's environment and return the world group.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (set by
    ``torchrun``). ``timeout_s`` bounds every collective: a dead or
    mismatched peer ends in an error, not a hang.

    Example
    -------
    >>> # torchrun --nproc-per-node 2 my_script.py, where my_script.py does:
    >>> # group = cpattn.comm.init_from_env(); print(group.rank, group.size)
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: environment lacks {missing}; launch with torchrun")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend or default_backend(), timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistGroup()
