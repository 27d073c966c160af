"""``cpattn demo``: a long prompt prefilled with PCP, decoded with DCP in graph mode, checked token for token.

The main job end to end, on P real gloo processes (or under ``torchrun``):

1. **Reference.** Rank 0 runs the model on one device (dense KV cache,
   eager), as :func:`cpattn.models.generate.prefill_local` and
   :func:`~cpattn.models.generate.decode_dense` do: the greedy tokens every
   parallel run must reproduce, and the single-device TTFT / TPOT.
2. **Prefill engine (PCP).** Every prompt is split head-tail over the ranks
   (:func:`cpattn.pcp_plan`), each rank runs the whole model on its tokens
   with :func:`cpattn.pcp_prefill` attention; the first token comes from the
   last prompt row of each request. TTFT is this phase.
3. **KV handoff (P/D).** ``cp_kv_cache_interleave_size == block_size``, so
   every cache block of B consecutive tokens belongs to one decode rank
   (block k -> rank k % N). The prompt KV is all-gathered and each decode
   rank keeps its own whole blocks (``fill_from_prefill``).
4. **Decode engine (DCP, FULL_DECODE_ONLY).** One decode step of the whole
   model (embedding, every layer with ``write_kv`` + :func:`cpattn.dcp.dcp_decode`,
   lm_head, argmax) is a pure ``step(state, batch)``; a
   :class:`cpattn.graphs.DecodeRunner` captures it per capture size with
   the chosen backend ("cpu" = torch.compile inductor, fullgraph) and replays
   it for every uniform decode batch. The DCP metadata (positions, local
   lengths, slot mappings) is computed inside the step from the persistent
   ``seq_lens`` / ``block_table`` buffers by :func:`cpattn.dcp.plan_tensors`.
   The same step also runs eagerly on a second cache, side by side.

Two engine configs are validated with :class:`cpattn.config.ParallelConfig`:
a prefill engine (``pcp_size=P``, ``kv_role="kv_producer"``) and a decode
engine (``tp_size=dcp_size=N``, ``pcp_size=1``, ``kv_role="kv_consumer"``),
since the guide forbids PCP and DCP in one engine. Both share the ranks.

Exit status 0 only when every parallel run's tokens equal the reference's.
DeepSeek-V3 / V3.2 checkpoints (``--model``) run too, but their decode step
has data-dependent MoE routing (and DSA key gathering) that no graph can
hold: in graph mode they go through the runner with the "eager" backend
(persistent buffers, padding, no compiler), and the output says so.

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
from types import ModuleType
from typing import Any

import torch

from cpattn.bench.common import DTYPES, Progress, table, write_json
from cpattn.comm.group import Group
from cpattn.comm.sim import SimMesh
from cpattn.config import EngineConfig as ParallelConfig
from cpattn.dcp import DCPMeta, plan_tensors
from cpattn.dsa import dsa_cp_plan, dsa_cp_shard
from cpattn.graphs import DecodeRunner, Field, capture_sizes, pick_size
from cpattn.layout.pcp import pcp_plan, pcp_shard
from cpattn.models import family, load_checkpoint
from cpattn.models.cache import DenseKVCache, DSACPStep, PCPStep
from cpattn.models.dcp_cache import DCPStep, PagedShard, fill_from_prefill
from cpattn.models.generate import gather_unshard, prefill_local, uses_dsa

# the embedded default: a tiny Qwen3 (GQA 4:1 with q/k norm), random weights, nothing downloaded.
# One KV head: on 2 ranks (tp = dcp = 2) the guide's GQA rule (tp // kv_heads) % dcp == 0 holds.
EMBEDDED = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=32)
EMBEDDED_STD = 0.2  # weights ~ N(0, 0.2): clear logit margins, so greedy tokens are not near-ties
CONFIG_CLASSES = {"qwen3": "Qwen3Config", "deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config"}
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


# -- model and inputs ------------------------------------------------------------------------


def load_model(spec: Spec) -> tuple[ModuleType, Any, dict[str, torch.Tensor]]:
    """(model module, config, params): the embedded tiny Qwen3, or a local Hugging Face checkpoint."""
    dtype = DTYPES[spec.dtype]
    if spec.model_dir is None:
        from cpattn.models import qwen3

        cfg = qwen3.Qwen3Config(**EMBEDDED)
        return qwen3, cfg, qwen3.init_params(cfg, seed=spec.seed, std=EMBEDDED_STD, dtype=dtype)
    config, params = load_checkpoint(spec.model_dir, dtype=dtype)
    module = family(config)
    cfg = getattr(module, CONFIG_CLASSES[config["model_type"]]).from_hf(config)
    return module, cfg, params


def prompts(spec: Spec, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Seeded random prompts, packed: tokens [T] int64 and cu_seqlens [B+1] (host ints)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    lens = spec.prompt_lens
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.randint(0, vocab, (cu[-1],), generator=g), cu


def engine_configs(spec: Spec, cfg: Any) -> tuple[ParallelConfig, ParallelConfig, str]:
    """The prefill (kv_producer) and decode (kv_consumer) engines of the P/D pair, validated.

    Raises ValueError (every broken rule of the guide) for a layout the guide forbids.
    Returns (prefill config, decode config, a note on how the GQA rule was checked).
    """
    kind = "dsa" if uses_dsa(cfg) else ("mla" if cfg.kv_dims[3] else "gqa")
    common = dict(attention=kind, block_size=spec.block_size, cp_kv_cache_interleave_size=spec.block_size,
                  kv_transfer="pd")
    graph = "FULL_DECODE_ONLY" if spec.graph_mode == "full_decode_only" else "NONE"
    prefill = ParallelConfig.create(tp_size=1, pcp_size=spec.pcp, kv_role="kv_producer", graph_mode=graph, **common)
    kv_heads = cfg.kv_dims[0] if kind == "gqa" else None
    note = ""
    try:
        decode = ParallelConfig.create(tp_size=spec.dcp, dcp_size=spec.dcp, num_kv_heads=kv_heads, kv_role="kv_consumer",
                                graph_mode=graph, **common)
    except ValueError:
        if kind != "gqa" or kv_heads == 1:
            raise
        # cpattn.models keeps every KV head on every rank (KV heads replicated over TP, as when
        # tp > num_kv_heads), so the ranks of the DCP group do hold the same KV heads.
        decode = ParallelConfig.create(tp_size=spec.dcp, dcp_size=spec.dcp, num_kv_heads=1, kv_role="kv_consumer",
                                graph_mode=graph, **common)
        note = (f"the model's {kv_heads} KV heads are replicated on every rank (not split by TP), so the GQA rule "
                f"is checked with one KV-head group")
    return prefill, decode, note


# -- the captured decode step ------------------------------------------------------------------


def decode_fields(max_blocks: int) -> dict[str, Field]:
    """Per-step inputs of :func:`decode_step`: tokens [T], seq_lens [B], block_table [B, max_blocks].

    Padding: token 0, seq_len 0 (the row sees no key and writes no KV), block 0 (never read).
    """
    return {
        "tokens": Field("token", (), torch.int64, pad=0),
        "seq_lens": Field("request", (), torch.int64, pad=0),
        "block_table": Field("request", (max_blocks,), torch.int64, pad=0),
    }


def decode_step(state: dict, batch: dict[str, torch.Tensor], *, model: ModuleType, cfg: Any, group: Group,
                block_size: int, interleave_size: int, merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy decode step of the whole model with DCP attention; capturable (no host sync).

    state: ``{"params": dict, "shard": PagedShard}`` (the cache is written in place);
    batch: ``tokens`` [T], ``seq_lens`` [B] (after this step), ``block_table``
    [B, max_blocks], ``cu_seqlens_q`` [B+1] (from the runner).
    Returns (next tokens [T] int64, logits [T, V] float32).
    """
    tokens, cu = batch["tokens"], batch["cu_seqlens_q"]
    query_lens = cu[1:] - cu[:-1]  # [B]
    tensors = plan_tensors(batch["seq_lens"], query_lens, batch["block_table"], num_tokens=tokens.shape[0],
                           dcp_size=group.size, interleave_size=interleave_size, block_size=block_size)
    meta = DCPMeta(dcp_size=group.size, interleave_size=interleave_size, block_size=block_size,
                   block_table=batch["block_table"], seq_lens=batch["seq_lens"], query_lens=query_lens, **tensors)
    logits = model.forward(state["params"], cfg, tokens, DCPStep(group, state["shard"], meta, merge)).float()  # [T, V]
    return logits.argmax(-1), logits


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


