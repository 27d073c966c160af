"""``cpattn demo``: a long prompt prefilled with PCP, decoded with DCP in graph mode, checked token for token.

The main job end to end, on P real gloo processes (or under ``torchrun``),
through the engine's step loop (:func:`cpattn.engine.run_rank` on every
rank, timed by its ``before_step`` / ``on_step`` hooks; :mod:`cpattn.bench.demo_loop`):

1. **Reference.** Rank 0 runs the model on one device (dense KV cache,
   eager, :func:`cpattn.engine.reference.reference_generate`): the greedy
   tokens every parallel run must reproduce, and the single-device TTFT / TPOT.
2. **Step 0: the prefill (PCP).** Every prompt arrives at step 0 with a token
   budget that holds the whole batch, so step 0 prefills every prompt: each is
   split head-tail over the ranks (:func:`cpattn.pcp_plan`), each rank runs the
   whole model on its tokens with PCP attention (DSA models: DSA-CP; DeepSeek-V4
   and Qwen3-Next through their own runners), and every KV row goes to the
   blocks of its DCP owner in the same step (``cp_kv_cache_interleave_size ==
   block_size``: block k -> rank k % N). The first tokens come from this step:
   TTFT is its time (median over ``--reps`` fresh runs).
3. **Decode steps (DCP, FULL_DECODE_ONLY).** Every later step is a uniform
   decode of the batch: one decode step of the whole model (embedding, every
   layer with ``write_kv`` + :func:`cpattn.dcp.dcp_decode`, lm_head, argmax) is
   a pure ``step(state, batch)``; a :class:`cpattn.graphs.DecodeRunner`
   captures it per capture size with the chosen backend ("cpu" = torch.compile
   inductor, fullgraph) and replays it for every step. The same batch also runs
   eagerly in a second run, side by side: TPOT is the median decode step.

Two engine configs are built and validated first
(:func:`cpattn.engine.driver.engine_configs`): vLLM-Ascend's P/D pair, a prefill
engine (``pcp_size=P``, ``kv_role="kv_producer"``) and a decode engine
(``tp_size=dcp_size=N``, ``pcp_size=1``, ``kv_role="kv_consumer"``), since
the guide forbids PCP and DCP in one engine; cpattn runs them as one step-loop
engine on the same ranks (exactly: the tokens are checked). With ``--pcp P
--dcp 1`` (P > 1) that engine prefills over the P ranks and decodes on the first
one (:mod:`cpattn.engine.runner_wide`; the others hold no KV).

Exit status 0 only when every parallel run's tokens equal the reference's.
Checkpoints of other families (``--model``) run too; a family whose decode
step is not capturable (data-dependent MoE routing, DSA key gathering) goes
through the runner with the "eager" backend (persistent buffers, padding, no
compiler), and the output says so.

Usage::

    cpattn demo                                  # embedded tiny Qwen3, PCP=2 -> DCP=2, graph mode
    cpattn demo --prompt-len 8192 --max-new-tokens 64 --json out.json
    cpattn demo --model-type glm_moe_dsa         # an embedded tiny random model of another family
    cpattn demo --model path/to/checkpoint       # a local Hugging Face checkpoint
    cpattn demo --kv-pool lmdb:/tmp/pool         # then a warm request that finds its prefix in a KV pool
    torchrun --nproc-per-node 2 -m cpattn.bench.demo --torchrun

The first run compiles the decode step (about a minute or two on a 2-core
CPU; the demo says so when it starts); later runs reuse inductor's cache.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from cpattn.config import cli_args as cli
from cpattn.dcp.layer_merges import ENGINE_MERGES
from cpattn.pool.spec import pool_spec_problem

# torch and the engine are imported once the command line is known good (a typo costs no `import torch`);
# the run's names (Spec, load_model, prompts) are this module's too, imported on first use
__all__ = ["Spec", "load_model", "prompts", "main", "parser", "run_rank"]
PROG = "cpattn demo"
GRAPH_MODES = ("none", "full_decode_only")
_FROM_RUN = ("Spec", "load_model", "prompts")


def __getattr__(name: str):
    if name in _FROM_RUN:
        from cpattn.bench import demo_run

        return getattr(demo_run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parser():
    """The demo's flags (vLLM's names for the parallel sizes; every default shown by --help)."""
    p = cli.parser(PROG, __doc__)
    p.add_argument("--model", metavar="DIR", default=None,
                   help="local Hugging Face checkpoint (config.json + *.safetensors) instead of an embedded model")
    p.add_argument("--model-type", choices=cli.MODEL_TYPES, default="qwen3",
                   help="family of the embedded tiny random-init model (ignored with --model)")
    cli.add_parallel(p, tp=None, pcp=None, dcp=None, interleave=None, block_size=16, helps={
        "tp": "decode engine's tensor-parallel ranks; the engine runs TP as the DCP group's head split, so it "
              "equals --dcp (default: --dcp)",
        "pcp": "prefill engine's PCP ranks: 1 or the number of ranks (default 2; under torchrun the world size)",
        "dcp": "decode engine's DCP ranks: 1 or the number of ranks (default 2; under torchrun the world size)",
        "interleave": "tokens per DCP owner run (default: --block-size, so whole blocks are handed over)",
        "block_size": "tokens per KV-cache block"})
    p.add_argument("--prompt-len", type=cli.positive_int, default=4096, help="tokens of the longest prompt")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="requests (prompts of uneven lengths)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=32, help="greedy tokens per request")
    p.add_argument("--graph-mode", choices=GRAPH_MODES, default="full_decode_only", help="decode in graph mode or not")
    p.add_argument("--backend", default="cpu",
                   help="DecodeRunner backend: cpu (torch.compile inductor), aot_eager, eager, cuda, npu, torchair "
                        "(checked against this machine before anything runs)")
    p.add_argument("--capture-sizes", type=cli.int_list, default=None,
                   help="comma-separated capture sizes in query tokens (default: the one bucket that holds --batch)")
    p.add_argument("--merge", choices=ENGINE_MERGES, default="local_ag",
                   help="DCP decode layer: local_ag (query heads computed locally, one all-gather of [O | L]: 1 "
                        "collective per layer), local_a2a (2), a2a (3), ag_rs (4: query gather, LSE all-gather, "
                        "reduce-scatter, output gather)")
    cli.add_dtype(p, help="parameter and KV-cache data type")
    p.add_argument("--seed", type=cli.nonnegative_int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--no-eager-row", action="store_true", help="skip the eager DCP decode run next to the graph one")
    p.add_argument("--reps", type=cli.positive_int, default=3,
                   help="fresh runs whose step 0 (the prefill of the whole batch) is timed; TTFT is the median")
    p.add_argument("--threads", type=cli.positive_int, default=1, help="intra-op threads per rank")
    p.add_argument("--kv-pool", metavar="SPEC", default=None,
                   help="also time requests through a KV pool, cold vs warm (a shared 7/8 prefix), after a warm-up: "
                        "lmdb:DIR or mooncake:HOST:PORT (cpattn pool serve starts the latter; default: no pool); "
                        "exit 1 if the pool serves no block")
    p.add_argument("--pool-rounds", type=cli.positive_int, default=3,
                   help="interleaved cold / warm rounds of the pool phase (each a fresh prompt)")
    p.add_argument("--torchrun", action="store_true", help="run as one rank under torchrun (also detected from RANK)")
    p.add_argument("--perturb-reference", action="store_true",
                   help="testing aid: change one reference token, so the check must fail (exit 1)")
    cli.add_json(p)
    cli.add_timeout(p)
    cli.add_progress(p)
    return p


def _check_args(a, world: int | None) -> tuple[int, int]:
    """(pcp, dcp) from parsed flags; usage errors (exit 2) for what the demo cannot lay out or run here, before
    torch is imported (but for ``--backend cuda``, which asks torch whether there is a GPU)."""
    default = world or 2
    pcp = a.prefill_context_parallel_size or default
    dcp = a.decode_context_parallel_size or default
    w = max(pcp, dcp)  # sizes the engines cannot share are refused by check(), which knows the model
    if world is not None and w != world:
        cli.usage_error(PROG, f"argument --pcp/--dcp: saw --pcp={pcp} --dcp={dcp} under torchrun with {world} "
                              f"processes; rule: they need {w}; fix: use --nproc-per-node {w} or drop --pcp/--dcp")
    tp = a.tensor_parallel_size or dcp
    if tp != dcp:
        cli.bad_value(PROG, "--tensor-parallel-size/--tp", tp, "the engine runs TP as the DCP group's head split, "
                      "so --tp equals --dcp", f"drop --tp or use --tp {dcp}")
    if a.kv_pool is not None and not (a.kv_pool.startswith("lmdb:") or a.kv_pool.startswith("mooncake:")) \
            or a.kv_pool in ("lmdb:", "mooncake:"):
        cli.bad_value(PROG, "--kv-pool", repr(a.kv_pool), "lmdb:DIR or mooncake:HOST:PORT",
                      "e.g. --kv-pool lmdb:/tmp/cpattn-pool")
    if a.kv_pool is not None and (why := pool_spec_problem(a.kv_pool)) is not None:  # torch-free
        cli.usage_error(PROG, f"argument --kv-pool: saw {a.kv_pool!r}: {why}")
    cli.check_backend(PROG, "--backend", a.backend)
    return pcp, dcp


def _spec(a, world: int | None, pool_salt: int = 0):
    """The run's :class:`~cpattn.bench.demo_run.Spec` from parsed flags (after :func:`_check_args`)."""
    from cpattn.bench.demo_run import Spec

    pcp, dcp = _check_args(a, world)
    return Spec(model_dir=a.model, model_type=a.model_type, pcp=pcp, dcp=dcp, prompt_len=a.prompt_len,
                batch=a.batch, max_new_tokens=a.max_new_tokens, graph_mode=a.graph_mode, backend=a.backend,
                block_size=a.block_size, interleave_size=a.cp_kv_cache_interleave_size, merge=a.merge,
                dtype=a.dtype, seed=a.seed, capture_sizes=a.capture_sizes, eager_row=not a.no_eager_row,
                progress=not a.no_progress, perturb_reference=a.perturb_reference, reps=a.reps, kv_pool=a.kv_pool,
                pool_rounds=a.pool_rounds, pool_salt=pool_salt)


