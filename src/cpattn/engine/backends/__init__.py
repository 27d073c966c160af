"""The engine's cache backends (:mod:`cpattn.engine.backend`): ``paged`` and ``v4``."""
