"""Where a P = 2 ring rank's time goes (``cpattn bench pcp``): each piece of its work timed alone, in one process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpattn.bench import harness

if TYPE_CHECKING:
    from cpattn.bench.pcp import Spec


def breakdown(spec: Spec, reps: int) -> list[dict]:
    """One process, one thread: every piece of a P = 2 ring rank's work timed alone, interleaved with the
    one-rank call (one request): the head-major copies, each step's kernel call, the merge. CPU ms and the
    share of the one-rank time; the transfer itself is what the ring measurement adds on top."""
    import torch
    from cpattn.layout.pcp import pcp_plan, pcp_shard
    from cpattn.ops import attention_with_lse
    from cpattn.ops.merge import merge_into
    from cpattn.pcp import _pack, _unpack

    q_all, k_all, v_all, cu = spec.inputs()
    plan = pcp_plan(cu, 2)
    span = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    hkv, d, dv = spec.kv_heads, spec.head_dim, spec.v_head_dim
    out = {}
    for r in range(2):
        q, k, v = (pcp_shard(x, plan, r) for x in (q_all, k_all, v_all))
        t_r, na = q.shape[0], plan.num_a(r)
        qh = q.transpose(0, 1).contiguous().transpose(0, 1)
        msg = _pack(k, v)
        ks, vs = _unpack(msg, t_r, hkv, d, dv)
        if r == 0:  # rank 1's KV arrives whole; q_b attends it all
            step1 = lambda qh=qh, ks=ks, vs=vs, na=na, t=t_r: attention_with_lse(qh[na:], ks, vs, span(t - na), span(t),
                                                                                causal=False)
        else:  # rank 0's kv_a arrives alone; every local query attends it
            step1 = lambda qh=qh, ks=ks, vs=vs, na=na, t=t_r: attention_with_lse(qh, ks[:na], vs[:na], span(t), span(na),
                                                                                causal=False)
        o0, l0 = attention_with_lse(qh, ks, vs, span(t_r), span(t_r), causal=True)
        o1, l1 = step1()
        rows = slice(na, t_r) if r == 0 else slice(0, t_r)
        out[r] = {
            "q head-major copy": lambda q=q: q.transpose(0, 1).contiguous(),
            "K/V packing": lambda k=k, v=v: _pack(k, v),
            "step 0 (causal, local)": lambda qh=qh, ks=ks, vs=vs, t=t_r: attention_with_lse(qh, ks, vs, span(t), span(t),
                                                                                           causal=True),
            "step 1 (unmasked, received)": step1,
            "merge": lambda o0=o0.float().clone(), l0=l0.clone(), o1=o1, l1=l1, rows=rows: merge_into(
                o0[rows], l0[rows], o1, l1),  # in place, as the ring's accumulator (repeats change values, not cost)
        }
    fns = {"one rank": lambda: attention_with_lse(q_all, k_all, v_all, cu, cu, causal=True)}
    fns.update({f"rank {r}: {name}": fn for r in out for name, fn in out[r].items()})
    s = harness.compare(fns, reps, warmup=1).samples  # interleaved rounds
    one = min(s["one rank"].cpu)
    return [{"piece": n, "cpu_ms": 1e3 * min(x.cpu), "of_one_rank": min(x.cpu) / one} for n, x in s.items()]
