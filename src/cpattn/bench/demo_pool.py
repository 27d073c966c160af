"""The ``cpattn demo --kv-pool`` phase: cold and warm requests sharing a prefix, through one KV pool, per rank."""

from __future__ import annotations

import hashlib
import re

import torch

from cpattn.bench.demo_setup import Spec
from cpattn.comm.group import Group
from cpattn.engine import driver
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
