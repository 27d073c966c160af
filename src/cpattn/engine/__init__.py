"""The engine: prefill -> hand-off -> decode as composable stages over explicit state.

(Being assembled; the protocols are in :mod:`cpattn.engine.family`.)
"""
