"""Module-level rank function for the model tests on real gloo processes (spawn pickles it by name).

Imports cpattn only (not transformers), so the spawned ranks start fast.
"""

from cpattn.models.generate import generate_on_rank


def generate_cases(group, cases):
    """Run ``generate_on_rank(group, *args, **kwargs)`` for each (args, kwargs) case; return the Generations."""
    return [generate_on_rank(group, *args, **kwargs) for args, kwargs in cases]
