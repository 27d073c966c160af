"""The deprecated old paths of the training lab's modules (``cpattn.drafters.train`` ... -> :mod:`cpattn.lab`).

Each old module calls :func:`alias` on import: it warns once (DeprecationWarning
naming the new path) and takes the new module's public names; any other name
(a private one, a module attribute) is read through from the new module. The
objects are the new module's own, so ``cpattn.drafters.target.save is
cpattn.lab.target.save``. Kept for one release.
"""

from __future__ import annotations

import importlib
import warnings


def alias(old: str, new: str, namespace: dict) -> None:
    """Fill module ``old``'s ``namespace`` (its ``globals()``) with module ``new``'s names and warn once.

    >>> import warnings
    >>> ns = {}
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     alias("cpattn.drafters.corpus", "cpattn.lab.corpus", ns)
    >>> from cpattn.lab.corpus import Corpus
    >>> ns["Corpus"] is Corpus, str(w[0].message)
    (True, 'cpattn.drafters.corpus moved to cpattn.lab.corpus; import it from there (the old path goes in the next release)')
    """
    mod = importlib.import_module(new)
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
    namespace.update({n: getattr(mod, n) for n in names})
    namespace["__all__"] = list(names)

    def __getattr__(name: str):
        if not name.startswith("__"):  # module dunders stay the old module's own
            try:
                return getattr(mod, name)
            except AttributeError:
                pass
        raise AttributeError(f"module {old!r} (moved to {new!r}) has no attribute {name!r}")

    namespace["__getattr__"] = __getattr__
