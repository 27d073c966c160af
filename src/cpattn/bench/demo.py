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
    torchrun --nproc-per-node 2 -m cpattn.bench.demo --torchrun
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.bench.common import DTYPES, Progress, table, write_json
from cpattn.comm.group import Group
from cpattn.config import EngineConfig
from cpattn.engine import driver
from cpattn.engine.batch import Prompts
from cpattn.engine.decode import decode_step, step_fields
from cpattn.engine.family import ModelFamily, get_family
from cpattn.engine.options import Algorithms
from cpattn.engine.reference import reference_generate
from cpattn.graphs import capture_sizes, pick_size
from cpattn.models import load_checkpoint
from cpattn.models.common import config_dict

# the embedded default: a tiny Qwen3 (GQA 4:1 with q/k norm), random weights, nothing downloaded.
EMBEDDED = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=32)
EMBEDDED_STD = 0.2  # weights ~ N(0, 0.2): clear logit margins, so greedy tokens are not near-ties
GRAPH_MODES = ("none", "full_decode_only")


@dataclass(frozen=True)
class Spec:
    """Everything a rank needs (picklable): model, layout, sizes, graph settings."""

    model_dir: str | None = None
    pcp: int = 2
    dcp: int = 2
    prompt_len: int = 4096
    batch: int = 1
    max_new_tokens: int = 32
    graph_mode: str = "full_decode_only"
    backend: str = "cpu"
    block_size: int = 16
    merge: str = "ag_rs"
    dtype: str = "float32"
    seed: int = 0
    capture_sizes: tuple[int, ...] | None = None
    eager_row: bool = True
    progress: bool = True
    perturb_reference: bool = False
    reps: int = 3

    @property
    def world_size(self) -> int:
        return max(self.pcp, self.dcp)

    @property
    def prompt_lens(self) -> list[int]:
        """Request b has ``prompt_len - b * prompt_len // (2 * batch)`` tokens (uneven on purpose)."""
        return [self.prompt_len - (b * self.prompt_len) // (2 * self.batch) for b in range(self.batch)]


# -- model, inputs, engines -------------------------------------------------------------------


def model_config(spec: Spec) -> tuple[ModelFamily, Any]:
    """(family, config) of the run, from the checkpoint's config.json alone (no weights read)."""
    if spec.model_dir is None:
        from cpattn.models import qwen3

        return qwen3.FAMILY, qwen3.Qwen3Config(**EMBEDDED)
    d = config_dict(spec.model_dir)
    family = get_family(d)
    return family, family.config_class.from_hf(d)


def load_model(spec: Spec) -> tuple[ModelFamily, Any, dict[str, torch.Tensor]]:
    """(family, config, params): the embedded tiny Qwen3, or a local Hugging Face checkpoint."""
    dtype = DTYPES[spec.dtype]
    family, cfg = model_config(spec)
    if spec.model_dir is None:
        return family, cfg, family.init_params(cfg, seed=spec.seed, std=EMBEDDED_STD, dtype=dtype)
    _, params = load_checkpoint(spec.model_dir, dtype=dtype)
    return family, cfg, params


def prompts(spec: Spec, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Seeded random prompts, packed: tokens [T] int64 and cu_seqlens [B+1] (host ints)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    lens = spec.prompt_lens
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.randint(0, vocab, (cu[-1],), generator=g), cu


def graph_backend(spec: Spec, family: ModelFamily) -> str:
    """The decode runner's backend: the requested compiler for a capturable family, else "eager"."""
    return spec.backend if family.capturable else "eager"


def engine_configs(spec: Spec, family: ModelFamily, cfg: Any) -> tuple[EngineConfig, EngineConfig]:
    """The prefill (kv_producer, PCP) and decode (kv_consumer, DCP) engines of the P/D pair, validated.

    Interleave = block size, so whole blocks are handed over (the guide's rule
    for KV transfer). Raises :class:`~cpattn.config.ConfigError` listing every
    broken rule for a layout the guide (or the engine) cannot run.
    """
    graph = "FULL_DECODE_ONLY" if spec.graph_mode == "full_decode_only" else "NONE"
    pre, dec = driver.engine_configs(family, cfg, pcp_size=spec.pcp, dcp_size=spec.dcp, block_size=spec.block_size,
                                     interleave_size=spec.block_size, pd=True, graph_mode=graph,
                                     capture_sizes=spec.capture_sizes, graph_backend=graph_backend(spec, family))
    driver.checks.check(family, cfg, pre, dec, world_size=spec.world_size, topology="colocated")
    return pre, dec


def flat(config: EngineConfig) -> dict:
    """An engine config as one flat dict of its fields (the flat names of ``EngineConfig.create``)."""
    return {k: v for part in dataclasses.asdict(config).values() for k, v in part.items()}


# -- phases on one rank --------------------------------------------------------------------------


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


def reference(family, params, cfg, tokens: torch.Tensor, cu: list[int], new_tokens: int, reps: int = 1) -> dict:
    """The single-device greedy run (:func:`cpattn.engine.reference.reference_generate`) every parallel run
    must reproduce: tokens [B, N], logits [B, N, V], TTFT (median of ``reps`` prefills), TPOT (median step),
    KV bytes."""
    ps = [tokens[a:b] for a, b in zip(cu, cu[1:])]
    ttft = statistics.median(reference_generate(family, params, cfg, ps, 1).prefill_s for _ in range(reps))
    ref = reference_generate(family, params, cfg, ps, new_tokens)
    return {"tokens": ref.tokens, "logits": ref.logits, "ttft_s": ttft,
            "tpot_s": statistics.median(ref.step_s) if ref.step_s else float("nan"), "kv_bytes": ref.kv_bytes}


def _tpot(group: Group, times) -> float:
    """Time per output token: the median step time, the slowest rank's."""
    mine = statistics.median(times) if times else float("nan")
    return max(group.all_gather(torch.tensor([mine], dtype=torch.float64)).tolist())


def _step_bytes(step_fn, state, size: int, dgroup: Group) -> int:
    """Bytes one decode step of ``size`` tokens sends per rank: an all-padding step (no KV write), counted eagerly."""
    fields = step_fields(state["shard"].block_table.shape[1])
    batch = {name: torch.full((size, *f.shape), f.pad, dtype=f.dtype) for name, f in fields.items()}
    batch["cu_seqlens_q"] = torch.zeros(size + 1, dtype=torch.int32)
    dgroup.stats.reset()
    step_fn(state, batch)
    return dgroup.stats.total_sent()


def demo_rank(group: Group, spec: Spec) -> dict:
    """The whole demo on one rank of ``group`` (``spec.world_size`` ranks); every rank returns the full result."""
    torch.manual_seed(spec.seed)
    family, cfg, params = load_model(spec)
    pre_cfg, dec_cfg = engine_configs(spec, family, cfg)
    tokens, cu = prompts(spec, cfg.vocab_size)
    batch = Prompts(tokens, tuple(spec.prompt_lens))
    steps, nreq = spec.max_new_tokens - 1, spec.batch
    algorithms = Algorithms(dcp_merge=spec.merge)
    rank0 = group.rank == 0
    n_runs = 1 if spec.graph_mode == "none" else 1 + spec.eager_row
    bar = Progress(5 + steps * n_runs, enabled=spec.progress and rank0)
    res: dict[str, Any] = {}

    # 1. the single-device reference, on rank 0 while the others wait
    if rank0:
        reference(family, params, cfg, torch.arange(8) % cfg.vocab_size, [0, 8], 2, 3)  # warm-up
        res["reference"] = reference(family, params, cfg, tokens, cu, spec.max_new_tokens, spec.reps)
        ref_tokens = res["reference"]["tokens"]
        nums = torch.tensor([res["reference"][k] for k in ("ttft_s", "tpot_s", "kv_bytes")], dtype=torch.float64)
    else:
        ref_tokens = torch.zeros(nreq, spec.max_new_tokens, dtype=torch.int64)
        nums = torch.zeros(3, dtype=torch.float64)
    res["reference_tokens"] = group.all_reduce(ref_tokens)  # every rank can check the tokens
    ttft_1, tpot_1, kv_1 = group.all_reduce(nums).tolist()
    res.setdefault("reference", {}).update(ttft_s=ttft_1, tpot_s=tpot_1, kv_bytes=int(kv_1))
    bar.step("single-device reference")

    # 2. prefill engine: PCP over the ranks (or each rank alone)
    pg, dg = driver.stage_group(group, spec.pcp), driver.stage_group(group, spec.dcp)
    warm = Prompts.of([list(range(4 * max(pg.size, 1)))])
    driver.prefill_fn(pg, family, params, cfg, warm, algorithms, False)  # kernels and gloo links warm
    group.stats.reset()
    times = []
    for _ in range(spec.reps):
        sec, out = _timed(group, lambda: driver.prefill_fn(pg, family, params, cfg, batch, algorithms, False))
        times.append(sec)
    ttft = statistics.median(times)
    prefill_bytes = group.stats.total_sent() // spec.reps
    first = out.first_logits.argmax(-1)
    bar.step(f"prefill (PCP={spec.pcp})")

    # 3. KV handoff into the decode engine's paged shards (interleave == block size: whole blocks)
    def new_shard():
        return driver.new_shard(family, cfg, params, batch, steps, dec_cfg, None)

    shard = new_shard()
    group.stats.reset()
    handoff_s, _ = _timed(group, lambda: driver.handoff(group, pg, dg, shard, out, algorithms))
    handoff_bytes = group.stats.total_sent()
    bar.step("KV handoff")

    # 4. decode engine: DCP, the whole model step captured (FULL_DECODE_ONLY) or eager
    step_fn = functools.partial(decode_step, family=family, cfg=cfg, group=dg, merge=spec.merge)
    backend = graph_backend(spec, family)
    runs: dict[str, dict] = {}

    def on_step(label):
        return lambda s: bar.step(f"{label} decode step {s}/{steps}")

    if spec.graph_mode == "full_decode_only":
        sizes = spec.capture_sizes or (pick_size(capture_sizes(4096), nreq),)  # the bucket holding the batch
        gcfg = dec_cfg.replace(capture_sizes=tuple(sizes))
        _barrier(group)
        t0 = time.perf_counter()
        runner = driver.capture(dg, family, params, cfg, shard, batch, gcfg, algorithms, None)
        capture_s = time.perf_counter() - t0
        _barrier(group)
        bar.step(f"captured sizes {list(sizes)} ({backend})")
        step_bytes = _step_bytes(step_fn, runner.state, pick_size(runner.sizes, nreq) or nreq, dg)
        _barrier(group)
        dec = driver.run_decode(dg, family, params, cfg, shard, batch, first, steps, gcfg, algorithms, None,
                                on_step("graph"), runner=runner)
        runs["graph"] = {"tokens": dec.tokens, "tpot_s": _tpot(group, dec.step_s), "capture_s": capture_s,
                         "stats": dec.runner, "backend": runner.backend.name, "bytes_per_step": step_bytes,
                         "kv_bytes": shard.kv_bytes()}
    else:
        bar.step("no capture (graph mode none)")
    if spec.graph_mode == "none" or spec.eager_row:
        eshard = shard if spec.graph_mode == "none" else new_shard()
        if eshard is not shard:
            driver.handoff(group, pg, dg, eshard, out, algorithms)
        ecfg = dec_cfg.replace(graph_mode="NONE")
        step_bytes = _step_bytes(step_fn, {"params": params, "shard": eshard}, nreq, dg)
        _barrier(group)
        dec = driver.run_decode(dg, family, params, cfg, eshard, batch, first, steps, ecfg, algorithms, None,
                                on_step("eager"))
        runs["eager"] = {"tokens": dec.tokens, "tpot_s": _tpot(group, dec.step_s), "bytes_per_step": step_bytes,
                         "kv_bytes": eshard.kv_bytes()}

    def per_rank(x: int) -> list[int]:
        return [int(v) for v in group.all_gather(torch.tensor([x], dtype=torch.int64)).tolist()]

    res.update(
        ttft_s=ttft, handoff_s=handoff_s, prefill_bytes=per_rank(prefill_bytes),
        handoff_bytes=per_rank(handoff_bytes),
        first=first, runs=runs, kv_bytes_per_rank=per_rank(shard.kv_bytes()),
        decode_backend=backend, whole_step_captured=family.capturable, model=family.name,
        config=dataclasses.asdict(cfg),
    )
    bar.step("done")
    return res


# -- checking, reporting, entry points ----------------------------------------------------------


def summarize(res: dict, spec: Spec, engines: tuple[EngineConfig, EngineConfig]) -> dict:
    """Check every run's tokens against the reference and gather the numbers into one JSON-able dict."""
    ref_tokens = res["reference_tokens"].clone()  # [B, N]
    if spec.perturb_reference:  # testing aid: a reference that cannot match
        ref_tokens[0, -1] = (ref_tokens[0, -1] + 1) % res["config"]["vocab_size"]
    ref = res.get("reference", {})
    par = f"PCP={spec.pcp} -> DCP={spec.dcp}"
    rows = [{"run": "1 device, eager (reference)", "ranks": 1, "TTFT_ms": 1e3 * ref["ttft_s"],
             "TPOT_ms": 1e3 * ref["tpot_s"], "KV_bytes_per_rank": ref["kv_bytes"], "prefill_sent": 0,
             "handoff_sent": 0, "decode_sent_per_step": 0, "TTFT_x": 1.0, "TPOT_x": 1.0, "tokens": "reference"}]
    checks = {}
    steps = spec.max_new_tokens - 1
    for name, run in res["runs"].items():
        toks = torch.cat([res["first"][:, None], run["tokens"]], 1)  # [B, N]
        same = toks == ref_tokens
        checks[name] = {"match": bool(same.all()), "equal_tokens": int(same.sum()), "total_tokens": same.numel(),
                        "first_mismatch": _first_mismatch(same, ref)}
        tpot = run["tpot_s"]
        label = f"{par}, graph ({run['backend']})" if name == "graph" else f"{par}, eager"
        rows.append({"run": label, "ranks": spec.world_size, "TTFT_ms": 1e3 * res["ttft_s"], "TPOT_ms": 1e3 * tpot,
                     "KV_bytes_per_rank": max(res["kv_bytes_per_rank"]), "prefill_sent": max(res["prefill_bytes"]),
                     "handoff_sent": max(res["handoff_bytes"]), "decode_sent_per_step": run["bytes_per_step"],
                     "TTFT_x": ref["ttft_s"] / res["ttft_s"], "TPOT_x": ref["tpot_s"] / tpot if steps else float("nan"),
                     "tokens": f"{checks[name]['equal_tokens']}/{checks[name]['total_tokens']} equal"})
    graph = res["runs"].get("graph")
    out = {
        "spec": dataclasses.asdict(spec), "model": res["model"], "config": res["config"],
        "engines": {"prefill": flat(engines[0]), "decode": flat(engines[1])},
        "prompt_lens": spec.prompt_lens, "rows": rows, "checks": checks,
        "tokens_match": all(c["match"] for c in checks.values()),
        "reference_tokens": ref_tokens.tolist(),
        "tokens": {name: torch.cat([res["first"][:, None], r["tokens"]], 1).tolist()
                   for name, r in res["runs"].items()},
        "handoff_ms": 1e3 * res["handoff_s"], "decode_backend": res["decode_backend"],
        "whole_step_captured": res["whole_step_captured"] and graph is not None and res["decode_backend"] != "eager",
        "torch": torch.__version__, "machine": platform.machine(),
    }
    if graph is not None:
        st = graph["stats"]
        out["graph"] = {"backend": graph["backend"], "capture_s": graph["capture_s"], "stats": st,
                        "decode_steps": steps, "all_steps_replayed": st["graph"] == steps and st["eager"] == 0}
    return out


def _first_mismatch(same: torch.Tensor, ref: dict) -> dict | None:
    """Where tokens first differ, with the reference's top-2 logit margin there (a near tie shows up as ~0)."""
    bad = (~same).nonzero()
    if not bad.numel():
        return None
    b, j = (int(x) for x in bad[0])
    out = {"request": b, "token": j}
    if "logits" in ref:
        top2 = ref["logits"][b, j].double().topk(2).values
        out["reference_margin"] = float(top2[0] - top2[1])
    return out


def report(s: dict) -> str:
    """The text the demo prints: what ran, the table, and the verdict."""
    c, spec = s["config"], s["spec"]
    sizes = ", ".join(f"{k}={c[k]}" for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                              "num_key_value_heads", "vocab_size") if k in c)
    src = spec["model_dir"] or "embedded tiny random-init model (seed %d, nothing downloaded)" % spec["seed"]
    lines = [
        f"cpattn demo: {s['model']} ({sizes}), {spec['dtype']}; {src}",
        f"prompts: {s['prompt_lens']} tokens, {spec['max_new_tokens']} new tokens each (greedy); "
        f"{max(spec['pcp'], spec['dcp'])} gloo ranks",
        f"prefill engine: pcp_size={spec['pcp']} (kv_producer); decode engine: tp=dcp={spec['dcp']}, pcp=1 "
        f"(kv_consumer); block_size = interleave = {spec['block_size']} (whole blocks handed over)",
    ]
    g = s.get("graph")
    if g:
        if s["whole_step_captured"]:
            what = "the whole decode step (embedding, every layer's write_kv + dcp_decode, lm_head, argmax) captured"
        elif s["decode_backend"] == "eager" and spec["backend"] != "eager":
            what = ("decode step through DecodeRunner with the 'eager' backend, not compiled: this model's step "
                    "has data-dependent MoE routing / DSA gathers that no graph can hold")
        else:
            what = ("decode step through DecodeRunner with the 'eager' backend "
                    "(persistent buffers, padding, no compiler)")
        st = g["stats"]
        lines.append(f"graph mode FULL_DECODE_ONLY: {what}; backend {g['backend']!r}, capture sizes "
                     f"{sorted(int(k) for k in st['sizes']) or spec['capture_sizes']}, capture {g['capture_s']:.1f} s; "
                     f"decode steps replayed {st['graph']}/{g['decode_steps']}, eager {st['eager']}, "
                     f"padded rows {st['padded_tokens']}")
    else:
        lines.append("graph mode none: decode steps run eagerly")
    lines.append(f"KV handoff (rows to their DCP owners, one all-to-all): {s['handoff_ms']:.1f} ms")
    lines.append("")
    cols = ["run", "ranks", "TTFT_ms", "TPOT_ms", "KV_bytes_per_rank", "prefill_sent", "handoff_sent",
            "decode_sent_per_step", "TTFT_x", "TPOT_x", "tokens"]
    lines.append(table(s["rows"], cols))
    lines.append("(bytes sent per rank; _x = speedup vs the 1-device run, > 1 is faster)")
    runs = {r["run"].split(", ")[-1]: r for r in s["rows"][1:]}
    graph_row = next((r for k, r in runs.items() if k.startswith("graph")), None)
    if graph_row and "eager" in runs:
        lines.append(f"graph replay vs eager decode step: {runs['eager']['TPOT_ms'] / graph_row['TPOT_ms']:.2f}x; "
                     f"KV per rank vs 1 device: {graph_row['KV_bytes_per_rank'] / s['rows'][0]['KV_bytes_per_rank']:.2f}x")
    lines.append("")
    for name, chk in s["checks"].items():
        verdict = "identical" if chk["match"] else f"DIFFERENT, first at {chk['first_mismatch']}"
        lines.append(f"tokens ({name} decode) vs single device: {chk['equal_tokens']}/{chk['total_tokens']} {verdict}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpattn demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="DIR", default=None,
                   help="local Hugging Face checkpoint (config.json + *.safetensors) instead of the embedded model")
    p.add_argument("--pcp", type=int, default=None, help="prefill context-parallel ranks (default 2, torchrun: world)")
    p.add_argument("--dcp", type=int, default=None, help="decode context-parallel ranks (default 2, torchrun: world)")
    p.add_argument("--prompt-len", type=int, default=4096, help="tokens of the longest prompt")
    p.add_argument("--batch", type=int, default=1, help="requests (prompts of uneven lengths)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--graph-mode", choices=GRAPH_MODES, default="full_decode_only")
    p.add_argument("--backend", default="cpu", help="DecodeRunner backend: cpu (inductor), eager, aot_eager, ...")
    p.add_argument("--capture-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="comma-separated capture sizes (default: the one bucket that holds --batch)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size = DCP interleave size")
    p.add_argument("--merge", choices=["ag_rs", "a2a"], default="ag_rs", help="DCP partial merge")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eager-row", action="store_true", help="skip the eager DCP decode run next to the graph one")
    p.add_argument("--reps", type=int, default=3, help="prefills timed per run (TTFT is the median)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--torchrun", action="store_true", help="run as one rank under torchrun (also detected from RANK)")
    p.add_argument("--perturb-reference", action="store_true",
                   help="testing aid: change one reference token, so the check must fail (exit 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _spec(a, world: int | None) -> Spec:
    default = world or 2
    pcp, dcp = a.pcp or default, a.dcp or default
    for name, v in (("--pcp", pcp), ("--dcp", dcp)):
        if v < 1:
            raise SystemExit(f"cpattn demo: {name} must be >= 1; got {v}")
    w = max(pcp, dcp)
    if (pcp not in (1, w)) or (dcp not in (1, w)):
        raise SystemExit(f"cpattn demo: --pcp {pcp} and --dcp {dcp} must each be 1 or the number of ranks "
                         f"(max of the two = {w}): both engines share the same ranks")
    if world is not None and w != world:
        raise SystemExit(f"cpattn demo: --pcp {pcp} / --dcp {dcp} need {w} ranks but torchrun started {world}; "
                         f"use --nproc-per-node {w} or drop --pcp/--dcp")
    if min(a.prompt_len, a.batch, a.max_new_tokens, a.reps, a.block_size) < 1:
        raise SystemExit("cpattn demo: --prompt-len, --batch, --max-new-tokens, --reps and --block-size must be >= 1")
    return Spec(model_dir=a.model, pcp=pcp, dcp=dcp, prompt_len=a.prompt_len, batch=a.batch,
                max_new_tokens=a.max_new_tokens, graph_mode=a.graph_mode, backend=a.backend,
                block_size=a.block_size, merge=a.merge, dtype=a.dtype, seed=a.seed, capture_sizes=a.capture_sizes,
                eager_row=not a.no_eager_row, progress=not a.no_progress,
                perturb_reference=a.perturb_reference, reps=a.reps)


def _check_model(spec: Spec) -> tuple[EngineConfig, EngineConfig]:
    """Validate the layout on the host before any rank starts (config only, no weights)."""
    family, cfg = model_config(spec)
    return engine_configs(spec, family, cfg)


def run_rank(group: Group, spec: Spec, threads: int = 1) -> dict:
    """:func:`demo_rank` with this process's settings (threads, one inductor compile thread)."""
    torch.set_num_threads(threads)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # ranks compile side by side: no worker pool per rank
    return demo_rank(group, spec)


def _finish(res: dict, spec: Spec, engines, json_path: str | None, show: bool) -> int:
    s = summarize(res, spec, engines)
    if show:
        print(report(s))
        write_json(json_path, s)
    return 0 if s["tokens_match"] else 1


def main(argv=None) -> int:
    """``cpattn demo``: the main job. Exit 0 iff every parallel run gives the single-device tokens."""
    a = parser().parse_args(argv)
    under_torchrun = a.torchrun or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)
    if under_torchrun:
        from cpattn.comm import init_from_env

        group = init_from_env("gloo")
        spec = _spec(a, group.size)
        if group.rank != 0:
            spec = dataclasses.replace(spec, progress=False)
        try:
            engines = _check_model(spec)
            res = run_rank(group, spec, a.threads)
            return _finish(res, spec, engines, a.json, show=group.rank == 0)
        finally:
            import torch.distributed as dist

            dist.destroy_process_group()
    from cpattn.comm.launch import spawn

    spec = _spec(a, None)
    try:
        engines = _check_model(spec)
    except ValueError as e:
        print(f"cpattn demo: {e}", file=sys.stderr)
        return 2
    res = spawn(spec.world_size, run_rank, spec, a.threads, threads=a.threads, timeout_s=900)[0]
    return _finish(res, spec, engines, a.json, show=True)


if __name__ == "__main__":
    sys.exit(main())
