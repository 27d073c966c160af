"""``cpattn demo``'s parallel run through the step loop: :func:`cpattn.engine.run_rank` on every rank, timed by hooks.

Every prompt arrives at step 0, with a token budget that holds the whole batch, so step 0 prefills every
prompt (PCP over the ranks; each KV row is written into the blocks of its DCP owner in the same step) and
emits every first token; each later step is a uniform decode of the batch, replayed from a captured
program (FULL_DECODE_ONLY) or run eagerly.

- **TTFT**: the time of step 0, median over ``spec.reps`` fresh runs (a new engine and request set each,
  one token per request), after an untimed warm-up run;
- **TPOT**: the time of each decode step, median over the steps, of a captured run and an eager run side
  by side (their ratio: per step index, median [low-high]);
- a step's time: a barrier (``before_step`` hook), the step, the clock (``on_step`` hook); the slowest
  rank's, gathered after the run;
- bytes: what this rank sent in step 0 (``prefill_sent``: the PCP exchange and the KV rows sent to their
  DCP owners; there is no separate hand-off) and in one decode step.

Example
-------
>>> import cpattn
>>> from cpattn.bench.demo_setup import Spec
>>> spec = Spec(prompt_len=24, batch=2, max_new_tokens=3, block_size=4, reps=1, progress=False,
...             backend="eager")
>>> res = cpattn.simulate(2, loop_rank, spec)[0]
>>> res["composition"], res["first"].shape, res["runs"]["graph"]["tokens"].shape, res["runs"]["graph"]["stats"]["graph"]
('step loop', torch.Size([2]), torch.Size([2, 2]), 2)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from cpattn.bench.common import Progress
from cpattn.bench.demo_setup import Spec, engine_configs, graph_backend, load_model, prompts
from cpattn.bench.harness import spread
from cpattn.comm.group import Group
from cpattn.config import GuideCompatWarning, SchedulerConfig
from cpattn.engine.llm import SamplingParams
from cpattn.engine.run_rank import Arrival, run_rank
from cpattn.graphs import capture_sizes, pick_size


@dataclass(frozen=True)
class Step:
    """One engine step on this rank: seconds (barrier to end), a prefill step or not, replayed, bytes sent,
    and the model step's part of it (``forward``: the engine's ``step_times["forward"]``; the rest is the step
    loop's host work: schedule, inputs, sampling, commit)."""

    seconds: float
    prefill: bool
    replayed: bool
    sent: int
    forward: float = float("nan")


def _barrier(group: Group) -> None:
    if group.size > 1:
        group.all_reduce(torch.zeros(1))


def _step_bytes(runner, size: int, group: Group) -> int:
    """Bytes one decode step of ``size`` tokens sends per rank: the captured step run eagerly on an all-padding
    batch (its fields' pads: no KV write, no key seen), since a replayed program counts nothing."""
    batch = {name: torch.full((size, *f.shape), f.pad, dtype=f.dtype) for name, f in runner.fields.items()}
    batch["cu_seqlens_q"] = torch.zeros(size + 1, dtype=torch.int32)
    group.stats.reset()
    runner.step(runner.state, batch)
    return group.stats.total_sent()


def kv_bytes(runner) -> int:
    """Bytes of a step runner's cache storage on this rank: paged KV (plus a hybrid model's state slots),
    or DeepSeek-V4's rings and compressed entries."""
    if hasattr(runner, "holder"):  # runner_v4.V4StepRunner
        return runner.holder.kv_bytes()
    states = getattr(runner, "states", None)  # runner_hybrid.HybridStepRunner
    extra = 0 if states is None else sum(t.numel() * t.element_size() for t in (*states.conv, *states.state))
    return runner.shard.kv_bytes() + extra


