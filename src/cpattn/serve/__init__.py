"""``cpattn serve``: an OpenAI-compatible HTTP server on the step loop (docs/serve.md).

:mod:`cpattn.serve.cli` parses the command line (no torch, no fastapi imported for a bad flag) and
:mod:`cpattn.serve.flags` its JSON flags; :mod:`cpattn.serve.run` builds the engine and serves it;
:mod:`cpattn.serve.engine_loop` is the thread that owns the engine; :mod:`cpattn.serve.app` the FastAPI
app, with :mod:`cpattn.serve.requests` (request bodies, 400s), :mod:`cpattn.serve.responses` (JSON and
server-sent events) and :mod:`cpattn.serve.metrics` (Prometheus text); :mod:`cpattn.serve.tokenize`
text prompts for a checkpoint with a tokenizer. Real ranks: :mod:`cpattn.serve.launch` (gloo ranks
started by the command, or torchrun's) and :mod:`cpattn.serve.ranks` (rank 0 mirrors each turn's engine
calls to the others). Two-server P/D: :mod:`cpattn.serve.proxy`.
"""