def reference(module, params, cfg, tokens: torch.Tensor, cu: list[int], new_tokens: int, reps: int = 1) -> dict:
    """Single-device greedy run (dense cache, eager), the run every parallel one must reproduce.

    tokens: [T] packed prompts, requests by ``cu`` [B+1]. Returns tokens [B, N],
    logits [B, N, V], TTFT (median of ``reps`` prefills), TPOT (median step), KV bytes.
    """

    def prefill():
        pre = prefill_local(module, params, cfg, tokens, cu)
        first_logits = pre.logits[torch.tensor(cu[1:]) - 1]  # [B, V]
        return pre, first_logits, first_logits.argmax(-1)

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pre, first_logits, first = prefill()
        times.append(time.perf_counter() - t0)
    ttft = statistics.median(times)
    toks, logits, times = _dense_decode(module, params, cfg, pre, first, new_tokens - 1)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    kv = module.empty_cache(cfg, batch=len(lens), max_len=max(lens) + new_tokens - 1,
                            dtype=pre.k[0].dtype).kv_bytes()
    all_logits = torch.cat([first_logits[:, None], logits], 1) if logits.numel() else first_logits[:, None]
    return {"tokens": torch.cat([first[:, None], toks], 1), "logits": all_logits, "ttft_s": ttft,
            "tpot_s": statistics.median(times) if times else float("nan"), "kv_bytes": kv}


