"""The engine's request vocabulary, :class:`~cpattn.layout.batch.Prompts` (it lives in :mod:`cpattn.layout.batch`,
below the engine and :mod:`cpattn.v4`, which both use it); this path names the same object."""

from cpattn.layout.batch import Prompts

__all__ = ["Prompts"]
