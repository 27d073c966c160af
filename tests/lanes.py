"""The two test lanes: the full suite (CI, ``bash scripts/test.sh``) and the fast lane (``-m "not slow"``).

``conftest.py`` sets ``HYPOTHESIS_PROFILE`` before any test module is imported: ``fast`` when the ``-m``
expression deselects slow tests, ``full`` otherwise (an explicit ``HYPOTHESIS_PROFILE`` wins). Property tests
ask :func:`examples` for their example count, so the fast lane draws fewer and the full suite all of them;
and the fast lane runs a third of each parametrize grid of three or more cases (:func:`thin`, called by
``conftest.pytest_collection_modifyitems``), so it stays under two minutes on two cores while every case
still runs in the full suite.
"""

from __future__ import annotations

import os


def fast_lane() -> bool:
    """True in the fast lane (``HYPOTHESIS_PROFILE=fast``)."""
    return os.environ.get("HYPOTHESIS_PROFILE") == "fast"


def examples(n: int) -> int:
    """A property test's example count: ``n`` in the full suite, a quarter of it (at least 3) in the fast lane.

    >>> examples(60) in (60, 15)
    True
    """
    return max(3, n // 4) if fast_lane() else n


def thin(items: list) -> tuple[list, list]:
    """The fast lane's share of each parametrize grid: of a test function's three or more cases (in collection
    order) the 1st, 4th, 7th, ... run; a function with one or two cases, and any test that is not
    parametrized, runs whole. Returns (kept, dropped); the full suite runs every case.

    >>> from types import SimpleNamespace as N
    >>> cases = [N(nodeid=f"t.py::f[{i}]", originalname="f", callspec=1, fspath="t.py") for i in range(5)]
    >>> [c.nodeid for c in thin(cases)[0]]
    ['t.py::f[0]', 't.py::f[3]']
    """
    groups: dict = {}
    for item in items:
        if getattr(item, "callspec", None) is not None:
            groups.setdefault((str(item.fspath), item.originalname), []).append(item)
    dropped = {id(c) for cases in groups.values() if len(cases) >= 3 for i, c in enumerate(cases) if i % 3}
    return [i for i in items if id(i) not in dropped], [i for i in items if id(i) in dropped]
