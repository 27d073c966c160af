"""The engine's :class:`~cpattn.config.algorithms.Algorithms` (it lives in :mod:`cpattn.config.algorithms`, below
the engine and :mod:`cpattn.v4`, which both use it); this path names the same objects."""

from cpattn.config.algorithms import CHOICES, Algorithms

__all__ = ["Algorithms", "CHOICES"]
