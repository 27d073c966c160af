"""``cpattn demo``: a long prompt prefilled with PCP, decoded with DCP in graph mode, checked token for token.

The main job end to end, on P real gloo processes (or under ``torchrun``),
composed from the engine's stages (:mod:`cpattn.engine`):

1. **Reference.** Rank 0 runs the model on one device (dense KV cache,
   eager, :func:`cpattn.engine.reference.reference_generate`): the greedy
   tokens every parallel run must reproduce, and the single-device TTFT / TPOT.
2. **Prefill engine (PCP).** Every prompt is split head-tail over the ranks
   (:func:`cpattn.pcp_plan`), each rank runs the whole model on its tokens
   with :func:`cpattn.pcp_prefill` attention (DSA models: DSA-CP); the first
   token comes from the last prompt row of each request
   (:func:`cpattn.engine.prefill.prefill`). TTFT is this phase.
3. **KV hand-off.** ``cp_kv_cache_interleave_size == block_size``, so every
   cache block of B consecutive tokens belongs to one decode rank (block k ->
   rank k % N); each prefill row goes straight to its owner in one
   all-to-all (:func:`cpattn.engine.handoff.exchange`).
4. **Decode engine (DCP, FULL_DECODE_ONLY).** One decode step of the whole
   model (embedding, every layer with ``write_kv`` + :func:`cpattn.dcp.dcp_decode`,
   lm_head, argmax) is a pure ``step(state, batch)``
   (:func:`cpattn.engine.decode.decode_step`); a
   :class:`cpattn.graphs.DecodeRunner` captures it per capture size with
   the chosen backend ("cpu" = torch.compile inductor, fullgraph) and replays
   it for every uniform decode batch. The DCP metadata (positions, local
   lengths, slot mappings) is computed inside the step from the persistent
   ``seq_lens`` / ``block_table`` buffers by :func:`cpattn.dcp.plan_tensors`.
   The same step also runs eagerly on a second cache, side by side.

Two engine configs are built and validated first
(:func:`cpattn.engine.driver.engine_configs`): a prefill engine
(``pcp_size=P``, ``kv_role="kv_producer"``) and a decode engine
(``tp_size=dcp_size=N``, ``pcp_size=1``, ``kv_role="kv_consumer"``), since
the guide forbids PCP and DCP in one engine. Both share the ranks.

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

import torch

from cpattn.bench import args as cli
from cpattn.bench.common import write_json
from cpattn.bench.demo_report import report, summarize
from cpattn.bench.demo_run import GRAPH_MODES, Spec, demo_rank, engine_configs, load_model, model_config, prompts
from cpattn.bench.demo_run import reference as reference_run
from cpattn.comm.group import Group
from cpattn.config import ConfigError
from cpattn.engine.family import FAMILY_MODULES

__all__ = ["Spec", "load_model", "prompts", "main", "parser", "run_rank"]
PROG = "cpattn demo"


def parser():
    """The demo's flags (vLLM's names for the parallel sizes; every default shown by --help)."""
    p = cli.parser(PROG, __doc__)
    p.add_argument("--model", metavar="DIR", default=None,
                   help="local Hugging Face checkpoint (config.json + *.safetensors) instead of an embedded model")
    p.add_argument("--model-type", choices=sorted(FAMILY_MODULES), default="qwen3",
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
                   help="DecodeRunner backend: cpu (torch.compile inductor), aot_eager, eager, cuda, npu, torchair")
    p.add_argument("--capture-sizes", type=cli.int_list, default=None,
                   help="comma-separated capture sizes in query tokens (default: the one bucket that holds --batch)")
    p.add_argument("--merge", choices=["local_ag", "local_a2a", "a2a", "ag_rs"], default="local_ag",
                   help="DCP decode layer: local_ag (query heads computed locally, one all-gather of [O | L]: 1 "
                        "collective per layer), local_a2a (2), a2a (3), ag_rs (4: query gather, LSE all-gather, "
                        "reduce-scatter, output gather)")
    cli.add_dtype(p, help="parameter and KV-cache data type")
    p.add_argument("--seed", type=cli.nonnegative_int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--no-eager-row", action="store_true", help="skip the eager DCP decode run next to the graph one")
    p.add_argument("--reps", type=cli.positive_int, default=3, help="prefills timed per run (TTFT is the median)")
    p.add_argument("--threads", type=cli.positive_int, default=1, help="intra-op threads per rank")
    p.add_argument("--kv-pool", metavar="SPEC", default=None,
                   help="also run a cold and a warm request through a KV pool: lmdb:DIR or mooncake:HOST:PORT "
                        "(cpattn pool serve starts the latter; default: no pool)")
    p.add_argument("--torchrun", action="store_true", help="run as one rank under torchrun (also detected from RANK)")
    p.add_argument("--perturb-reference", action="store_true",
                   help="testing aid: change one reference token, so the check must fail (exit 1)")
    cli.add_json(p)
    cli.add_timeout(p)
    cli.add_progress(p)
    return p


def _spec(a, world: int | None) -> Spec:
    """The run's :class:`Spec` from parsed flags; usage errors (exit 2) for sizes the demo cannot lay out."""
    default = world or 2
    pcp = a.prefill_context_parallel_size or default
    dcp = a.decode_context_parallel_size or default
    w = max(pcp, dcp)
    if pcp not in (1, w) or dcp not in (1, w):
        cli.usage_error(PROG, f"argument --pcp/--dcp: saw --pcp={pcp} --dcp={dcp}; rule: each is 1 or the number of "
                              f"ranks ({w}): both engines share the same ranks; fix: use --pcp {w} --dcp {w}, or 1")
    if world is not None and w != world:
        cli.usage_error(PROG, f"argument --pcp/--dcp: saw --pcp={pcp} --dcp={dcp} under torchrun with {world} "
                              f"processes; rule: they need {w}; fix: use --nproc-per-node {w} or drop --pcp/--dcp")
    tp = a.tensor_parallel_size or dcp
    if tp != dcp:
        cli.bad_value(PROG, "--tensor-parallel-size/--tp", tp, "the engine runs TP as the DCP group's head split, "
                      "so --tp equals --dcp", f"drop --tp or use --tp {dcp}")
    from cpattn.graphs.backends import backends

    if a.backend not in backends():
        cli.bad_value(PROG, "--backend", repr(a.backend), f"one of {', '.join(backends())}", "pick one of them")
    if a.kv_pool is not None and not (a.kv_pool.startswith("lmdb:") or a.kv_pool.startswith("mooncake:")) \
            or a.kv_pool in ("lmdb:", "mooncake:"):
        cli.bad_value(PROG, "--kv-pool", repr(a.kv_pool), "lmdb:DIR or mooncake:HOST:PORT",
                      "e.g. --kv-pool lmdb:/tmp/cpattn-pool")
    return Spec(model_dir=a.model, model_type=a.model_type, pcp=pcp, dcp=dcp, prompt_len=a.prompt_len,
                batch=a.batch, max_new_tokens=a.max_new_tokens, graph_mode=a.graph_mode, backend=a.backend,
                block_size=a.block_size, interleave_size=a.cp_kv_cache_interleave_size, merge=a.merge,
                dtype=a.dtype, seed=a.seed, capture_sizes=a.capture_sizes, eager_row=not a.no_eager_row,
                progress=not a.no_progress, perturb_reference=a.perturb_reference, reps=a.reps, kv_pool=a.kv_pool)


