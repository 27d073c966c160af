"""Build the engine of ``cpattn serve``'s flags and serve it: in this process, or as one rank of a world.

:func:`serve` is the whole server of one process: the engine
(:func:`build_engine`), its :class:`~cpattn.serve.engine_loop.EngineLoop`,
the FastAPI app (wrapped by :class:`~cpattn.serve.tokenize.TextMiddleware`
when the checkpoint has a tokenizer) and uvicorn, until a signal (or, on
real ranks, the stop file) ends it. With ``world`` (a gloo group: ranks
started by ``--distributed-executor-backend mp`` or torchrun) every rank
builds the engine over the world; rank 0 serves HTTP and mirrors each
turn's engine calls to the others (:mod:`cpattn.serve.ranks`), which follow.

Returns the command's exit status: 0 stopped by a signal, 1 the HTTP server
did not start or the engine loop failed; a flag the engine refuses raises
:class:`EngineRefused` (the command prints it as one line, exit 2).
"""

from __future__ import annotations

import os
import sys
import threading
import time

PROG = "cpattn serve"


class EngineRefused(Exception):
    """The engine refused the flags' layout: ``str(e)`` is the one-line usage error (flag, value, why)."""


def build_engine(a, sched, world=None):
    """The LLMEngine of the flags: the embedded model of ``--model-type`` (seeded, as the demo builds it) or
    the checkpoint of ``--model``, with the layout, graph mode, drafter and KV connector of the flags;
    ``world``: this rank's group (real ranks; None: simulated DCP ranks in this process)."""
    import warnings

    from cpattn.bench.demo_setup import Spec, load_model
    from cpattn.config import GuideCompatWarning
    from cpattn.engine.llm import LLMEngine
    from cpattn.engine.pooling import PoolSpec

    family, cfg, params = load_model(Spec(model_dir=a.model, model_type=a.model_type, dtype=a.dtype, seed=a.seed))
    sched = sched if family.cache != "hybrid" else type(sched)(**{**vars(sched), "enable_prefix_caching": False})
    graph = a.compilation_config or {"graph_mode": "NONE", "capture_sizes": None, "graph_backend": "auto"}
    spec, drafter, k = a.speculative_config, None, 0
    if spec is not None and spec["method"] == "mtp":  # the checkpoint's own MTP module (checked by check_mtp)
        from cpattn.drafters.registry import DRAFTERS

        drafter = DRAFTERS["mtp"].from_checkpoint(a.model, dtype=next(iter(params.values())).dtype)
        k = spec["num_speculative_tokens"]
    elif spec is not None:
        from cpattn.drafters.ngram import NgramDrafter

        drafter = NgramDrafter(max_ngram=spec["max_ngram"], min_ngram=spec["min_ngram"])
        k = spec["num_speculative_tokens"]
    role = (a.kv_transfer_config or {}).get("kv_role")
    label = a.model or f"{a.model_type}-seed{a.seed}"
    if role == "kv_both" and world is not None:  # P/D on real ranks: prefill on world ranks 0..P-1, decode on P..
        from cpattn.engine.connector import PoolConnector
        from cpattn.serve.pd_ranks import RankPD

        connector = None if a.kv_pool is None else PoolConnector(PoolSpec(a.kv_pool, model=label))
        return RankPD(world, family, params, cfg, pcp_size=a.prefill_context_parallel_size,
                      dcp_size=a.decode_context_parallel_size, block_size=a.block_size, scheduler=sched,
                      kv_connector=connector, graph_mode=graph["graph_mode"], graph_backend=graph["graph_backend"],
                      capture_sizes=graph["capture_sizes"])
    if role == "kv_both":  # P/D in one process: the prefill role on --pcp ranks, the decode role on --dcp
        from cpattn.engine.pd_engine import PDEngine

        pool = None if a.kv_pool in (None, "memory") else PoolSpec(a.kv_pool, model=label)
        return PDEngine(family, params, cfg, pcp_size=a.prefill_context_parallel_size,
                        dcp_size=a.decode_context_parallel_size, block_size=a.block_size, scheduler=sched,
                        kv_pool=pool, graph_mode=graph["graph_mode"], graph_backend=graph["graph_backend"],
                        capture_sizes=graph["capture_sizes"])
    one_role = {} if role is None else {"kv_pool": PoolSpec(a.kv_pool, model=label), "kv_role": role,
                                        "interleave_size": a.block_size}  # a producer or consumer server
    with warnings.catch_warnings():  # PCP + DCP in one engine is exact here; vLLM-Ascend's refusal is a note
        warnings.simplefilter("ignore", GuideCompatWarning)
        return LLMEngine(family, params, cfg, scheduler=sched, dcp_size=a.decode_context_parallel_size,
                         pcp_size=a.prefill_context_parallel_size, block_size=a.block_size, world=world,
                         graph_mode=graph["graph_mode"], capture_sizes=graph["capture_sizes"],
                         graph_backend=graph["graph_backend"], drafter=drafter, num_speculative_tokens=k,
                         pcp_policy=a.pcp_policy, pcp_min_tokens=a.pcp_min_tokens, **one_role)