def check(spec):
    """Validate the model and the layout before any rank starts (config only, no weights); usage errors exit 2."""
    from cpattn.bench.demo_run import engine_configs, model_config
    from cpattn.config import ConfigError

    try:
        family, cfg = model_config(spec)
    except ValueError as e:
        cli.usage_error(PROG, f"argument --model: {e}" if spec.model_dir else str(e))
    try:
        return engine_configs(spec, family, cfg)
    except ConfigError as e:
        problems = e.problems
        if any(p.startswith(("tp_size:", "dcp_size:", "pcp_size:", "world_size:")) for p in problems):
            from cpattn.engine.checks import nearest_sizes  # a fix for the sizes: pairs that pass every rule

            def fits(p, n):
                try:
                    return bool(engine_configs(dataclasses.replace(spec, pcp=p, dcp=n), family, cfg))
                except ConfigError:
                    return False

            offers = nearest_sizes(fits, spec.pcp, spec.dcp)
            if offers:
                fix = ", ".join(f"--pcp {p} --dcp {n}" for p, n in offers)
                problems = [f"{p.rpartition('; fix: ')[0]}; fix: use {fix}"
                            if p.startswith(("tp_size:", "dcp_size:", "pcp_size:", "world_size:")) else p
                            for p in problems]
        # the demo's decode engine has tp = dcp: a TP rule is a DCP rule here; head counts are the model's
        cli.speak_problems(PROG, problems, {"tp_size": "--decode-context-parallel-size/--dcp",
                                              "num_attention_heads": "num_attention_heads", "graph_backend": "--backend",
                                              "kv_pool": "--kv-pool"})


