"""The engine's :class:`~cpattn.config.algorithms.Algorithms` (it lives in :mod:`cpattn.config.algorithms`, below
the engine and :mod:`cpattn.v4`, which both use it); this path names the same objects, and
:func:`engine_algorithms`, how an engine's ``merge=`` and ``algorithms=`` arguments combine."""

from cpattn.config.algorithms import CHOICES, Algorithms
from cpattn.dcp.layer_merges import ENGINE_MERGE

__all__ = ["Algorithms", "CHOICES", "engine_algorithms"]


def engine_algorithms(algorithms: Algorithms | None, merge: str = ENGINE_MERGE) -> tuple[str, Algorithms | None]:
    """(the DCP merge, the algorithms) of a step-loop engine given its ``algorithms=`` and ``merge=``: without
    ``algorithms``, ``merge`` and None (the runners choose: ``pcp_method`` "auto"); with them,
    ``algorithms.dcp_merge`` and ``algorithms``. A non-default ``merge`` that disagrees is a ValueError.

    >>> engine_algorithms(None, "a2a"), engine_algorithms(Algorithms(dcp_merge="ag_rs"))[0]
    (('a2a', None), 'ag_rs')
    >>> engine_algorithms(Algorithms(), "a2a")
    Traceback (most recent call last):
    ...
    ValueError: merge='a2a' disagrees with algorithms.dcp_merge='local_ag'; pass Algorithms(dcp_merge='a2a')
    """
    if algorithms is None:
        return merge, None
    if not isinstance(algorithms, Algorithms):
        raise ValueError(f"algorithms: saw {type(algorithms).__name__}; pass a cpattn.engine.Algorithms or None")
    if merge != ENGINE_MERGE and merge != algorithms.dcp_merge:
        raise ValueError(f"merge={merge!r} disagrees with algorithms.dcp_merge={algorithms.dcp_merge!r}; "
                         f"pass Algorithms(dcp_merge={merge!r})")
    return algorithms.dcp_merge, algorithms