def check(spec: Spec):
    """Validate the model and the layout before any rank starts (config only, no weights); usage errors exit 2."""
    try:
        family, cfg = model_config(spec)
    except ValueError as e:
        cli.usage_error(PROG, f"argument --model: {e}" if spec.model_dir else str(e))
    try:
        return engine_configs(spec, family, cfg)
    except ConfigError as e:
        # the demo's decode engine has tp = dcp: a TP rule is a DCP rule here; head counts are the model's
        cli.speak_problems(PROG, e.problems, {"tp_size": "--decode-context-parallel-size/--dcp",
                                              "num_attention_heads": "num_attention_heads", "graph_backend": "--backend",
                                              "kv_pool": "--kv-pool"})


def run_rank(group: Group, spec: Spec, threads: int = 1) -> dict:
    """:func:`cpattn.bench.demo_run.demo_rank` with this process's settings (threads, one inductor compile thread)."""
    torch.set_num_threads(threads)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # ranks compile side by side: no worker pool per rank
    return demo_rank(group, spec)


def main(argv=None) -> int:
    """``cpattn demo``: the main job. Exit 0 iff every parallel run gives the single-device tokens; 2 for
    a usage error; 1 when the tokens differ or a rank failed."""
    a = parser().parse_args(argv)
    if a.torchrun or ("RANK" in os.environ and "LOCAL_RANK" in os.environ):
        return _torchrun(a)
    from cpattn.comm.launch import spawn

    spec = _spec(a, None)
    engines = check(spec)
    with cli.report_to(a.json):
        torch.set_num_threads(a.threads)  # the reference gets what one rank gets
        ref = reference_run(spec)  # the one-device run, here, before any rank starts
        res = spawn(spec.world_size, run_rank, spec, a.threads, threads=a.threads, timeout_s=a.timeout)[0]
        s = summarize(res, ref, spec, engines)
        print(report(s))
    write_json(a.json, s)
    return 0 if s["tokens_match"] else 1


def _torchrun(a) -> int:
    """One rank under torchrun: rank 0 runs the one-device reference while the others wait, then all run."""
    import torch.distributed as dist

    from cpattn.comm import init_from_env

    group = init_from_env("gloo", timeout_s=max(a.timeout, 600.0))  # rank 0's reference run happens inside
    try:
        spec = _spec(a, group.size)
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
        return 0 if s["tokens_match"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