def run_rank(group, spec, threads: int = 1) -> dict:
    """:func:`cpattn.bench.demo_run.demo_rank` with this process's settings (threads, one inductor compile thread)."""
    import torch

    from cpattn.bench.demo_run import demo_rank

    torch.set_num_threads(threads)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # ranks compile side by side: no worker pool per rank
    return demo_rank(group, spec)


def main(argv=None) -> int:
    """``cpattn demo``: the main job. Exit 0 iff every parallel run gives the single-device tokens (and a
    ``--kv-pool`` served blocks); 2 for a usage error; 1 when the tokens differ, the pool served nothing or a
    rank failed."""
    a = parser().parse_args(argv)
    if a.torchrun or ("RANK" in os.environ and "LOCAL_RANK" in os.environ):
        return _torchrun(a)
    _check_args(a, None)  # before torch: a wrong flag costs no import
    import torch

    from cpattn.bench.common import write_json
    from cpattn.bench.demo_report import report, summarize
    from cpattn.bench.demo_run import reference as reference_run
    from cpattn.comm.launch import spawn

    spec = _spec(a, None, _salt())
    engines = check(spec)
    with cli.report_to(a.json):
        torch.set_num_threads(a.threads)  # the reference gets what one rank gets
        ref = reference_run(spec)  # the one-device run, here, before any rank starts
        res = spawn(spec.world_size, run_rank, spec, a.threads, threads=a.threads, timeout_s=a.timeout)[0]
        s = summarize(res, ref, spec, engines)
        print(report(s))
    write_json(a.json, s)
    return 0 if s["ok"] else 1


def _salt() -> int:
    """A fresh salt for the pool phase's prompts: its cold requests are new tokens on every run."""
    return int.from_bytes(os.urandom(6), "little")


def _torchrun(a) -> int:
    """One rank under torchrun: rank 0 runs the one-device reference while the others wait, then all run."""
    import torch
    import torch.distributed as dist

    from cpattn.bench.common import write_json
    from cpattn.bench.demo_report import report, summarize
    from cpattn.bench.demo_run import reference as reference_run
    from cpattn.comm import init_from_env

    group = init_from_env("gloo", timeout_s=max(a.timeout, 600.0))  # rank 0's reference run happens inside
    try:
        salt = int(group.all_reduce(torch.tensor([_salt() if group.rank == 0 else 0], dtype=torch.int64)).item())
        spec = _spec(a, group.size, salt)  # rank 0's salt on every rank
        if group.rank != 0:
            spec = dataclasses.replace(spec, progress=False)
        engines = check(spec)
        torch.set_num_threads(a.threads)  # the reference gets what one rank gets
        ref = reference_run(spec) if group.rank == 0 else None
        group.all_reduce(torch.zeros(1))  # wait for the reference
        res = run_rank(group, spec, a.threads)
        if group.rank != 0:
            return 0
        with cli.report_to(a.json):
            s = summarize(res, ref, spec, engines)
            print(report(s))
        write_json(a.json, s)
        return 0 if s["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
