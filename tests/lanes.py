"""The two test lanes: the full suite (CI, ``bash scripts/test.sh``) and the fast lane (``-m "not slow"``).

``conftest.py`` sets ``HYPOTHESIS_PROFILE`` before any test module is imported: ``fast`` when the ``-m``
expression deselects slow tests, ``full`` otherwise (an explicit ``HYPOTHESIS_PROFILE`` wins). Property tests
ask :func:`examples` for their example count, so the fast lane draws fewer and the full suite all of them.
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
