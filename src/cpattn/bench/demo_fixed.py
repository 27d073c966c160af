"""The demo's fixed-batch composition, kept for the one layout the step loop does not run: PCP over the
ranks with a one-rank DCP decode (``--pcp W --dcp 1``, W > 1). Every prompt is prefilled at once (timed),
the KV handed to the decode cache, then the batch decoded captured (FULL_DECODE_ONLY) and eager side by side
(:mod:`cpattn.bench.demo_run` picks it; every other layout runs through :func:`cpattn.engine.run_rank`).

Its result has the keys of :func:`cpattn.bench.demo_loop.loop_rank`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from cpattn.bench.common import Progress
from cpattn.bench.demo_pool import pool_rank
from cpattn.bench.demo_setup import Spec, engine_configs, graph_backend, load_model, prompts
from cpattn.comm.group import Group
from cpattn.engine import decode_stage, driver
from cpattn.engine.batch import Prompts
from cpattn.engine.options import Algorithms
from cpattn.graphs import capture_sizes, pick_size


def _barrier(group: Group) -> None:
    if group.size > 1:
        group.all_reduce(torch.zeros(1))


def _timed(group: Group, fn):
    """(seconds, result) of ``fn()`` between two barriers: the slowest rank's time."""
    _barrier(group)
    t0 = time.perf_counter()
    out = fn()
    _barrier(group)
    return time.perf_counter() - t0, out


def _tpot(group: Group, times) -> float:
    """Time per output token: the median step time, the slowest rank's."""
    mine = statistics.median(times) if times else float("nan")
    return max(group.all_gather(torch.tensor([mine], dtype=torch.float64)).tolist())


def _step_bytes(runner, size: int, dgroup: Group) -> int:
    """Bytes one decode step of ``size`` tokens sends per rank: the runner's step on an all-padding batch (its
    fields' pads: no KV write, no key seen), counted eagerly (a replayed graph counts nothing)."""
    batch = {name: torch.full((size, *f.shape), f.pad, dtype=f.dtype) for name, f in runner.fields.items()}
    batch["cu_seqlens_q"] = torch.zeros(size + 1, dtype=torch.int32)
    dgroup.stats.reset()
    runner.step(runner.state, batch)
    return dgroup.stats.total_sent()


def fixed_batch_rank(group: Group, spec: Spec) -> dict:
    """The fixed-batch parallel run on one rank of ``group`` (``spec.world_size`` ranks); every rank returns the
    full result."""
    torch.manual_seed(spec.seed)
    family, cfg, params = load_model(spec)
    pre_cfg, dec_cfg = engine_configs(spec, family, cfg)
    tokens, _ = prompts(spec, cfg.vocab_size)
    batch = Prompts(tokens, tuple(spec.prompt_lens))
    steps, nreq = spec.max_new_tokens - 1, spec.batch
    algorithms = Algorithms(dcp_merge=spec.merge)
    rank0 = group.rank == 0
    n_runs = 1 if spec.graph_mode == "none" else 1 + spec.eager_row
    bar = Progress(4 + steps * n_runs, enabled=spec.progress and rank0)

    # 1. prefill engine: PCP over the ranks (or each rank alone)
    pg, dg = driver.stage_group(group, spec.pcp), driver.stage_group(group, spec.dcp)
    warm = Prompts.of([list(range(4 * max(pg.size, 1)))])
    driver.prefill_fn(pg, family, params, cfg, warm, algorithms, False)  # kernels and gloo links warm
    group.stats.reset()
    times = []
    for _ in range(spec.reps):
        sec, out = _timed(group, lambda: driver.prefill_fn(pg, family, params, cfg, batch, algorithms, False))
        times.append(sec)
    prefill_bytes = group.stats.total_sent() // spec.reps
    first = out.first_logits.argmax(-1)
    bar.step(f"prefill (PCP={spec.pcp})")

    # 2. KV hand-off into the decode engine's paged shards (each row to its DCP owner)
    def new_shard():
        return decode_stage.new_shard(family, cfg, params, batch, steps, dec_cfg, None, dg)

    shard = new_shard()
    group.stats.reset()
    handoff_s, _ = _timed(group, lambda: driver.handoff_stage(group, family, pg, dg, shard, out, algorithms))
    handoff_bytes = group.stats.total_sent()
    bar.step("KV hand-off")

    # 3. decode engine: DCP, the whole model step captured (FULL_DECODE_ONLY) and eager, side by side
    backend = graph_backend(spec, family)
    runs: dict[str, dict] = {}

    def on_step(label):
        return lambda s: bar.step(f"{label} decode step {s}/{steps}")

    if spec.graph_mode == "full_decode_only":
        sizes = spec.capture_sizes or (pick_size(capture_sizes(4096), nreq),)  # the bucket holding the batch
        gcfg = dec_cfg.replace(capture_sizes=tuple(sizes))
        if backend != "eager":
            bar.note(f"compiling the decode step for capture sizes {list(sizes)} with torch.compile ({backend}, "
                     "fullgraph): a minute or two on the first run, seconds once inductor's cache is warm")
        _barrier(group)
        t0 = time.perf_counter()
        runner = decode_stage.capture(dg, family, params, cfg, shard, batch, gcfg, algorithms, None)
        capture_s = time.perf_counter() - t0
        _barrier(group)
        bar.step(f"captured sizes {list(sizes)} ({backend})")
        step_bytes = _step_bytes(runner, pick_size(runner.sizes, nreq) or nreq, dg)
        _barrier(group)
        dec = decode_stage.run_decode(dg, family, params, cfg, shard, batch, first, steps, gcfg, algorithms, None,
                                      on_step("graph"), runner=runner)
        runs["graph"] = {"tokens": dec.tokens, "tpot_s": _tpot(group, dec.step_s), "capture_s": capture_s,
                         "stats": dec.runner, "backend": runner.backend.name, "bytes_per_step": step_bytes,
                         "kv_bytes": shard.kv_bytes()}
    else:
        bar.step("no capture (graph mode none)")
    if spec.graph_mode == "none" or spec.eager_row:
        eshard = shard if spec.graph_mode == "none" else new_shard()
        if eshard is not shard:
            driver.handoff_stage(group, family, pg, dg, eshard, out, algorithms)
        ecfg = dec_cfg.replace(graph_mode="NONE")
        _barrier(group)
        dg.stats.reset()  # every step decodes every request: the bytes of one step are the run's / steps
        dec = decode_stage.run_decode(dg, family, params, cfg, eshard, batch, first, steps, ecfg, algorithms, None,
                                      on_step("eager"))
        step_bytes = dg.stats.total_sent() // max(steps, 1)
        runs["eager"] = {"tokens": dec.tokens, "tpot_s": _tpot(group, dec.step_s), "bytes_per_step": step_bytes,
                         "kv_bytes": eshard.kv_bytes()}

    def per_rank(x: int) -> list[int]:
        return [int(v) for v in group.all_gather(torch.tensor([x], dtype=torch.int64)).tolist()]

    res = dict(ttft_s=statistics.median(times), ttft_samples=times, handoff_s=handoff_s,
               prefill_bytes=per_rank(prefill_bytes), handoff_bytes=per_rank(handoff_bytes), first=first, runs=runs,
               kv_bytes_per_rank=per_rank(shard.kv_bytes()), decode_backend=backend,
               whole_step_captured=family.capturable, model=family.name, config=dataclasses.asdict(cfg),
               composition="fixed batch")
    if spec.kv_pool is not None:
        res["pool"] = pool_rank(group, spec, family, cfg, params, pre_cfg, dec_cfg)
    bar.step("done")
    return res

