"""Deprecated old paths of the drafters' names in :mod:`cpattn.engine.drafters` (kept for one release).

``cpattn.engine.drafters.DRAFTERS`` / ``Registry`` moved to :mod:`cpattn.drafters.registry`, and the
token drafters (``NgramDrafter``, ``ngram_lookup``, ``ModelDrafter``, ``ModelDraftState``, ``truncated``)
live in :mod:`cpattn.drafters.ngram` / :mod:`cpattn.drafters.draft_model`. Reading one of them from the
old module warns (DeprecationWarning naming the new path) and gives the new module's own object. The
engine never reads them: the drafters import the engine's protocol, not the other way round.
"""

from __future__ import annotations

import importlib
import warnings

MOVED = {"DRAFTERS": "cpattn.drafters.registry", "Registry": "cpattn.drafters.registry",
         "NgramDrafter": "cpattn.drafters.ngram", "ngram_lookup": "cpattn.drafters.ngram",
         "ModelDrafter": "cpattn.drafters.draft_model", "ModelDraftState": "cpattn.drafters.draft_model",
         "truncated": "cpattn.drafters.draft_model"}


def resolve(name: str):
    """The moved object ``name`` of ``cpattn.engine.drafters``, with a DeprecationWarning naming its new path.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     d = resolve("DRAFTERS")
    >>> from cpattn.drafters.registry import DRAFTERS
    >>> d is DRAFTERS, str(w[0].message)
    (True, 'cpattn.engine.drafters.DRAFTERS moved to cpattn.drafters.registry.DRAFTERS; import it from there (the old path goes in the next release)')
    """
    new = MOVED[name]
    warnings.warn(f"cpattn.engine.drafters.{name} moved to {new}.{name}; import it from there (the old path goes "
                  "in the next release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)
