"""``cpattn demo``'s verdict and report: tokens checked against the one-device run, the table of times,
bytes and KV sizes, and the JSON payload.

Example
-------
>>> import torch
>>> first_mismatch(torch.tensor([[True, False]]), {"logits": torch.tensor([[[0., 0.], [2., 1.]]])})
{'request': 0, 'token': 1, 'reference_margin': 1.0}
"""

from __future__ import annotations

import dataclasses
import platform

import torch

from cpattn.bench.common import Samples, ratio, safe_div, table
from cpattn.bench.harness import paired, spread
from cpattn.bench.demo_run import Spec, flat, shareable_blocks

COLUMNS = ["run", "ranks", "TTFT_ms", "TPOT_ms", "KV_bytes_per_rank", "prefill_sent", "handoff_sent",
           "decode_sent_per_step", "TTFT_x", "TPOT_x", "tokens"]


def summarize(res: dict, ref: dict, spec: Spec, engines) -> dict:
    """Check every run's tokens against the one-device reference ``ref`` and gather one JSON-able dict."""
    ref_tokens = ref["tokens"].clone()  # [B, N]
    if spec.perturb_reference:  # testing aid: a reference that cannot match
        ref_tokens[0, -1] = (ref_tokens[0, -1] + 1) % res["config"]["vocab_size"]
    par = f"PCP={spec.pcp} -> DCP={spec.dcp}"
    rows = [{"run": "1 device, eager (reference)", "ranks": 1, "TTFT_ms": 1e3 * ref["ttft_s"],
             "TPOT_ms": 1e3 * ref["tpot_s"], "KV_bytes_per_rank": ref["kv_bytes"], "prefill_sent": 0,
             "handoff_sent": 0, "decode_sent_per_step": 0, "TTFT_x": 1.0, "TPOT_x": 1.0, "tokens": "reference"}]
    checks = {}
    for name, run in res["runs"].items():
        toks = torch.cat([res["first"][:, None], run["tokens"]], 1)  # [B, N]
        same = toks == ref_tokens
        checks[name] = {"match": bool(same.all()), "equal_tokens": int(same.sum()), "total_tokens": same.numel(),
                        "first_mismatch": first_mismatch(same, ref)}
        label = f"{par}, graph ({run['backend']})" if name == "graph" else f"{par}, eager"
        rows.append({"run": label, "ranks": spec.world_size, "TTFT_ms": 1e3 * res["ttft_s"],
                     "TPOT_ms": 1e3 * run["tpot_s"], "KV_bytes_per_rank": max(res["kv_bytes_per_rank"]),
                     "prefill_sent": max(res["prefill_bytes"]), "handoff_sent": max(res["handoff_bytes"]),
                     "decode_sent_per_step": run["bytes_per_step"], "TTFT_x": safe_div(ref["ttft_s"], res["ttft_s"]),
                     "TPOT_x": safe_div(ref["tpot_s"], run["tpot_s"]),
                     "tokens": f"{checks[name]['equal_tokens']}/{checks[name]['total_tokens']} equal"})
    graph = res["runs"].get("graph")
    eager = res["runs"].get("eager")
    out = {
        "spec": dataclasses.asdict(spec), "model": res["model"], "config": res["config"],
        "engines": {"prefill": flat(engines[0]), "decode": flat(engines[1])},
        "prompt_lens": spec.prompt_lens, "rows": rows, "checks": checks,
        "reference_tokens": ref_tokens.tolist(),
        "tokens": {name: torch.cat([res["first"][:, None], r["tokens"]], 1).tolist() for name, r in res["runs"].items()},
        "ttft_samples_ms": [1e3 * t for t in res["ttft_samples"]], "handoff_ms": 1e3 * res["handoff_s"],
        "decode_backend": res["decode_backend"],
        "whole_step_captured": res["whole_step_captured"] and graph is not None and res["decode_backend"] != "eager",
        "torch": torch.__version__, "machine": platform.machine(),
        "composition": res.get("composition", "fixed batch"),
        "ttft_ms": spread([1e3 * t for t in res["ttft_samples"]]).as_dict(),
        "tpot_ms": {name: r.get("tpot_spread_ms") for name, r in res["runs"].items()},
        "decode_forward_ms": {name: r.get("forward_spread_ms") for name, r in res["runs"].items()},
        "tpot_rank_median_ms": {name: 1e3 * r["tpot_rank_median_s"] for name, r in res["runs"].items()
                                if "tpot_rank_median_s" in r},
        "decode_step_ms": {name: [1e3 * t for t in r["step_s"]] for name, r in res["runs"].items() if "step_s" in r},
        "engine_stats": {name: r["engine_stats"] for name, r in res["runs"].items() if "engine_stats" in r},
        "graph_vs_eager": paired(eager["step_s"], graph["step_s"]).as_dict()
        if graph is not None and eager is not None and "step_s" in graph and graph["step_s"] else None,
    }
    if graph is not None:
        st, steps = graph["stats"], spec.max_new_tokens - 1
        out["graph"] = {"backend": graph["backend"], "capture_s": graph["capture_s"], "stats": st,
                        "decode_steps": steps, "all_steps_replayed": st["graph"] == steps and st["eager"] == 0}
    if "pool" in res:
        out["pool"], checks["pool"] = pool_summary(res["pool"], ref["pool_tokens"], spec)
    out["tokens_match"] = all(c["match"] for c in checks.values())
    out["ok"] = out["tokens_match"] and out.get("pool", {}).get("status") != "served nothing"
    return out