def describe(a, engine) -> str:
    """The start line's summary of what is served.

    >>> from types import SimpleNamespace as NS
    >>> a = NS(model=None, model_type="qwen3", prefill_context_parallel_size=2, decode_context_parallel_size=2,
    ...        compilation_config={"graph_mode": "FULL_DECODE_ONLY"}, speculative_config=None)
    >>> describe(a, None)
    'qwen3, embedded, PCP 2 + DCP 2, FULL_DECODE_ONLY'
    """
    parts = [a.model_type if a.model is None else "checkpoint", "embedded" if a.model is None else a.model]
    pcp, dcp = a.prefill_context_parallel_size, a.decode_context_parallel_size
    role = (getattr(a, "kv_transfer_config", None) or {}).get("kv_role")
    backend = getattr(a, "distributed_executor_backend", None)
    real = backend in ("mp", "external_launcher")
    if role == "kv_both":
        via = "blocks rank to rank" if real and a.kv_pool is None else f"KV pool {a.kv_pool or 'memory'}"
        parts.append(f"P/D: prefill PCP {pcp} -> decode DCP {dcp} via {via}")
    else:
        parts.append(f"PCP {pcp} + DCP {dcp}" if pcp > 1 else f"DCP {dcp}")
        if pcp > 1 and getattr(a, "pcp_policy", "always") == "elastic":
            runners = getattr(engine, "runners", None)
            n = runners[0].pcp_min_tokens if runners else a.pcp_min_tokens
            parts.append("elastic PCP" if n is None else f"elastic: PCP for chunks of >= {n} tokens")
        if role is not None:
            parts.append(f"{role} via KV pool {a.kv_pool}")
    if a.compilation_config is not None and a.compilation_config["graph_mode"] != "NONE":
        parts.append(a.compilation_config["graph_mode"])
    if a.speculative_config is not None:
        parts.append(f"{a.speculative_config['method']} k={a.speculative_config['num_speculative_tokens']}")
    if real:
        n = pcp + dcp if role == "kv_both" else dcp
        parts.append(f"{n} gloo rank{'s' if n > 1 else ''} ({backend})")
    return ", ".join(parts)


def _refused(a, e: BaseException) -> EngineRefused | None:
    """A build error that is the flags' fault, as a one-line usage error; None for anything else."""
    import contextlib
    import io

    from cpattn.config import ConfigError
    from cpattn.config import cli_args as cli
    from cpattn.serve.cli import CONFIG_FLAGS

    if isinstance(e, ConfigError):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            cli.speak_problems(PROG, e.problems, CONFIG_FLAGS)
        return EngineRefused(err.getvalue().strip().removeprefix(f"{PROG}: error: "))
    cause = e if isinstance(e, ValueError) else e.__cause__  # raised on a simulated DCP rank: wrapped
    if not isinstance(cause, ValueError):
        return None
    flag = "--model" if a.model else "--model-type"
    return EngineRefused(f"argument {flag}: saw {a.model or a.model_type!r}: {cause}")