class Timer:
    """The hooks of one :func:`run_rank` call: per step a barrier, the clock, the step, the clock; on the
    last step the engine's facts (``facts``: a callable of the engine, run on every rank at once)."""

    def __init__(self, group: Group, nreq: int, facts=None, on_built=None, on_decode=None):
        self.group, self.nreq, self._facts, self.on_built, self.on_decode = group, nreq, facts, on_built, on_decode
        self.steps: list[Step] = []
        self.facts: dict = {}
        self.built_s: float | None = None
        _barrier(group)
        self._t0 = self._start = time.perf_counter()

    def before(self, role, engine) -> None:
        _barrier(self.group)
        self._t0 = time.perf_counter()
        if self.built_s is None:  # the engine's construction (a capture compiles here)
            self.built_s = self._t0 - self._start
            if self.on_built is not None:
                self.on_built()

    def after(self, role, engine, outs) -> None:
        dt = time.perf_counter() - self._t0
        if not outs:
            return
        out, replayed = engine.last_step
        self.steps.append(Step(dt, any(out.is_prefill), bool(replayed), engine.stats.last_step_bytes,
                               engine.step_times.get("forward", float("nan"))))
        if len(self.steps) == 1 and not (len(outs) == self.nreq and all(len(o.token_ids) == 1 for o in outs)):
            raise RuntimeError(f"cpattn demo: step 0 emitted {len(outs)} of {self.nreq} first tokens; the budget "
                               "must prefill the whole batch in one step (a bug of the demo's scheduler config)")
        if len(self.steps) > 1 and self.on_decode is not None:
            self.on_decode(len(self.steps) - 1)
        if not engine.has_unfinished() and self._facts is not None:
            self.facts = self._facts(engine)

    def slowest(self, what: str = "seconds") -> list[float]:
        """Each step's time (``what``: "seconds" or "forward") on the slowest rank (every rank ran the same
        steps)."""
        mine = torch.tensor([getattr(s, what) for s in self.steps], dtype=torch.float64)
        return self.group.all_gather(mine).view(self.group.size, -1).amax(0).tolist()

    def rank_median(self, first: int = 1) -> float:
        """The TPOT statistic of the demo's former fixed-batch run: each rank's median step time over
        steps ``first..``, the largest over the ranks (beside :meth:`slowest`'s per-step maximum, whose
        median is never below it)."""
        mine = [s.seconds for s in self.steps[first:]]
        med = torch.tensor([statistics.median(mine) if mine else float("nan")], dtype=torch.float64)
        return max(self.group.all_gather(med).tolist())


def scheduler_config(lens: list[int], new_tokens: int) -> SchedulerConfig:
    """A budget that prefills every prompt in step 0 (no chunks, no prefix cache: each run starts cold)."""
    return SchedulerConfig(max_num_batched_tokens=sum(lens) + new_tokens * len(lens), max_num_seqs=len(lens),
                           enable_chunked_prefill=False, enable_prefix_caching=False,
                           max_model_len=max(lens) + new_tokens)