def pool_summary(pool: dict, ref_tokens: dict, spec: Spec) -> tuple[dict, dict]:
    """The pool phase (:func:`cpattn.bench.demo_run.pool_rank`) as (JSON-able summary, token check).

    status: ``ok`` (the warm requests were served blocks), ``served nothing`` (they share whole blocks
    with their cold requests, and the pool served none: a failed check), ``nothing to share`` (a prompt
    too short to share a whole block). The speed-up cold / warm TTFT, per round, is reported only when
    every warm request was served blocks and every cold one found none (else it measures no pool).
    """
    reqs = pool["requests"]
    same = torch.cat([(r["tokens"] == ref).flatten() for name in ("cold", "warm")
                      for r, ref in zip(reqs[name], ref_tokens[name])])
    check = {"match": bool(same.all()), "equal_tokens": int(same.sum()), "total_tokens": same.numel(),
             "first_mismatch": first_mismatch(same[None], {})}
    shareable = shareable_blocks(spec)
    served = [w["blocks_loaded"] for w in reqs["warm"]]
    cold_found = [c["blocks_loaded"] for c in reqs["cold"]]
    status = "nothing to share" if shareable == 0 else "served nothing" if not any(served) else "ok"
    cold, warm = (Samples(tuple(r["ttft_s"] for r in reqs[name])) for name in ("cold", "warm"))
    timed = status == "ok" and all(served) and not any(cold_found)
    out = {"status": status, "rounds": len(served), "shareable_blocks": shareable, "served_blocks": served,
           "cold_found_blocks": cold_found, "unavailable": pool["unavailable"],
           "warm_up_found_blocks": reqs["warm-up"][0]["blocks_loaded"],
           "ttft_ms": {"cold": cold.as_dict(), "warm": warm.as_dict()},
           "speedup": ratio(cold, warm) if timed else None,
           **{name: [{k: (v.tolist() if k == "tokens" else v) for k, v in r.items()} for r in rs]
              for name, rs in reqs.items()}}
    return out, check


def pool_lines(p: dict, spec: dict) -> list[str]:
    """The report's lines about the pool phase (see :func:`pool_summary`)."""
    n, block, rounds = spec["prompt_len"], spec["block_size"], p["rounds"]
    head = f"KV pool {spec['kv_pool']}:"
    if p["status"] == "served nothing":
        why = f"the store said why ({p['unavailable']})" if p["unavailable"] else \
            "every lookup missed (no reason given by the store)"
        return [f"{head} the pool served nothing: 0 of {p['shareable_blocks']} shareable blocks in each of {rounds} "
                f"warm requests; {why}; no speed-up to report"]
    if p["status"] == "nothing to share":
        return [f"{head} a {n}-token prompt shares no whole {block}-token block with the next one; nothing to time"]
    cold, warm = p["cold"][0], p["warm"][0]
    lines = [f"{head} after a warm-up pair ({p['warm_up_found_blocks']} of its blocks pooled by an earlier run), "
             f"{rounds} interleaved rounds of a fresh {n}-token request (cold: {sum(p['cold_found_blocks'])} blocks "
             f"found, {cold['blocks_stored']} stored) then one sharing its first {p['shareable_blocks'] * block} tokens "
             f"(warm: {'/'.join(str(x) for x in p['served_blocks'])} of {p['shareable_blocks']} blocks served, "
             f"{warm['bytes_loaded']:,} bytes loaded per rank)"]
    t = p["ttft_ms"]
    times = (f"TTFT cold {t['cold']['median']:.1f} ms [{t['cold']['best']:.1f}-{t['cold']['worst']:.1f}], warm "
             f"{t['warm']['median']:.1f} ms [{t['warm']['best']:.1f}-{t['warm']['worst']:.1f}]")
    sp = p["speedup"]
    if sp is None:
        lines.append(f"  {times}; no speed-up reported: a cold request found pooled blocks, or a warm one none")
    else:
        sp = sp if isinstance(sp, dict) else sp.as_dict()
        lines.append(f"  {times}; cold / warm TTFT {sp['median']:.2f}x [{sp['low']:.2f}-{sp['high']:.2f}] (> 1: the "
                     f"warm request is faster; median [low-high] of the per-round ratios, {rounds} rounds)")
    return lines


