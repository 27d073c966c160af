"""Benchmarks and the main job. Each module has a ``main``-style entry used by ``cpattn``."""