def loop_rank(group: Group, spec: Spec) -> dict:
    """The parallel run on one rank of ``group`` (``spec.world_size`` ranks: DCP over all of them, or with
    ``--dcp 1`` under PCP over the first one only) through :func:`run_rank`; every rank returns the full result."""
    torch.manual_seed(spec.seed)
    family, cfg, params = load_model(spec)
    tokens, cu = prompts(spec, cfg.vocab_size)
    batch = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    lens, n_new, nreq = spec.prompt_lens, spec.max_new_tokens, spec.batch
    steps = n_new - 1
    n_runs = 1 if spec.graph_mode == "none" else 1 + spec.eager_row
    bar = Progress(4 + steps * n_runs, enabled=spec.progress and group.rank == 0)
    backend = graph_backend(spec, family)
    span = spec.block_size * spec.dcp  # DCP over the first spec.dcp ranks (all of them unless --dcp 1 under PCP)
    num_blocks = sum(-(-(n + n_new) // span) for n in lens)  # the batch's blocks per rank (the runner adds a spare)

    def run(prompts_, max_tokens: int, graph: bool, **hooks) -> tuple[Timer, dict]:
        timer = Timer(group, len(prompts_), **hooks)
        arrivals = [Arrival(p, SamplingParams(max_tokens=max_tokens)) for p in prompts_]
        graph_opts = dict(graph_mode="FULL_DECODE_ONLY", graph_backend=backend, capture_sizes=sizes) if graph else {}
        with warnings.catch_warnings():  # one engine with PCP and DCP: the report says vLLM-Ascend splits it
            warnings.simplefilter("ignore", GuideCompatWarning)
            outs = run_rank(group, family, params, cfg, arrivals, pcp_size=spec.pcp, dcp_size=spec.dcp,
                            block_size=spec.block_size,
                            interleave_size=spec.interleave, scheduler=scheduler_config(lens, n_new),
                            num_blocks=num_blocks, seed=spec.seed, merge=spec.merge, on_step=timer.after,
                            before_step=timer.before, **graph_opts)
        return timer, outs

    def facts(graph: bool):
        def read(engine) -> dict:
            runner = engine.runners[0]
            out = {"kv_bytes": kv_bytes(runner), "engine_stats": dataclasses.asdict(engine.stats)}
            if graph and runner.graph is not None:
                g = runner.graph
                out.update(stats=g.stats.as_dict(), backend=g.backend.name,
                           bytes_per_step=_step_bytes(g, pick_size(g.sizes, nreq) or nreq, group))
            return out
        return read

    sizes = spec.capture_sizes or (pick_size(capture_sizes(4096), nreq),)  # the bucket holding the batch
    run([list(range(4 * group.size))], 2, False)  # warm-up: kernels and gloo links (untimed)
    ttft, prefill_sent = [], 0
    for _ in range(spec.reps):  # a fresh engine and request set each: step 0 prefills the batch cold
        timer, _ = run(batch, 1, False)
        ttft.append(timer.slowest()[0])
        prefill_sent = timer.steps[0].sent
    bar.step(f"prefill (PCP={spec.pcp}), {spec.reps} fresh runs")
    bar.step("KV rows written to their DCP owners in the prefill step")

    def on_decode(label):
        return lambda s: bar.step(f"{label} decode step {s}/{steps}")

    def decoded(timer: Timer, outs: dict) -> dict:
        times = timer.slowest()
        if any(s.prefill for s in timer.steps[1:]):
            raise RuntimeError("cpattn demo: a decode step of the batch held a prefill row")
        dec, forward = times[1:], timer.slowest("forward")[1:]
        if timer.facts["engine_stats"]["preemptions"]:
            raise RuntimeError(f"cpattn demo: the batch was preempted ({num_blocks} KV blocks per rank); a demo bug")
        return {"tokens": torch.tensor([list(outs[i].token_ids[1:]) for i in range(nreq)], dtype=torch.int64),
                "first": torch.tensor([outs[i].token_ids[0] for i in range(nreq)], dtype=torch.int64),
                "tpot_s": statistics.median(dec) if dec else float("nan"), "step_s": dec, "ttft_s": times[0],
                "tpot_rank_median_s": timer.rank_median(),
                "tpot_spread_ms": spread([1e3 * t for t in dec]).as_dict() if dec else None,
                "forward_spread_ms": spread([1e3 * t for t in forward]).as_dict() if dec else None,
                "replayed_steps": sum(s.replayed for s in timer.steps), **timer.facts}

    runs: dict[str, dict] = {}
    if spec.graph_mode == "full_decode_only":
        if backend != "eager":
            bar.note(f"compiling the decode step for capture sizes {list(sizes)} with torch.compile ({backend}, "
                     "fullgraph): a minute or two on the first run, seconds once inductor's cache is warm")
        timer, outs = run(batch, n_new, True, facts=facts(True), on_decode=on_decode("graph"),
                          on_built=lambda: bar.step(f"captured sizes {list(sizes)} ({backend})"))
        runs["graph"] = {**decoded(timer, outs), "capture_s": timer.built_s}
    else:
        bar.step("no capture (graph mode none)")
    if spec.graph_mode == "none" or spec.eager_row:
        timer, outs = run(batch, n_new, False, facts=facts(False), on_decode=on_decode("eager"))
        run_ = decoded(timer, outs)
        dec_bytes = [s.sent for s in timer.steps[1:]]
        runs["eager"] = {**run_, "bytes_per_step": sum(dec_bytes) // max(len(dec_bytes), 1)}
    first = next(iter(runs.values()))["first"]
    for name, r in runs.items():
        if not torch.equal(r.pop("first"), first):
            raise RuntimeError(f"cpattn demo: the {name} run's first tokens differ from the other run's")

    def per_rank(x: int) -> list[int]:
        return [int(v) for v in group.all_gather(torch.tensor([x], dtype=torch.int64)).tolist()]

    kv = next(iter(runs.values()))["kv_bytes"]
    res = dict(ttft_s=statistics.median(ttft), ttft_samples=ttft, handoff_s=0.0,
               prefill_bytes=per_rank(prefill_sent), handoff_bytes=per_rank(0), first=first, runs=runs,
               kv_bytes_per_rank=per_rank(kv), decode_backend=backend, whole_step_captured=family.capturable,
               model=family.name, config=dataclasses.asdict(cfg), composition="step loop")
    if spec.kv_pool is not None:
        from cpattn.bench.demo_pool import pool_rank

        res["pool"] = pool_rank(group, spec, family, cfg, params, *engine_configs(spec, family, cfg))
    bar.step("done")
    return res
