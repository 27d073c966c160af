"""The DCP layer's merge names: the one vocabulary above :mod:`cpattn.dcp` (engine, demo program, planner, CLIs).

A program above ``dcp/`` picks how a DCP decode layer gets every head's exact
output by one of these names; each means one wiring of :func:`cpattn.dcp.dcp_decode`'s
``(query, merge)`` below, then the step that puts the heads back together
(the engine: an all-gather of the output heads; a TP program: the
row-parallel output projection's all-reduce). Collectives per layer, that
step included:

=============  ==================  ==========================================================  ====
name           ``(query, merge)``  wiring                                                      coll.
=============  ==================  ==========================================================  ====
``local_ag``   local, ag           every rank computes the group's query heads; one all-         1
                                   gather of ``[O | L]``; every rank merges every head (no
                                   head step: the hidden state stays replicated)
``local_a2a``  local, a2a          local query heads; one all-to-all; this rank's heads, then     2
                                   the head step
``a2a``        gather, a2a         query heads all-gathered; one all-to-all; the head step        3
``ag_rs``      gather, ag_rs       query heads all-gathered; LSE all-gather + reduce-scatter;    4
                                   the head step
``local_fold`` local, fold         local query heads; LSE all-gather; each rank's rescaled        2
                                   partial of every head goes through the whole output
                                   projection, so the TP all-reduce is the merge
                                   (:func:`cpattn.dcp.dcp_fold_weights`). Needs a TP output
                                   projection after attention: the demo program and the
                                   planner run it, the engine does not (its DCP layer returns
                                   the merged heads)
=============  ==================  ==========================================================  ====

``ENGINE_MERGES`` are the four the engine runs, ``ENGINE_MERGE`` (``local_ag``)
the default of every engine door; ``PROGRAM_MERGES`` all five.

``"fold"`` is ``"local_fold"``'s old name (still accepted, with a
DeprecationWarning, by :func:`layer_merge`).

Example
-------
>>> LAYER_MERGES["local_a2a"], COLLECTIVES["local_a2a"]
(('local', 'a2a'), 2)
>>> layer_merge("ag_rs", ENGINE_MERGES), ENGINE_MERGE, COLLECTIVES[ENGINE_MERGE]
('ag_rs', 'local_ag', 1)
"""

from __future__ import annotations

import warnings

LAYER_MERGES = {"local_ag": ("local", "ag"), "local_a2a": ("local", "a2a"), "a2a": ("gather", "a2a"),
                "ag_rs": ("gather", "ag_rs"), "local_fold": ("local", "fold")}
COLLECTIVES = {"local_ag": 1, "local_a2a": 2, "a2a": 3, "ag_rs": 4, "local_fold": 2}  # per layer, head step included
ENGINE_MERGES = ("local_ag", "local_a2a", "a2a", "ag_rs")  # DCPStep's (cpattn.engine.paged_cache)
ENGINE_MERGE = "local_ag"  # every engine door's default (Algorithms, LLMEngine, generate, DCPStep): 1 collective
PROGRAM_MERGES = tuple(LAYER_MERGES)  # a TP program with a row-parallel output projection (demo program, planner)
RENAMED = {"fold": "local_fold"}  # old spelling -> name


def layer_merge(name: str, allowed: tuple[str, ...] = PROGRAM_MERGES, *, what: str = "merge") -> str:
    """``name`` checked against ``allowed`` (a tuple of this module's names); an old spelling
    (:data:`RENAMED`) is translated with a DeprecationWarning. Raises ValueError otherwise.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     layer_merge("fold"), str(w[0].message)
    ('local_fold', "merge 'fold' is deprecated; use 'local_fold' (the same wiring)")
    """
    if name in RENAMED and RENAMED[name] in allowed:
        warnings.warn(f"{what} {name!r} is deprecated; use {RENAMED[name]!r} (the same wiring)", DeprecationWarning,
                      stacklevel=3)
        return RENAMED[name]
    if name not in allowed:
        hint = ("; 'local_fold' needs a TP output projection after attention (the demo program, the planner), "
                "which the engine's DCP layer does not have") if name in ("local_fold", "fold") else ""
        raise ValueError(f"{what} must be one of {list(allowed)}; got {name!r}{hint}")
    return name


def cli_merge(value: str) -> str:
    """An argparse ``type=`` for a merge flag (with ``choices=`` one of this module's tuples): an old
    spelling becomes its name, with a one-line note on stderr; anything else passes through to ``choices``.

    >>> cli_merge("a2a")
    'a2a'
    """
    if value in RENAMED:
        import sys

        print(f"note: merge {value!r} is now called {RENAMED[value]!r} (the same wiring); the old name is "
              "deprecated", file=sys.stderr)
        return RENAMED[value]
    return value