def spread_lines(s: dict) -> list[str]:
    """TTFT and TPOT as median [low-high] (the table shows the medians), and the per-step graph / eager ratio."""
    def fmt(d: dict) -> str:
        return f"{d['median']:.2f} ms [{d['low']:.2f}-{d['high']:.2f}]"

    t = s["ttft_ms"]
    parts = [f"TTFT {fmt(t)} over {len(s['ttft_samples_ms'])} fresh run(s)"]
    parts += [f"TPOT {name} {fmt(d)}" for name, d in s.get("tpot_ms", {}).items() if d]
    lines = ["; ".join(parts) + " (median [low-high], the slowest rank's)"]
    fwd = [f"{name} {fmt(d)}" for name, d in s.get("decode_forward_ms", {}).items() if d]
    if fwd:
        lines.append("  of a decode step, the model step (the engine's forward): " + "; ".join(fwd) +
                     "; the rest is the step loop's host work (schedule, inputs, sampling, commit)")
    g = s.get("graph_vs_eager")
    if g:
        lines.append(f"eager / graph decode step time, paired by step: {g['median']:.2f}x [{g['low']:.2f}-{g['high']:.2f}]"
                     " (> 1: the replayed step is faster)")
    return lines


def first_mismatch(same: torch.Tensor, ref: dict) -> dict | None:
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
    src = spec["model_dir"] or f"embedded tiny random-init model (seed {spec['seed']}, nothing downloaded)"
    inter = s["engines"]["decode"]["cp_kv_cache_interleave_size"]
    loop = s.get("composition") == "step loop"
    lines = [
        f"cpattn demo: {s['model']} ({sizes}), {spec['dtype']}; {src}",
        f"prompts: {s['prompt_lens']} tokens, {spec['max_new_tokens']} new tokens each (greedy); "
        f"{max(spec['pcp'], spec['dcp'])} gloo ranks",
    ]
    if loop:
        lines.append(f"step loop (cpattn.engine.run_rank), one engine on the ranks: every prompt at step 0, which "
                     f"prefills the batch with pcp_size={spec['pcp']}; later steps decode with tp=dcp={spec['dcp']}; "
                     f"block_size={spec['block_size']}, cp_kv_cache_interleave_size={inter}; checked as "
                     "vLLM-Ascend's P/D pair (a kv_producer PCP engine, a kv_consumer DCP engine), which it would "
                     "run as two engines")
    else:
        lines.append(f"prefill engine: pcp_size={spec['pcp']} (kv_producer); decode engine: tp=dcp={spec['dcp']}, "
                     f"pcp=1 (kv_consumer); block_size={spec['block_size']}, cp_kv_cache_interleave_size={inter}"
                     + (" (whole blocks handed over)" if inter == spec["block_size"] else ""))
    g = s.get("graph")
    if g:
        if s["whole_step_captured"]:
            what = "the whole decode step (embedding, every layer's write_kv + dcp_decode, lm_head, argmax) captured"
        elif s["decode_backend"] == "eager" and spec["backend"] != "eager":
            what = (f"decode step through DecodeRunner with the 'eager' backend, not compiled: {s['model']}'s step "
                    "is not capturable (data-dependent shapes or host syncs)")
        else:
            what = "decode step through DecodeRunner with the 'eager' backend (persistent buffers, padding, no compiler)"
        st = g["stats"]
        lines.append(f"graph mode FULL_DECODE_ONLY: {what}; backend {g['backend']!r}, capture sizes "
                     f"{sorted(int(k) for k in st['sizes']) or spec['capture_sizes']}, capture {g['capture_s']:.1f} s; "
                     f"decode steps replayed {st['graph']}/{g['decode_steps']}, eager {st['eager']}, "
                     f"padded rows {st['padded_tokens']}")
    else:
        lines.append("graph mode none: decode steps run eagerly")
    if loop:
        lines.append("KV hand-off: none apart from the prefill step, which sends each KV row to its DCP owner's "
                     "blocks (its time is in TTFT, its bytes in prefill_sent)")
    else:
        lines.append(f"KV hand-off into the decode caches (whole blocks to their DCP owners): {s['handoff_ms']:.1f} ms")
    lines.append("")
    lines.append(table(s["rows"], COLUMNS))
    lines.append("(bytes sent per rank; _x = speedup vs the 1-device run, > 1 is faster)")
    runs = {r["run"].split(", ")[-1]: r for r in s["rows"][1:]}
    graph_row = next((r for k, r in runs.items() if k.startswith("graph")), None)
    if graph_row and "eager" in runs:
        lines.append(f"graph replay vs eager decode step: {safe_div(runs['eager']['TPOT_ms'], graph_row['TPOT_ms']):.2f}x;"
                     f" KV per rank vs 1 device: "
                     f"{safe_div(graph_row['KV_bytes_per_rank'], s['rows'][0]['KV_bytes_per_rank']):.2f}x")
    lines += spread_lines(s)
    if "pool" in s:
        lines += pool_lines(s["pool"], spec)
    lines.append("")
    for name, chk in s["checks"].items():
        verdict = "identical" if chk["match"] else f"DIFFERENT, first at {chk['first_mismatch']}"
        what = "pool requests, cold and warm" if name == "pool" else f"{name} decode"
        lines.append(f"tokens ({what}) vs single device: {chk['equal_tokens']}/{chk['total_tokens']} {verdict}")
    if s.get("pool", {}).get("status") == "served nothing":
        lines.append(f"KV pool check FAILED: --kv-pool {spec['kv_pool']} was asked for and served no block")
    return "\n".join(lines)
