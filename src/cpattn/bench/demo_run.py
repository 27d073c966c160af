"""What ``cpattn demo`` runs on each rank, composed from the engine's stages (see :mod:`cpattn.bench.demo`).

:func:`reference` is the one-device run (in the parent process, before any
rank starts); :func:`demo_rank` the parallel run on one rank: PCP prefill
(timed), the KV hand-off into the DCP decode cache, the decode captured
(FULL_DECODE_ONLY) and eager side by side; :func:`pool_rank` the KV-pool
phase (a cold request that stores its blocks, then a warm one sharing its
prefix).

Example
-------
>>> spec = Spec(prompt_len=16, batch=2)
>>> spec.prompt_lens, spec.world_size
([16, 12], 2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.bench.common import DTYPES, Progress
from cpattn.comm.group import Group
from cpattn.config import EngineConfig
from cpattn.engine import checks, decode_stage, driver
from cpattn.engine.batch import Prompts
from cpattn.engine.family import ModelFamily, get_family
from cpattn.engine.options import Algorithms
from cpattn.engine.pooling import PoolSpec
from cpattn.engine.reference import Reference, reference_generate
from cpattn.graphs import capture_sizes, pick_size
from cpattn.models import load_checkpoint
from cpattn.models.common import config_dict

# the embedded default: a tiny Qwen3 (GQA 4:1 with q/k norm), random weights, nothing downloaded.
EMBEDDED_STD = 0.2  # weights ~ N(0, 0.2): clear logit margins, so greedy tokens are not near-ties
POOL_NEW_TOKENS = 4  # greedy tokens of each pool-phase request


@dataclass(frozen=True)
class Spec:
    """Everything a rank needs (picklable): model, layout, sizes, graph and pool settings."""

    model_dir: str | None = None
    model_type: str = "qwen3"
    pcp: int = 2
    dcp: int = 2
    prompt_len: int = 4096
    batch: int = 1
    max_new_tokens: int = 32
    graph_mode: str = "full_decode_only"
    backend: str = "cpu"
    block_size: int = 16
    interleave_size: int | None = None
    merge: str = "local_ag"
    dtype: str = "float32"
    seed: int = 0
    capture_sizes: tuple[int, ...] | None = None
    eager_row: bool = True
    progress: bool = True
    perturb_reference: bool = False
    reps: int = 3
    kv_pool: str | None = None
    pool_rounds: int = 3
    pool_salt: int = 0

    @property
    def world_size(self) -> int:
        return max(self.pcp, self.dcp)

    @property
    def interleave(self) -> int:
        """``cp_kv_cache_interleave_size``: the block size unless set (whole blocks handed over)."""
        return self.block_size if self.interleave_size is None else self.interleave_size

    @property
    def prompt_lens(self) -> list[int]:
        """Request b has ``prompt_len - b * prompt_len // (2 * batch)`` tokens (uneven on purpose)."""
        return [self.prompt_len - (b * self.prompt_len) // (2 * self.batch) for b in range(self.batch)]


# -- model, inputs, engines -------------------------------------------------------------------


def model_config(spec: Spec) -> tuple[ModelFamily, Any]:
    """(family, config) of the run from the checkpoint's config.json alone (no weights read), or the
    family's tiny config for an embedded model. Raises ValueError naming what is wrong with a checkpoint."""
    if spec.model_dir is None:
        family = get_family(spec.model_type)
        return family, family.config_class.tiny()
    import json
    import os

    from cpattn.models import check_checkpoint

    check_checkpoint(spec.model_dir)  # config.json + safetensors headers against the family: no weights read
    path = os.path.join(spec.model_dir, "config.json")
    if not os.path.isdir(spec.model_dir):
        raise ValueError(f"{spec.model_dir!r} is not a directory; pass a Hugging Face checkpoint directory")
    if not os.path.isfile(path):
        raise ValueError(f"{spec.model_dir!r} has no config.json; pass a Hugging Face checkpoint directory")
    if not any(f.endswith(".safetensors") for f in os.listdir(spec.model_dir)):
        raise ValueError(f"{spec.model_dir!r} has no *.safetensors file (only safetensors checkpoints are read)")
    try:
        d = config_dict(spec.model_dir)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    family = get_family(d)
    try:
        cfg = family.config_class.from_hf(d)
    except KeyError as e:
        raise ValueError(f"{path} lacks {e.args[0]!r}, which a {family.name} config needs") from None
    _check_safetensors(spec.model_dir)
    return family, cfg


def _check_safetensors(model_dir: str) -> None:
    """Every *.safetensors file of the checkpoint has a readable header (only headers are read)."""
    import os

    from safetensors import SafetensorError, safe_open

    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{os.path.join(model_dir, name)} is not a readable safetensors file ({e})") from None


def load_model(spec: Spec) -> tuple[ModelFamily, Any, dict[str, torch.Tensor]]:
    """(family, config, params): an embedded tiny random model, or a local Hugging Face checkpoint."""
    dtype = DTYPES[spec.dtype]
    family, cfg = model_config(spec)
    if spec.model_dir is None:
        return family, cfg, family.init_params(cfg, seed=spec.seed, std=EMBEDDED_STD, dtype=dtype)
    _, params = load_checkpoint(spec.model_dir, dtype=dtype)
    return family, cfg, params


def prompts(spec: Spec, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Seeded random prompts, packed: tokens [T] int64 and cu_seqlens [B+1] (host ints)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    cu = [0]
    for n in spec.prompt_lens:
        cu.append(cu[-1] + n)
    return torch.randint(0, vocab, (cu[-1],), generator=g), cu


def graph_backend(spec: Spec, family: ModelFamily) -> str:
    """The decode runner's backend: the requested compiler for a capturable family, else "eager"."""
    return spec.backend if family.capturable else "eager"


def engine_configs(spec: Spec, family: ModelFamily, cfg: Any) -> tuple[EngineConfig, EngineConfig]:
    """The prefill (kv_producer, PCP) and decode (kv_consumer, DCP) engines of the P/D pair, validated.

    Raises :class:`~cpattn.config.ConfigError` listing every broken rule for
    a layout the guide (or the engine) cannot run.
    """
    graph = "FULL_DECODE_ONLY" if spec.graph_mode == "full_decode_only" else "NONE"
    pre, dec = driver.engine_configs(family, cfg, pcp_size=spec.pcp, dcp_size=spec.dcp, block_size=spec.block_size,
                                     interleave_size=spec.interleave, pd=True, graph_mode=graph,
                                     capture_sizes=spec.capture_sizes, graph_backend=graph_backend(spec, family))
    checks.check(family, cfg, pre, dec, world_size=spec.world_size, topology="colocated",
                 pool=spec.kv_pool is not None)
    return pre, dec


def flat(config: EngineConfig) -> dict:
    """An engine config as one flat dict of its fields (the flat names of ``EngineConfig.create``)."""
    return {k: v for part in dataclasses.asdict(config).values() for k, v in part.items()}


# -- the one-device reference (parent process) ----------------------------------------------------


def one_device(family: ModelFamily, params: dict, cfg: Any, ps, max_new_tokens: int) -> Reference:
    """The one-device greedy run: the engine's dense-cache reference
    (:func:`~cpattn.engine.reference.reference_generate`), or, for a family whose cache is not per-token rows
    (its own ``stages``: DeepSeek-V4's rings and compressed entries), its own stages on one rank, eager
    (:func:`cpattn.engine.driver.generate`, checked against Hugging Face in tests/test_v4_engine.py)."""
    if family.stages is None:
        return reference_generate(family, params, cfg, ps, max_new_tokens)
    pre, dec = driver.engine_configs(family, cfg)
    gen = driver.generate(family, params, cfg, [list(map(int, p)) for p in ps], max_new_tokens, prefill=pre,
                          decode=dec, prompt_logits=False)
    f = gen.facts
    return Reference(gen.tokens, gen.logits, torch.zeros(0), f.prefill_s, list(f.step_s), f.kv_bytes)


def reference(spec: Spec) -> dict:
    """The single-device greedy run every parallel run must reproduce: tokens [B, N], logits [B, N, V],
    TTFT (median of ``spec.reps`` prefills), TPOT (median step), KV bytes; and, with a KV pool, the
    tokens of every pool-phase request (:func:`pool_requests`)."""
    family, cfg, params = load_model(spec)
    tokens, cu = prompts(spec, cfg.vocab_size)
    ps = [tokens[a:b] for a, b in zip(cu, cu[1:])]
    one_device(family, params, cfg, [list(range(8))], 2)  # warm-up
    ttft = statistics.median(one_device(family, params, cfg, ps, 1).prefill_s for _ in range(spec.reps))
    ref = one_device(family, params, cfg, ps, spec.max_new_tokens)
    out = {"tokens": ref.tokens, "logits": ref.logits, "ttft_s": ttft,
           "tpot_s": statistics.median(ref.step_s) if ref.step_s else float("nan"), "kv_bytes": ref.kv_bytes}
    if spec.kv_pool is not None:
        reqs = pool_requests(spec, cfg.vocab_size)
        out["pool_tokens"] = {name: [one_device(family, params, cfg, [p], POOL_NEW_TOKENS).tokens for p in r]
                              for name, r in reqs.items() if name != "warm-up"}
    return out


# -- one rank of the parallel run --------------------------------------------------------------------


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


def demo_rank(group: Group, spec: Spec) -> dict:
    """The parallel run on one rank of ``group`` (``spec.world_size`` ranks); every rank returns the full result."""
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
               whole_step_captured=family.capturable, model=family.name, config=dataclasses.asdict(cfg))
    if spec.kv_pool is not None:
        res["pool"] = pool_rank(group, spec, family, cfg, params, pre_cfg, dec_cfg)
    bar.step("done")
    return res


# -- the KV pool phase ---------------------------------------------------------------------------------


def pool_requests(spec: Spec, vocab: int) -> dict[str, list[list[int]]]:
    """The pool phase's prompts, each ``prompt_len`` tokens: a ``warm-up`` pair (a prompt, then the same
    prompt: the pool's store and load paths run once before anything is timed; the same on every demo run,
    so a second run finds it), then per round a ``cold`` prompt of fresh tokens (``pool_salt`` makes them new
    on every run: nothing of it can be pooled) and a ``warm`` one sharing its first 7/8 (whole blocks) with a
    fresh tail. Returns ``{"warm-up": [2], "cold": [rounds], "warm": [rounds]}`` token lists.

    >>> r = pool_requests(Spec(prompt_len=64, block_size=16), vocab=512)
    >>> [len(r[k]) for k in ("warm-up", "cold", "warm")], r["warm"][0][:48] == r["cold"][0][:48]
    ([2, 3, 3], True)
    """
    n = spec.prompt_len
    keep = (n * 7 // 8) // spec.block_size * spec.block_size

    def fresh(*key, length=n) -> list[int]:
        seed = int.from_bytes(hashlib.sha256(repr((spec.seed, *key)).encode()).digest()[:7], "little")
        g = torch.Generator().manual_seed(seed)  # the same in the parent and on every rank
        return torch.randint(0, vocab, (length,), generator=g).tolist()

    warmup = fresh("pool warm-up")
    colds = [fresh("pool cold", spec.pool_salt, r) for r in range(spec.pool_rounds)]
    warms = [c[:keep] + fresh("pool tail", spec.pool_salt, r, length=n - keep) for r, c in enumerate(colds)]
    return {"warm-up": [warmup, warmup], "cold": colds, "warm": warms}


def shareable_blocks(spec: Spec) -> int:
    """Whole blocks a warm request shares with its cold one (the pool should serve them all)."""
    keep = (spec.prompt_len * 7 // 8) // spec.block_size * spec.block_size
    return min(keep, spec.prompt_len - 1) // spec.block_size


def pool_rank(group: Group, spec: Spec, family, cfg, params, pre_cfg, dec_cfg) -> dict:
    """The pool phase on one rank: after the warm-up pair, ``spec.pool_rounds`` interleaved rounds of a cold
    request (its blocks go to the pool) then a warm one sharing 7/8 of it (:func:`pool_requests`), each through
    :func:`cpattn.engine.driver.generate_on_rank` with one pool opened for the phase. Per request: TTFT (the
    slowest rank's), blocks found / loaded / stored, bytes loaded, tokens (checked against one device by the
    caller); and why the store was unavailable, if it said so (a :class:`~cpattn.pool.PoolUnavailableWarning`)."""
    import warnings

    from cpattn.engine.pooling import open_for_run, release
    from cpattn.pool import PoolUnavailableWarning

    reqs = pool_requests(spec, cfg.vocab_size)
    label = PoolSpec(spec.kv_pool, model=spec.model_dir or f"{family.name}-tiny-seed{spec.seed}")
    decode = dec_cfg.replace(graph_mode="NONE")
    out: dict[str, list[dict]] = {name: [] for name in reqs}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PoolUnavailableWarning)
        pool, opened = open_for_run(label, family, cfg, params, dec_cfg.cache.block_size)
        try:
            order = [("warm-up", 0), ("warm-up", 1)] + [(name, r) for r in range(spec.pool_rounds)
                                                         for name in ("cold", "warm")]
            for name, r in order:
                gen = driver.generate_on_rank(group, family, params, cfg, [reqs[name][r]], POOL_NEW_TOKENS,
                                              prefill=pre_cfg, decode=decode, prompt_logits=False, pool=pool)
                f = gen.facts.pool
                out[name].append({
                    "ttft_s": max(group.all_gather(torch.tensor([gen.facts.ttft_s], dtype=torch.float64)).tolist()),
                    "hit_blocks": list(f.hit_blocks), "blocks_loaded": f.blocks_loaded,
                    "blocks_stored": sum(int(x) for x in group.all_gather(torch.tensor([f.blocks_stored])).tolist()),
                    "bytes_loaded": f.bytes_loaded, "prompt_len": len(reqs[name][r]), "tokens": gen.tokens})
        finally:
            if opened:
                release(pool)
    reasons = [_reason(str(w.message)) for w in caught if issubclass(w.category, PoolUnavailableWarning)]
    return {"requests": out, "unavailable": reasons[0] if reasons else None}


def _reason(message: str) -> str:
    """The store's own reason inside a :class:`~cpattn.pool.PoolUnavailableWarning` message (else all of it).

    >>> _reason("cpattn KV pool: the store is unavailable (no master at h:1 (start one)); continuing without ...")
    'no master at h:1 (start one)'
    """
    m = re.match(r".*?the store is unavailable \((.*)\); continuing", message, re.S)
    return m.group(1) if m else message
