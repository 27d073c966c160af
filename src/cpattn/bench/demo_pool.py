"""The ``cpattn demo --kv-pool`` phase: cold and warm requests sharing a prefix, through one KV pool, per rank."""

from __future__ import annotations

import hashlib
import re
import warnings

import torch

from cpattn.bench.demo_setup import Spec
from cpattn.comm.group import Group
from cpattn.engine.pooling import PoolSpec

POOL_NEW_TOKENS = 4  # greedy tokens of each pool-phase request


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
    """Whole blocks a warm request shares with its cold one that the pool can serve: the step loop fetches
    whole spans (``block_size * dcp`` tokens, one block per DCP rank) and leaves a prompt's last token to
    compute, so whole spans of the shared prefix, in blocks.

    >>> shareable_blocks(Spec(prompt_len=512, block_size=16)), shareable_blocks(Spec(prompt_len=64, block_size=16))
    (28, 2)
    """
    keep = (spec.prompt_len * 7 // 8) // spec.block_size * spec.block_size
    span = spec.block_size * spec.world_size
    return min(keep, spec.prompt_len - 1) // span * spec.world_size


def pool_rank(group: Group, spec: Spec, family, cfg, params, pre_cfg=None, dec_cfg=None) -> dict:
    """The pool phase on one rank: after the warm-up pair, ``spec.pool_rounds`` interleaved rounds of a cold
    request (its blocks go to the pool) then a warm one sharing 7/8 of it (:func:`pool_requests`), each one
    :func:`cpattn.engine.run_rank` (a fresh engine, prefix caching on, every rank of ``group`` one DCP rank)
    over one pool opened for the phase (``kv_pool=``): a request's engine fetches at admission the spans the
    earlier ones stored. Per request: TTFT (step 0, barrier to first token, the slowest rank's), blocks found
    (``hit_blocks``, ``blocks_loaded``: this rank's) / stored (all ranks'), bytes loaded by this rank
    (:attr:`~cpattn.engine.connector.PoolConnector.loaded_bytes`), tokens ``[1, POOL_NEW_TOKENS]`` (checked
    against one device by the caller); and why the store was unavailable or cold, if it said so (a
    :class:`~cpattn.pool.PoolUnavailableWarning` or :class:`~cpattn.pool.PoolDamagedWarning`).
    ``pre_cfg`` / ``dec_cfg``: unused (the fixed batch's)."""
    from cpattn.engine.pooling import open_for_run, release
    from cpattn.pool import PoolDamagedWarning, PoolUnavailableWarning

    reqs = pool_requests(spec, cfg.vocab_size)
    label = PoolSpec(spec.kv_pool, model=spec.model_dir or f"{family.name}-tiny-seed{spec.seed}")
    out: dict[str, list[dict]] = {name: [] for name in reqs}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PoolUnavailableWarning)
        warnings.simplefilter("always", PoolDamagedWarning)
        pool, opened = open_for_run(label, family, cfg, params, spec.block_size)
        try:
            order = [("warm-up", 0), ("warm-up", 1)] + [(name, r) for r in range(spec.pool_rounds)
                                                         for name in ("cold", "warm")]
            for name, r in order:
                out[name].append(_request(group, spec, family, cfg, params, reqs[name][r], pool))
        finally:
            if opened:
                release(pool)
    reasons = [_reason(str(w.message)) for w in caught
               if issubclass(w.category, (PoolUnavailableWarning, PoolDamagedWarning))]
    return {"requests": out, "unavailable": reasons[0] if reasons else None}


def _request(group: Group, spec: Spec, family, cfg, params, prompt: list[int], pool) -> dict:
    """One pool-phase request through :func:`run_rank` on a fresh engine (see :func:`pool_rank`)."""
    from cpattn.bench.demo_loop import Timer
    from cpattn.config import GuideCompatWarning, SchedulerConfig
    from cpattn.engine.llm import SamplingParams
    from cpattn.engine.run_rank import Arrival, run_rank

    n, span = len(prompt), spec.block_size * group.size
    sched = SchedulerConfig(max_num_batched_tokens=n + POOL_NEW_TOKENS, max_num_seqs=1, enable_chunked_prefill=False,
                            enable_prefix_caching=True, max_model_len=n + POOL_NEW_TOKENS)

    def facts(engine) -> dict:
        c = engine.connector
        return {"found": engine.stats.pool_hit_tokens // spec.block_size, "loaded": getattr(c, "loaded_blocks", 0),
                "bytes": getattr(c, "loaded_bytes", 0), "stored": getattr(c, "stored_blocks", 0)}

    timer = Timer(group, 1, facts=facts)
    with warnings.catch_warnings():  # one engine with PCP and DCP (as the demo's step-loop run)
        warnings.simplefilter("ignore", GuideCompatWarning)
        outs = run_rank(group, family, params, cfg, [Arrival(prompt, SamplingParams(max_tokens=POOL_NEW_TOKENS))],
                        pcp_size=spec.pcp if spec.pcp == group.size else 1, block_size=spec.block_size,
                        interleave_size=spec.block_size, scheduler=sched, kv_pool=pool, seed=spec.seed,
                        num_blocks=-(-(n + POOL_NEW_TOKENS) // span), on_step=timer.after, before_step=timer.before)
    f = timer.facts
    stored = sum(int(x) for x in group.all_gather(torch.tensor([f["stored"]])).tolist())
    return {"ttft_s": timer.slowest()[0], "hit_blocks": [f["found"]], "blocks_loaded": f["loaded"],
            "blocks_stored": stored, "bytes_loaded": f["bytes"], "prompt_len": n,
            "tokens": torch.tensor([list(outs[0].token_ids)], dtype=torch.int64)}


def _reason(message: str) -> str:
    """The store's own reason inside a pool warning's message (else all of it after ``cpattn KV pool:``).

    >>> _reason("cpattn KV pool: the store is unavailable (no master at h:1 (start one)); continuing without ...")
    'no master at h:1 (start one)'
    >>> _reason("cpattn KV pool: /p/data.mdb is damaged (truncated); moved it to data.mdb.damaged and ...")
    '/p/data.mdb is damaged (truncated); moved it to data.mdb.damaged and ...'
    """
    m = re.match(r".*?the store is unavailable \((.*)\); continuing", message, re.S)
    return m.group(1) if m else message.removeprefix("cpattn KV pool: ")
