"""``cpattn serve``: an OpenAI-compatible HTTP server on the step loop (``cpattn.engine.llm.LLMEngine``).

Serves an embedded tiny random model (``--model-type``, built as ``cpattn demo`` builds it: seeded
weights, nothing downloaded) or a local checkpoint directory (``--model DIR``, as ``cpattn demo --model``
reads it) on ``--decode-context-parallel-size`` simulated DCP ranks in this process; prefill chunks
under PCP over the same ranks with ``--prefill-context-parallel-size`` equal to the DCP size (one
engine); captured decode steps with ``--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'``;
n-gram speculative decoding with ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 2}'``
(or ``"mtp"``: the ``--model`` checkpoint's own MTP module);
elastic CP with ``--pcp-policy elastic`` (only chunks of at least ``--pcp-min-tokens`` run PCP); P/D in
this one server with ``--kv-transfer-config '{"kv_connector": "CpattnPoolConnector", "kv_role":
"kv_both"}'``: a prefill role on ``--pcp`` ranks hands each request's KV to a decode role on ``--dcp``
ranks, in this process through ``--kv-pool`` (:class:`cpattn.engine.pd_engine.PDEngine`) or on
``--pcp + --dcp`` gloo ranks (``mp`` or torchrun; :class:`cpattn.serve.pd_ranks.RankPD`).
Listens on 127.0.0.1:8000 unless ``--host`` / ``--port`` say otherwise; Ctrl-C or SIGTERM stops it
(exit 0). Prompts are token ids, or text when ``--model DIR`` has a ``tokenizer.json``; see
docs/serve.md for the endpoints and what is not done yet.

Usage::

    cpattn serve --model-type qwen3 --decode-context-parallel-size 2 --port 8000
    cpattn serve --pcp 2 --dcp 2 --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
    cpattn serve --pcp 2 --dcp 2 --pcp-policy elastic
    cpattn serve --pcp 2 --dcp 2 --kv-transfer-config '{"kv_connector": "CpattnPoolConnector", "kv_role": "kv_both"}'
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "cpattn-qwen3", "prompt": [1, 2, 3, 4], "max_tokens": 8}'

Exit status: 0 stopped by a signal; 1 the port is taken or the server failed; 2 a usage error
(a bad flag, or fastapi / uvicorn not installed: ``pip install 'cpattn[serve]'``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from cpattn.config import cli_args as cli
from cpattn.serve import flags
from cpattn.serve.run import build_engine, describe  # noqa: F401 - their home until run.py (no torch at import)

PROG = "cpattn serve"
BACKENDS = ("uni", "mp", "external_launcher")
NEEDS = ("fastapi", "uvicorn")
SCHEDULER_FLAGS = {"max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs",
                   "enable_chunked_prefill": "--enable-chunked-prefill", "max_model_len": "--max-model-len"}
CONFIG_FLAGS = {"capture_sizes": "--compilation-config cudagraph_capture_sizes",
                "graph_mode": "--compilation-config cudagraph_mode", "graph_backend": "--compilation-config backend",
                "num_speculative_tokens": "--speculative-config num_speculative_tokens",
                "speculative_method": "--speculative-config method"}


port = cli.port  # argparse type: a TCP port, 1..65535 (:func:`cpattn.config.cli_types.port`)


def parser():
    """The server's flags (vLLM's names)."""
    import argparse

    p = cli.parser(PROG, __doc__)
    p.add_argument("--model", metavar="DIR", default=None,
                   help="local Hugging Face checkpoint (config.json + *.safetensors) instead of an embedded model")
    p.add_argument("--model-type", choices=cli.MODEL_TYPES, default="qwen3",
                   help="family of the embedded tiny random-init model (ignored with --model)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: --model DIR as given, or "
                        "cpattn-MODEL_TYPE)")
    cli.add_parallel(p, pcp=1, dcp=1, block_size=16, helps={
        "pcp": "prefill context-parallel ranks: 1, or the DCP size (one engine: every step's prefill chunks "
               "run PCP over the DCP ranks)",
        "dcp": "decode context-parallel ranks, simulated as threads in this process (the KV cache sharded "
               "over them; tokens equal one device)"})
    p.add_argument("--compilation-config", type=flags.compilation_config, default=None, metavar="JSON",
                   help='graph mode, vLLM\'s spelling: \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' replays captured '
                        'uniform decode steps (keys: cudagraph_mode NONE|FULL_DECODE_ONLY, cudagraph_capture_sizes, '
                        'backend; default: eager)')
    p.add_argument("--speculative-config", type=flags.speculative_config, default=None, metavar="JSON",
                   help='speculative decoding: \'{"method": "ngram", "num_speculative_tokens": K}\' (also '
                        'prompt_lookup_max / prompt_lookup_min), or method "mtp" (the --model checkpoint\'s MTP '
                        'module); default: none')
    p.add_argument("--pcp-policy", choices=flags.PCP_POLICIES, default="always",
                   help="with --pcp > 1: 'always' runs every prefill chunk PCP; 'elastic' only chunks of at least "
                        "--pcp-min-tokens new tokens, shorter ones DCP attention (default: always)")
    p.add_argument("--pcp-min-tokens", type=flags.pcp_min_tokens, default=None, metavar="N|measure",
                   help="--pcp-policy elastic: the shortest chunk that runs PCP; 'measure' times a lone chunk both "
                        "ways on the server's ranks at start-up (about a second on the embedded model; needs "
                        "rank processes: --distributed-executor-backend mp or torchrun) (default: the planner's "
                        "break-even)")
    p.add_argument("--kv-transfer-config", type=flags.kv_transfer_config, default=None, metavar="JSON",
                   help='P/D in this one server, vLLM\'s shape: \'{"kv_connector": "CpattnPoolConnector", '
                        '"kv_role": "kv_both"}\' -- a prefill role on --pcp P ranks (PCP) hands each request\'s KV '
                        'to a decode role on --dcp D ranks (DCP); e.g. --pcp 2 --dcp 2. uni: both roles in this '
                        'process, the KV through --kv-pool (default memory); mp / external_launcher: P + D gloo '
                        'rank processes (prefill ranks 0..P-1, decode P..), the KV rank to rank or through an '
                        'lmdb / mooncake --kv-pool (default: one engine, no P/D)')
    p.add_argument("--kv-pool", type=flags.kv_pool, default=None, metavar="SPEC",
                   help="with --kv-transfer-config: the connector's store, memory (in-process), lmdb:DIR or "
                        "mooncake:HOST:PORT (default: memory)")
    p.add_argument("--max-num-batched-tokens", type=cli.positive_int, default=2048, metavar="N",
                   help="token budget of one step (prefill chunks + decodes)")
    p.add_argument("--max-num-seqs", type=cli.positive_int, default=16, metavar="N",
                   help="requests running at once")
    p.add_argument("--max-model-len", type=cli.positive_int, default=4096, metavar="N",
                   help="prompt + generated tokens of one request")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps (default: on)")
    cli.add_dtype(p, help="parameter and KV-cache data type")
    p.add_argument("--seed", type=cli.nonnegative_int, default=0, help="seed of the random weights")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=port, default=8000, help="TCP port")
    p.add_argument("--distributed-executor-backend", choices=BACKENDS, default=None,
                   help="where the DCP ranks run (vLLM's flag): uni, threads of this process; mp, --dcp gloo rank "
                        "processes this command starts (rank 0 serves HTTP, the others follow its steps); "
                        "external_launcher, the ranks torchrun started (torchrun --nproc-per-node N -m cpattn "
                        "serve ...; rank 0 serves). Default: external_launcher under torchrun, else uni")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning",
                   help="uvicorn's log level")
    return p


def missing_packages(names=NEEDS) -> list[str]:
    """The packages of ``names`` that cannot be imported here (found without importing them).

    >>> missing_packages(("json", "no_such_package_xyz"))
    ['no_such_package_xyz']
    """
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ValueError, ImportError, AttributeError):  # sys.modules[name] is None: import blocked
            found = False
        if not found:
            out.append(name)
    return out


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun(env=None) -> bool:
    """Whether this process is a torchrun worker (its rendezvous variables are set).

    >>> under_torchrun({}), under_torchrun({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    (False, True)
    """
    env = os.environ if env is None else env
    return all(k in env for k in TORCHRUN_ENV)


def check_backend(a) -> str:
    """``--distributed-executor-backend`` resolved (default: external_launcher under torchrun, else uni)
    and checked against the layout, or a one-line usage error (exit 2)."""
    role = (a.kv_transfer_config or {}).get("kv_role")
    backend = a.distributed_executor_backend or ("external_launcher" if under_torchrun() else "uni")
    from cpattn.serve.launch import world_size

    flag, dcp, n = "--distributed-executor-backend", a.decode_context_parallel_size, world_size(a)
    if backend in ("mp", "external_launcher") and role == "kv_both" and a.kv_pool == "memory":
        cli.bad_value(PROG, "--kv-pool", f"memory with --distributed-executor-backend {backend}",
                      "an in-process pool is not shared by rank processes",
                      "drop --kv-pool (the blocks go rank to rank), or pass lmdb:DIR or mooncake:HOST:PORT")
    if backend == "external_launcher":
        if not under_torchrun():
            cli.bad_value(PROG, flag, "external_launcher outside torchrun", "external_launcher ranks are started "
                          f"by torchrun", f"torchrun --nproc-per-node {n} -m cpattn serve ..., or use mp")
        world = os.environ["WORLD_SIZE"]
        if int(world) != n and role == "kv_both":
            pcp = a.prefill_context_parallel_size
            cli.bad_value(PROG, flag, f"torchrun's WORLD_SIZE={world} with --pcp={pcp} --dcp={dcp} and kv_role "
                          "kv_both", "one-server P/D spans the world: --pcp prefill ranks, then --dcp decode ranks",
                          f"torchrun --nproc-per-node {n}, or --pcp + --dcp = {world}")
        if int(world) != n:
            cli.bad_value(PROG, flag, f"torchrun's WORLD_SIZE={world} with --dcp={dcp}",
                          "the engine spans the world: one rank per DCP rank",
                          f"torchrun --nproc-per-node {dcp}, or --dcp {world}")
    elif backend == "mp" and under_torchrun():
        cli.bad_value(PROG, flag, "mp under torchrun", "torchrun started the ranks already",
                      "drop the flag (external_launcher is the default under torchrun)")
    return backend


def check_mtp(model: str | None) -> None:
    """``--speculative-config`` method mtp needs a ``--model`` checkpoint whose config.json declares an MTP module
    (``num_nextn_predict_layers`` or ``mtp_num_hidden_layers`` >= 1), else a one-line usage error (exit 2)."""
    flag = "--speculative-config"
    if model is None:
        cli.bad_value(PROG, flag, 'method "mtp" with the embedded model', "the MTP module's weights come from the "
                      "served checkpoint, and the embedded model has none", "add --model DIR (a checkpoint with an "
                      "MTP module), or use method ngram")
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # --model's own check says what is wrong with the directory
    text = config.get("text_config", config)
    n = max(int(text.get("num_nextn_predict_layers", 0) or 0), int(text.get("mtp_num_hidden_layers", 0) or 0))
    if n < 1:
        cli.bad_value(PROG, flag, f'method "mtp" with --model {model}', "its config.json declares no MTP module "
                      "(num_nextn_predict_layers / mtp_num_hidden_layers = 0)", "serve a checkpoint that carries "
                      "one, or use method ngram")


def check_args(a):
    """The SchedulerConfig of the flags, or a one-line usage error (exit 2); no torch imported."""
    from cpattn.config import ConfigError, SchedulerConfig

    pcp, dcp = a.prefill_context_parallel_size, a.decode_context_parallel_size
    role = (a.kv_transfer_config or {}).get("kv_role")
    pd, one_role = role == "kv_both", role in ("kv_producer", "kv_consumer")
    if a.pcp_policy != "always" and pcp < 2:
        cli.bad_value(PROG, "--pcp-policy", f"--pcp-policy {a.pcp_policy} with --pcp={pcp}",
                      "a PCP policy chooses between PCP and DCP prefill, so it needs --pcp > 1",
                      f"add --pcp {max(dcp, 2)} --dcp {max(dcp, 2)}, or drop --pcp-policy")
    if a.pcp_min_tokens is not None and a.pcp_policy != "elastic":
        cli.bad_value(PROG, "--pcp-min-tokens", f"--pcp-min-tokens {a.pcp_min_tokens} with --pcp-policy "
                      f"{a.pcp_policy}", "the threshold of the elastic policy", "add --pcp-policy elastic")
    if role is not None and a.pcp_policy != "always":
        cli.bad_value(PROG, "--pcp-policy", f"--pcp-policy {a.pcp_policy} with --kv-transfer-config",
                      "the P/D prefill role runs every chunk PCP over its --pcp ranks", "drop --pcp-policy")
    if role is not None and a.speculative_config is not None:
        cli.bad_value(PROG, "--speculative-config", "a drafter with --kv-transfer-config",
                      "the P/D decode role builds no drafter yet", "drop --speculative-config (or the P/D flag)")
    if a.speculative_config is not None and a.speculative_config["method"] == "mtp":
        check_mtp(a.model)
    if a.kv_pool is not None and role is None:
        cli.bad_value(PROG, "--kv-pool", repr(a.kv_pool), "the KV pool is P/D's connector, read with "
                      "--kv-transfer-config", "add --kv-transfer-config '{\"kv_role\": \"kv_both\", "
                      "\"kv_connector\": \"CpattnPoolConnector\"}'")
    if one_role and a.kv_pool in (None, "memory"):
        cli.bad_value(PROG, "--kv-pool", f"{a.kv_pool or 'none'} with kv_role {role}",
                      "a producer server and a consumer server are two processes, so they share a pool both open",
                      "add --kv-pool lmdb:DIR (the same DIR for both servers) or mooncake:HOST:PORT")
    if not pd and pcp not in (1, dcp):
        fix = f"use --pcp {dcp} (or 1)" if dcp > 1 else f"use --pcp {pcp} --dcp {pcp}, or --pcp 1"
        cli.bad_value(PROG, "--prefill-context-parallel-size/--pcp", f"--pcp={pcp} with --dcp={dcp}",
                      "the server runs one engine whose PCP ranks are its DCP ranks: --pcp is 1 or equals --dcp "
                      "(P/D, a PCP prefill role and a DCP decode role: add --kv-transfer-config)", fix)
    if a.compilation_config is not None and a.compilation_config["graph_backend"] != "auto":
        cli.check_backend(PROG, "--compilation-config backend", a.compilation_config["graph_backend"])
    a.distributed_executor_backend = check_backend(a)
    if a.pcp_min_tokens == "measure" and a.distributed_executor_backend == "uni":
        cli.bad_value(PROG, "--pcp-min-tokens", "--pcp-min-tokens measure with --distributed-executor-backend uni",
                      "the ranks are timed as processes (threads of one process share its GIL)",
                      "add --distributed-executor-backend mp, or give --pcp-min-tokens N")
    try:
        return SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                               enable_chunked_prefill=a.enable_chunked_prefill, max_model_len=a.max_model_len)
    except ConfigError as e:
        cli.speak_problems(PROG, e.problems, SCHEDULER_FLAGS)


def main(argv=None) -> int:
    """``cpattn serve``: parse, check, build the engine, serve until a signal (module docstring)."""
    a = parser().parse_args(argv)
    missing = missing_packages()
    if missing:
        cli.usage_error(PROG, f"needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                              "installed; fix: pip install 'cpattn[serve]' (or pip install fastapi uvicorn)")
    sched = check_args(a)
    backend = a.distributed_executor_backend
    tokenizer = check_model(a.model) if a.model is not None else None
    if backend != "external_launcher" or os.environ.get("RANK") == "0":  # only rank 0 listens
        from cpattn.pool.server import port_in_use

        try:
            taken = port_in_use(a.host, a.port)
        except OSError as e:  # an address this machine does not have, a name that does not resolve
            cli.usage_error(PROG, f"argument --host: saw {a.host!r}, which cannot be bound here "
                                  f"({e.strerror or e}); fix: pass an address of this machine, e.g. 127.0.0.1")
        if taken:
            print(f"{PROG}: error: {a.host}:{a.port} is already in use; pick another --port", file=sys.stderr)
            return 1
    from cpattn.serve import run

    if backend == "mp":
        from cpattn.serve.launch import launch

        return launch(a, sched)
    if backend == "external_launcher":
        from cpattn.serve.launch import torchrun_rank

        return torchrun_rank(a, sched)
    try:
        return run.serve(a, sched, tokenizer)
    except run.EngineRefused as e:
        cli.usage_error(PROG, str(e))


def check_model(model_dir: str):
    """``--model DIR``: config.json and the safetensors headers checked (no weights read), and its
    tokenizer.json loaded if there is one (returned; None without), or exit 2."""
    from cpattn.bench.demo_setup import Spec, model_config
    from cpattn.serve.tokenize import load_tokenizer

    try:
        model_config(Spec(model_dir=model_dir))
        return load_tokenizer(model_dir)
    except ValueError as e:
        cli.usage_error(PROG, f"argument --model: {e}")



