"""Communication: one ``Group`` interface, a simulated mesh and torch.distributed."""

from cpattn.comm.group import CommStats, Group, Pending
from cpattn.comm.sim import CollectiveMismatch, CommTimeout, PeerFailed, SimGroup, SimMesh, simulate


def init_from_env(backend=None, timeout_s: float = 300.0):
    """See :func:`cpattn.comm.dist.init_from_env` (imported lazily)."""
    from cpattn.comm.dist import init_from_env as _init

    return _init(backend, timeout_s)


__all__ = [
    "CommStats", "Group", "Pending", "SimGroup", "SimMesh", "simulate",
    "CommTimeout", "CollectiveMismatch", "PeerFailed", "init_from_env",
]
