"""Collectives priced as the libraries run them: per-algorithm alpha-beta and the library's own choice.

A profile's ``collectives[link]`` lists the (algorithm, protocol) entries
of the library on that link (constants and sources in
:mod:`cpattn.plan.profiles`: ``NCCL_NVLINK``, ``VLLM_CUSTOM_AR``,
``NCCL_NET``, ``HCCL_HCCS``). One entry costs

    ``base + steps * hop + bytes / (beta * bw[kind])``

with ``steps`` and ``bytes`` per family (``m``: one rank's input, ``M``: the
tensor each rank holds):

==============  ============================  ===============================
family          all_reduce(M)                 all_gather(m); reduce_scatter(M),
                                              all_to_all(M)
==============  ============================  ===============================
ring            2(n-1) steps, 2(n-1)/n M      n-1 steps, (n-1) m; (n-1)/n M
tree            2 log2(n) steps, 2 M          (all_reduce only)
one_shot        1 step, (n-1) M (read peers)  1 step, (n-1) m; (n-1)/n M
two_shot        2 steps, 2(n-1)/n M           (all_reduce only)
==============  ============================  ===============================

Choice: an entry with ``windows`` (``[[max ranks, max bytes], ...]``) is
taken when its rule admits ``(n, bytes)`` (vLLM's custom all-reduce: by
rule, the first such entry); otherwise the cheapest of the rest (NCCL's
tuner), which is the message-size switch: LL below some KB, LL128 /
Simple above. A profile without entries for the link (the calibrated CPU)
keeps :func:`cpattn.plan.costs.collective_time`'s ring.

Example
-------
>>> from cpattn.plan.profiles import get_profile
>>> h200 = get_profile("h200")
>>> t, algo = choose(h200, "all_reduce", 14336, 8)  # R1's decode all-reduce at batch 1, TP8
>>> algo, round(t * 1e6, 1)
('vllm custom all-reduce 1-stage', 4.2)
>>> choose(h200, "all_reduce", 64 * 2**20, 8)[1], choose(h200, "all_gather", 4096, 8)[1]
('nccl ring Simple', 'nccl ring LL')
"""

from __future__ import annotations

import math

from cpattn.plan.costs import collective_time


def _steps_bytes(family: str, kind: str, nbytes: float, n: int) -> tuple[float, float] | None:
    """(steps, bytes through one rank's link) of ``kind`` in ``family``; None when the family lacks it."""
    if kind == "all_reduce":
        return {"ring": (2 * (n - 1), 2 * (n - 1) / n * nbytes), "tree": (2 * math.log2(n), 2 * nbytes),
                "one_shot": (1, (n - 1) * nbytes), "two_shot": (2, 2 * (n - 1) / n * nbytes)}.get(family)
    if family not in ("ring", "one_shot"):
        return None
    steps = n - 1 if family == "ring" else 1
    if kind == "all_gather":
        return steps, (n - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return steps, (n - 1) / n * nbytes
    return None


def entry_time(entry: dict, kind: str, nbytes: float, n: int, beta: float) -> float | None:
    """Seconds of ``kind`` with one algorithm ``entry`` (module doc), None when it does not run ``kind``."""
    if kind not in entry.get("kinds", (kind,)):
        return None
    sb = _steps_bytes(entry["family"], kind, nbytes, n)
    if sb is None:
        return None
    bw = entry["bw"].get(kind, entry["bw"].get("*", 1.0))
    return entry["base"] + sb[0] * entry["hop"] + sb[1] / (beta * bw)


def _admits(entry: dict, n: int, nbytes: float) -> bool:
    return any(n <= ranks and nbytes < size for ranks, size in entry["windows"])


def choose(prof, kind: str, nbytes: float, n: int, crosses_nodes: bool = False) -> tuple[float, str]:
    """(seconds, algorithm name) of one collective over ``n`` ranks as the profile's library picks it."""
    if n <= 1:
        return 0.0, "none"
    name = "inter" if crosses_nodes and "inter" in prof.links else "intra"
    link = prof.links[name]
    entries = prof.collectives.get(name) or []
    if crosses_nodes:
        entries = [e for e in entries if "windows" not in e]  # peer-memory all-reduce: one node only
    for e in entries:
        if "windows" in e and _admits(e, n, nbytes):
            t = entry_time(e, kind, nbytes, n, link.beta)
            if t is not None:
                return t, e["name"]
    timed = [(t, e["name"]) for e in entries if "windows" not in e
             for t in [entry_time(e, kind, nbytes, n, link.beta)] if t is not None]
    if timed:
        return min(timed)
    return collective_time(kind, nbytes, n, link), "alpha-beta ring"


def comm_time(prof, kind: str, nbytes: float, n: int, crosses_nodes: bool = False) -> float:
    """Seconds of :func:`choose`."""
    return choose(prof, kind, nbytes, n, crosses_nodes)[0]
