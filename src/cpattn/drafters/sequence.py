"""Deprecated old path of :mod:`cpattn.lab.sequence` (the training lab moved out of the runtime drafters).

Importing this module warns (DeprecationWarning) and re-exports the new module's names;
import :mod:`cpattn.lab.sequence` instead. Kept for one release.
"""

from cpattn.drafters._moved import alias

alias(__name__, "cpattn.lab.sequence", globals())
