"""``cpattn serve``: an OpenAI-compatible HTTP server on the step loop (docs/serve.md).

:mod:`cpattn.serve.cli` parses the command line (no torch, no fastapi imported for a bad flag);
:mod:`cpattn.serve.engine_loop` is the thread that owns the engine; :mod:`cpattn.serve.app` the
FastAPI app.
"""