def serve(a, sched, tokenizer=None, world=None, stop_file: str | None = None) -> int:
    """The server of the flags ``a`` (module docstring); ``tokenizer``: the checkpoint's (text prompts).

    On real ranks (``world``), rank 0 serves and returns the exit status; the others follow rank 0's
    turns and return 0 once it stops. ``stop_file``: a file the launching process writes one line to
    per SIGINT / SIGTERM (the ranks get no signals of their own): one line stops rank 0's HTTP server
    gracefully (open requests finish), two stop it at once."""
    try:
        engine = build_engine(a, sched, world)
    except Exception as e:  # noqa: BLE001 - a refusal of the flags, or raised as it was
        refused = _refused(a, e)
        if refused is None:
            raise
        raise refused from None
    if world is not None and world.rank > 0:
        from cpattn.serve.ranks import follow

        try:
            follow(engine, world)
        finally:
            engine.close()
        return 0
    import uvicorn

    from cpattn.serve.app import build_app
    from cpattn.serve.engine_loop import EngineLoop

    mirror = None
    if world is not None and world.size > 1:
        from cpattn.serve.ranks import Mirror

        mirror = Mirror(world)
    name = a.served_model_name or a.model or f"cpattn-{a.model_type}"
    loop = EngineLoop(engine, mirror=mirror)
    server = None
    try:
        app = build_app(loop, name, max_model_len=engine.max_model_len)
        if tokenizer is not None:  # text prompts in, text out (cpattn.serve.tokenize)
            from cpattn.serve.tokenize import TextMiddleware

            app = TextMiddleware(app, tokenizer)
        print(f"{PROG}: {name} ({describe(a, engine)}) on http://{a.host}:{a.port}/v1 ; Ctrl-C stops it",
              file=sys.stderr, flush=True)
        server = _Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False))
        if stop_file is not None:
            threading.Thread(target=_watch_stop, args=(server, stop_file), daemon=True,
                             name="cpattn-stop-file").start()
        server.run()
    finally:
        loop.stop(timeout_s=10.0 if mirror is None else 600.0)  # real ranks: the last turn (after any step
        # in flight, however long) tells the other ranks to stop, before this rank meets them at spawn's barrier
        engine.close()  # the pool it opened (an LMDB environment, a Mooncake client); P/D: both roles
    if server is None or not server.started:
        print(f"{PROG}: the HTTP server did not start (see uvicorn's message above)", file=sys.stderr)
        return 1
    if loop.error is not None:
        print(f"{PROG}: the engine loop failed: {type(loop.error).__name__}: {loop.error}", file=sys.stderr)
        return 1
    return 0


def _watch_stop(server, path: str, poll_s: float = 0.1) -> None:
    """Stop ``server`` when ``path`` has one line (gracefully) and again at two lines (at once)."""
    while True:
        try:
            with open(path) as f:
                n = f.read().count("\n")
        except FileNotFoundError:
            n = 0
        if n >= 1:
            server.should_exit = True
        if n >= 2:
            server.force_exit = True
            return
        time.sleep(poll_s)


def _Server(config):
    """A ``uvicorn.Server`` that stops on SIGINT / SIGTERM and lets the command exit 0 (uvicorn itself
    re-raises the signal once it has shut down, so the process would die of it)."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
            self.should_exit = True

    return Server(config)


def request_stop(path: str) -> None:
    """Append one stop line to ``path`` (the launching process's SIGINT / SIGTERM handler)."""
    with open(path, "a") as f:
        f.write("stop\n")
    os.utime(path)


def serve_rank(world, a, sched, stop_file: str | None = None) -> dict:
    """One rank of a real-rank server (the ``spawn`` / torchrun target): ``{"status": exit status}``, or
    ``{"refused": one-line usage error}`` when the engine refuses the flags (every rank refuses alike)."""
    tokenizer = None
    if world.rank == 0 and a.model is not None:
        from cpattn.serve.tokenize import load_tokenizer

        tokenizer = load_tokenizer(a.model)  # checked by the launching process already
    try:
        return {"status": serve(a, sched, tokenizer, world, stop_file)}
    except EngineRefused as e:
        return {"refused": str(e)}