def _dense_decode(module, params, cfg, pre, first: torch.Tensor, steps: int):
    """:func:`cpattn.models.generate.decode_dense`, timed per step.

    first: [B]. Returns (tokens [B, steps], logits [B, steps, V], seconds of each step).
    """
    cu = pre.cu_seqlens.tolist()
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    cache = DenseKVCache.from_packed(pre.k, pre.v, cu, max_len=longest + steps, dv=cfg.kv_dims[2], ik=pre.ik)
    tok, toks, logits, times = first, [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = cache.step([1] * tok.numel())
        out = module.forward(params, cfg, tok, step).float()  # [B, V]
        cache = step.finish()
        tok = out.argmax(-1)
        times.append(time.perf_counter() - t0)
        toks.append(tok)
        logits.append(out)
    if not toks:
        return torch.zeros(first.numel(), 0, dtype=torch.int64), torch.zeros(first.numel(), 0, 0), times
    return torch.stack(toks, 1), torch.stack(logits, 1), times


def prefill_pcp(group: Group, module, params, cfg, tokens: torch.Tensor, cu: list[int]):
    """This rank's share of a PCP prefill (DSA models: DSA-CP with the head-tail split).

    Returns (first tokens [B], first logits [B, V] float32, step with ``kv[l]``, plan).
    """
    b = len(cu) - 1
    if uses_dsa(cfg):
        plan = dsa_cp_plan(cu, group.size, split="balanced")
        step = DSACPStep(group, plan, cfg.kv_dims[2])
        mine = dsa_cp_shard(tokens, plan, group.rank)
    else:
        plan = pcp_plan(cu, group.size)
        step = PCPStep(group, plan, cfg.kv_dims[2])
        mine = pcp_shard(tokens, plan, group.rank)
    idx = plan.token_index[group.rank]  # [T_r] packed ids of my tokens
    last = torch.tensor(cu[1:]) - 1  # [B] each request's last prompt token
    hit = idx[:, None] == last[None, :]  # [T_r, B]
    rows, reqs = hit.nonzero(as_tuple=True)  # my rows that end a request, and which request
    logits = module.forward(params, cfg, mine, step, logits_index=rows).float()  # [n, V]
    full = torch.zeros(b, logits.shape[-1], dtype=torch.float32).index_copy(0, reqs, logits)  # [B, V]
    full = group.all_reduce(full)  # each request's row comes from exactly one rank
    return full.argmax(-1), full, step, plan


def handoff(group: Group, cfg: Any, step, plan, shard: PagedShard, dcp_rank: int, dcp_size: int, cu: list[int]):
    """Move the prefill KV into this decode rank's shard: all-gather in request order, keep owned blocks."""
    n = cfg.num_hidden_layers
    k, v, ik = ([gather_unshard(group, step.kv[l][j], plan) if step.kv[l][j] is not None else None
                 for l in range(n)] for j in range(3))
    fill_from_prefill(shard, dcp_rank, dcp_size, k, v, cu, None if ik[0] is None else ik)


def _decode_group(group: Group, spec: Spec) -> Group:
    """The DCP group: all ranks when dcp > 1, else a one-rank group of this process."""
    return group if spec.dcp > 1 else SimMesh(1).groups()[0]


def _decode_loop(run_step, first: torch.Tensor, prompt_lens: list[int], block_table: torch.Tensor, steps: int,
                 bar: Progress | None, label: str) -> tuple[torch.Tensor, list[float]]:
    """``steps`` greedy steps through ``run_step(batch, query_lens)``.

    Returns (tokens [B, steps], wall seconds of each step on this rank). Every
    step ends in collectives, so the ranks move in lockstep.
    """
    tok, lens, out, times = first, list(prompt_lens), [], []
    b = len(lens)
    for s in range(steps):
        t0 = time.perf_counter()
        lens = [m + 1 for m in lens]
        batch = {"tokens": tok, "seq_lens": torch.tensor(lens), "block_table": block_table}
        tok, _ = run_step(batch, [1] * b)
        times.append(time.perf_counter() - t0)
        out.append(tok)
        if bar is not None:
            bar.step(f"{label} decode step {s + 1}/{steps}")
    return (torch.stack(out, 1) if out else torch.zeros(b, 0, dtype=torch.int64)), times


def _tpot(group: Group, times: list[float]) -> float:
    """Time per output token: the median step time, the slowest rank's."""
    mine = statistics.median(times) if times else float("nan")
    return max(group.all_gather(torch.tensor([mine], dtype=torch.float64)).tolist())


def _step_bytes(step_fn, state, fields: dict[str, Field], size: int, q_len: int, dgroup: Group) -> int:
    """Bytes one decode step of ``size`` tokens sends per rank: an all-padding step (no KV write), counted eagerly."""
    batch = {name: torch.full((size if f.rows == "token" else size // q_len, *f.shape), f.pad, dtype=f.dtype)
             for name, f in fields.items()}
    batch["cu_seqlens_q"] = torch.zeros(size // q_len + 1, dtype=torch.int32)
    dgroup.stats.reset()
    step_fn(state, batch)
    return dgroup.stats.total_sent()


def demo_rank(group: Group, spec: Spec) -> dict:
    """The whole demo on one rank of ``group`` (``spec.world_size`` ranks); every rank returns the full result."""
    torch.manual_seed(spec.seed)
    module, cfg, params = load_model(spec)
    tokens, cu = prompts(spec, cfg.vocab_size)
    plens, steps, nreq = spec.prompt_lens, spec.max_new_tokens - 1, spec.batch
    rank0 = group.rank == 0
    n_runs = 1 if spec.graph_mode == "none" else 1 + spec.eager_row
    n_bar = 5 + steps * n_runs
    bar = Progress(n_bar, enabled=spec.progress and rank0)
    res: dict[str, Any] = {}

    # 1. the single-device reference, on rank 0 while the others wait
    if rank0:
        _warm_up_reference(module, params, cfg)
        res["reference"] = reference(module, params, cfg, tokens, cu, spec.max_new_tokens, spec.reps)
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
    pgroup = group if spec.pcp > 1 else SimMesh(1).groups()[0]
    _warm_up_prefill(pgroup, module, params, cfg)
    group.stats.reset()
    times = []
    for _ in range(spec.reps):
        sec, (first, _, pstep, plan) = _timed(group, lambda: prefill_pcp(pgroup, module, params, cfg, tokens, cu))
        times.append(sec)
    ttft = statistics.median(times)
    prefill_bytes = group.stats.total_sent() // spec.reps
    bar.step(f"prefill (PCP={spec.pcp})")

    # 3. KV handoff into the decode engine's paged shards (interleave == block size: whole blocks)
    dgroup = _decode_group(group, spec)
    n, rank = dgroup.size, dgroup.rank
    dtype = DTYPES[spec.dtype]

    def new_shard():
        return PagedShard.empty(cfg, seq_lens=[m + steps for m in plens], dcp_size=n, block_size=spec.block_size,
                                interleave_size=spec.block_size, dtype=dtype)

    shard = new_shard()
    group.stats.reset()
    handoff_s, _ = _timed(group, lambda: handoff(pgroup, cfg, pstep, plan, shard, rank, n, cu))
    handoff_bytes = group.stats.total_sent()
    bar.step("KV handoff")

    # 4. decode engine: DCP, the whole model step captured (FULL_DECODE_ONLY) or eager
    step_fn = _bind_step(module, cfg, dgroup, spec)
    fields = decode_fields(shard.block_table.shape[1])
    graphable = module.__name__.endswith("qwen3")
    backend = spec.backend if graphable else "eager"
    runs: dict[str, dict] = {}
    if spec.graph_mode == "full_decode_only":
        state = {"params": params, "shard": shard}
        sizes = list(spec.capture_sizes or [pick_size(capture_sizes(4096), nreq)])  # the bucket holding the batch
        runner = DecodeRunner(step_fn, state, fields, capture_sizes=sizes, backend=backend)
        _barrier(group)
        t0 = time.perf_counter()
        runner.capture()
        capture_s = time.perf_counter() - t0
        _barrier(group)
        bar.step(f"captured sizes {sizes} ({backend})")
        size = pick_size(runner.sizes, nreq)
        step_bytes = _step_bytes(step_fn, state, fields, size or nreq, 1, dgroup)
        _barrier(group)
        toks, times = _decode_loop(runner, first, plens, shard.block_table, steps, bar, "graph")
        runs["graph"] = {"tokens": toks, "tpot_s": _tpot(group, times), "capture_s": capture_s,
                         "stats": runner.stats.as_dict(), "backend": runner.backend.name,
                         "bytes_per_step": step_bytes, "kv_bytes": shard.kv_bytes()}
    else:
        bar.step("no capture (graph mode none)")
    if spec.graph_mode == "none" or spec.eager_row:
        eshard = shard if spec.graph_mode == "none" else new_shard()
        if eshard is not shard:
            handoff(pgroup, cfg, pstep, plan, eshard, rank, n, cu)
        state = {"params": params, "shard": eshard}

        def eager(batch, query_lens):
            cu_q = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return step_fn(state, {**batch, "cu_seqlens_q": cu_q})

        step_bytes = _step_bytes(step_fn, state, fields, nreq, 1, dgroup)
        _barrier(group)
        toks, times = _decode_loop(eager, first, plens, eshard.block_table, steps, bar, "eager")
        runs["eager"] = {"tokens": toks, "tpot_s": _tpot(group, times), "bytes_per_step": step_bytes,
                         "kv_bytes": eshard.kv_bytes()}

    def per_rank(x: int) -> list[int]:
        return [int(v) for v in group.all_gather(torch.tensor([x], dtype=torch.int64)).tolist()]

    res.update(
        ttft_s=ttft, handoff_s=handoff_s, prefill_bytes=per_rank(prefill_bytes),
        handoff_bytes=per_rank(handoff_bytes),
        first=first, runs=runs, kv_bytes_per_rank=per_rank(shard.kv_bytes()),
        decode_backend=backend, whole_step_captured=graphable, model=module.__name__.rsplit(".", 1)[-1],
        config=dataclasses.asdict(cfg),
    )
    bar.step("done")
    return res


def _bind_step(module, cfg, dgroup, spec):
    """``step(state, batch)`` for the runner: :func:`decode_step` bound to the model and the DCP group."""
    return functools.partial(decode_step, model=module, cfg=cfg, group=dgroup, block_size=spec.block_size,
                             interleave_size=spec.block_size, merge=spec.merge)


def _warm_up_prefill(group: Group, module, params, cfg) -> None:
    """One tiny PCP prefill: kernels, allocator and gloo links warm before TTFT is timed."""
    n = 4 * max(group.size, 1)
    prefill_pcp(group, module, params, cfg, torch.arange(n) % cfg.vocab_size, [0, n])


def _warm_up_reference(module, params, cfg) -> None:
    """One tiny single-device run, so the reference's TTFT does not pay for first-call set-up."""
    reference(module, params, cfg, torch.arange(8) % cfg.vocab_size, [0, 8], 3)


# -- checking, reporting, entry points ----------------------------------------------------------


def summarize(res: dict, spec: Spec, engines: tuple[ParallelConfig, ParallelConfig, str]) -> dict:
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
        "engines": {"prefill": dataclasses.asdict(engines[0]), "decode": dataclasses.asdict(engines[1]),
                    "note": engines[2]},
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
    if s["engines"]["note"]:
        lines.append(f"  note: {s['engines']['note']}")
    g = s.get("graph")
    if g:
        if s["whole_step_captured"]:
            what = "the whole decode step (embedding, every layer's write_kv + dcp_decode, lm_head, argmax) captured"
        elif s["model"] != "qwen3":
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
    lines.append(f"KV handoff (all-gather, keep own blocks): {s['handoff_ms']:.1f} ms")
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


def _check_model(spec: Spec) -> tuple[ParallelConfig, ParallelConfig, str]:
    """Validate the layout on the host before any rank starts (config only, no weights)."""
    if spec.model_dir is None:
        from cpattn.models import qwen3

        cfg = qwen3.Qwen3Config(**EMBEDDED)
    else:
        from cpattn.models.common import config_dict

        d = config_dict(spec.model_dir)
        cfg = getattr(family(d), CONFIG_CLASSES[d["model_type"]]).from_hf(d)
    if spec.dcp > 1 and not uses_dsa(cfg) and cfg.num_attention_heads % spec.dcp:
        raise ValueError(f"--dcp {spec.dcp} must divide the model's {cfg.num_attention_heads} attention heads "
                         "(DCP reuses TP ranks, each holding a slice of the heads)")
    return engine_configs(spec, cfg)


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
