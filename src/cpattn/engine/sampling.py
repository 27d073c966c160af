"""Sampling of the step loop: per-request temperature / top-k / top-p / seed, the same token on every rank.

A sampled request's :class:`SamplingParams` travel with it through the scheduler
(``SchedulerOutput.sampling``, one per row, None for a greedy request); the runner picks each sampled row's token from the step's logits [T, V]:

- ``temperature == 0``: greedy, the argmax the step already returns (ties to the lowest id) --
  bit-exact as before, and a step whose rows are all greedy runs no code of this module;
- otherwise the distribution of :func:`probs` (float64): logits / temperature, then top-k (every
  token whose logit is >= the k-th largest: ties at the cut all kept), softmax, then top-p (every
  token whose probability is >= the smallest one of the nucleus, the fewest most likely tokens whose
  mass reaches ``top_p``: again ties kept), renormalised -- vLLM's order of the three;
- the token is the inverse CDF, in token-id order, of one uniform ``u = draw(seed, i)``, where i is
  the token's index in the request's output (:func:`sample`).

The draw is a pure function of (seed, output index): a counter-based generator (SplitMix64's
finaliser over the 64-bit seed, then over the index), not a stream advanced step by step. So the
token at output position i does not depend on the layout (one device, DCP, PCP + DCP: every rank
computes the same draw), on which step or chunk sampled it, on the batch it shared, on arrival
order, or on a preemption that recomputes the request (its i-th token is drawn again from the same
u). Layouts whose float64 logits differ in their last bits pick the same token unless u falls within
that difference of a CDF boundary (probability ~1e-15 per token). A request without a seed gets one
from the engine's own generator at ``add_request`` (``LLMEngine(seed=...)``).

Speculative decoding under sampling (greedy drafts, the guide's rule; DESIGN.md 4.12): draft t at
output position i is accepted with probability p(t); on rejection the token is drawn from p with t
removed and renormalised; once all drafts are accepted the bonus token is drawn from the last row.
:func:`verify` realises this with the one uniform of position i: x = F^-1(u) is drawn from p, the
draft is accepted iff x == t (probability p(t)), and on rejection x is, by construction, a draw
from p conditioned on x != t -- exactly the renormalised residual. The emitted tokens therefore do
not depend on the drafts at all: with or without a drafter, whatever drafts the budget cut, a
seeded request emits the same tokens (tests/test_sampling.py checks both that and the distributions;
:func:`reference_verify` is the textbook two-uniform form, for the distribution tests).

Every DCP rank samples (the same logits, the same draw: the same token) rather than rank 0 sampling
and broadcasting. Measured on this repo's CPU box (2 shared cores, load average ~7; one thread per
rank): picking the tokens of 8 sampled rows of a 512-token vocabulary costs 0.89 ms per rank with
temperature 0.8 + top-p 0.9 (0.26 ms with temperature only; 32 rows: 1.83 / 0.46 ms); sending the 8
token ids from rank 0 (an all-reduce of an int64 [8], the Group having no broadcast) costs 0.15 ms
more on the simulated mesh and 0.52 ms more over gloo (two processes), while the other ranks wait
for rank 0's sampling anyway. Sampling on every rank runs in parallel, so it costs one rank's time
and no collective; it is the one kept. (At a vocabulary of 151,936, 8 rows: 125 ms with top-p, 73 ms
with temperature only, on every rank either way.) The engine still compares every rank's tokens on
the simulated mesh. The draw itself: 2.1 us per token, against 10.6 us for a ``torch.Generator``
seeded per token by the same hash.

Logprobs (``SamplingParams.logprobs = N``): per output token, ``{token: logprob}`` of the sampled token
and the N most likely ones, from the log-softmax of the model's raw logits (before temperature,
top-k and top-p: vLLM's default ``raw_logprobs``), in float64 (:func:`token_logprobs`).

Example
-------
>>> import torch
>>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
>>> p = probs(logits, temperature=[1.0], top_k=[2], top_p=[1.0])
>>> [round(float(x), 4) for x in p[0]]
[0.7311, 0.2689, 0.0, 0.0]
>>> sample(p, [0.5]).tolist(), sample(p, [0.9]).tolist()
([0], [1])
>>> draw(7, 0) == draw(7, 0), draw(7, 0) != draw(7, 1)
(True, True)
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.engine.outputs import RequestOutputKind

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingParams:
    """Per request (vLLM's names):

    max_tokens: tokens to generate; generation also stops after any of ``stop_token_ids``.
    temperature: 0 = greedy (the engine's default, ties to the lowest id); > 0 samples from
        softmax(logits / temperature). The OpenAI server passes OpenAI's default, 1.0, when a
        request leaves it out.
    top_p: keep the nucleus, the most likely tokens whose mass reaches top_p (0 < top_p <= 1; 1: all).
    top_k: keep the k most likely tokens (0 or -1: the whole vocabulary).
    seed: the request's seed (any int); None: one drawn from the engine's generator at ``add_request``.
        Output token i is a function of (seed, i) and the logits only (module docstring).
    logprobs: None, or N >= 0: each output token's ``{token_id: logprob}`` -- the sampled token's and
        the N most likely tokens' -- in ``RequestOutput.logprobs`` (raw model logprobs).
    output_kind: what each step's RequestOutput carries (:class:`~cpattn.engine.outputs.RequestOutputKind`):
        every token so far (CUMULATIVE, the default), the new ones (DELTA), or the final output only (FINAL_ONLY).

    >>> SamplingParams(temperature=0.7, top_k=20, seed=1).greedy
    False
    >>> SamplingParams(top_p=0)
    Traceback (most recent call last):
    ...
    ValueError: SamplingParams.top_p: saw 0; expected 0 < top_p <= 1 (1 keeps the whole distribution)
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        checks = (
            ("max_tokens", integer(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("stop_token_ids", isinstance(self.stop_token_ids, (tuple, list))
             and all(integer(t) for t in self.stop_token_ids), "a tuple of int token ids"),
            ("temperature", number(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 is greedy)"),
            ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "0 < top_p <= 1 (1 keeps the whole distribution)"),
            ("top_k", integer(self.top_k) and self.top_k >= -1, "an int >= 1, or 0 / -1 for the whole vocabulary"),
            ("seed", self.seed is None or integer(self.seed), "an int or None"),
            ("logprobs", self.logprobs is None or (integer(self.logprobs) and self.logprobs >= 0),
             "None or an int >= 0 (the top logprobs returned per token)"),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind),
             "a cpattn.engine.RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}: saw {getattr(self, name)!r}; expected {want}")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mix(x: int) -> int:
    """SplitMix64's step and finaliser: a 64-bit int -> a well-mixed 64-bit int."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def draw(seed: int, index: int) -> float:
    """The uniform in [0, 1) (53 bits) of output token ``index`` of a request seeded ``seed``: a pure
    function of the two (a counter-based generator), the same on every rank, in every step.

    >>> 0 <= draw(0, 0) < 1, draw(-1, 3) == draw((1 << 64) - 1, 3)
    (True, True)
    """
    return (_mix(_mix(seed & _MASK) ^ (index & _MASK)) >> 11) * 2.0 ** -53


def _column(x, dtype, n: int, device=None) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(n) if t.dim() == 0 else t


def probs(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """The sampling distribution of each row: [R, V] float64 (module docstring for the rules).

    logits [R, V] (any float dtype; computed in float64); temperature [R] (> 0), top_k [R] (0 / -1 or
    >= V: every token), top_p [R] (1: every token) -- sequences or scalars for every row.

    >>> p = probs(torch.tensor([[0.0, 0.0, -50.0]]), 1.0, 0, 0.5)   # a tie at the nucleus cut: both kept
    >>> p[0].tolist()
    [0.5, 0.5, 0.0]
    """
    x = logits.to(torch.float64)
    r, v = x.shape
    x = x / _column(temperature, torch.float64, r, x.device)[:, None]
    k = _column(top_k, torch.int64, r, x.device)
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    if bool((k < v).any()):
        kmax = int(k[k < v].max())
        kth = x.topk(kmax, dim=-1).values.gather(1, (k.clamp(max=kmax) - 1)[:, None])  # [R, 1]
        kth = torch.where((k < v)[:, None], kth, torch.full_like(kth, -math.inf))
        x = x.masked_fill(x < kth, -math.inf)
    p = torch.softmax(x, dim=-1)
    tp = _column(top_p, torch.float64, r, x.device)
    if bool((tp < 1).any()):
        floor = _nucleus_floor(p, tp)
        floor = torch.where((tp < 1)[:, None], floor, torch.zeros_like(floor))
        p = torch.where(p >= floor, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


_HEAD = 512  # top-p looks at the most likely 512 tokens first (a full sort only if their mass < top_p)


def _nucleus_floor(p: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the smallest probability of each row's nucleus (``p`` [R, V], ``tp`` [R]).

    The nucleus' last rank is the last whose mass ranked above it is < top_p. A row's most likely
    ``_HEAD`` tokens (``topk``: values sorted as a full sort would) hold it whenever their mass
    reaches top_p -- an LLM's usual case: 8 peaked rows of 151,936 tokens take 0.12-0.17 s instead
    of 0.41-0.49 s with a full sort on this CPU box; rows where they do not are sorted whole."""
    v = p.shape[-1]
    head = p.topk(_HEAD, dim=-1).values if v > 4 * _HEAD else p.sort(dim=-1, descending=True).values  # [R, H]
    cum = head.cumsum(-1)
    short = cum[:, -1] < tp
    if bool(short.any()) and head.shape[-1] < p.shape[-1]:
        full = p[short].sort(dim=-1, descending=True).values
        last = ((full.cumsum(-1) - full) < tp[short, None]).sum(-1, keepdim=True) - 1
        floor = torch.zeros_like(tp)[:, None]
        floor[short] = full.gather(1, last)
        rest = ~short
        last = ((cum[rest] - head[rest]) < tp[rest, None]).sum(-1, keepdim=True) - 1
        floor[rest] = head[rest].gather(1, last)
        return floor
    last = ((cum - head) < tp[:, None]).sum(-1, keepdim=True) - 1  # [R, 1] (>= 0: nothing ranks above the top)
    return head.gather(1, last)


def sample(p: torch.Tensor, u) -> torch.Tensor:
    """Tokens [R] int64: the inverse CDF (token-id order) of each row of ``p`` [R, V] at ``u`` [R] in [0, 1).

    A token of probability 0 is never returned.

    >>> sample(torch.tensor([[0.25, 0.0, 0.75]], dtype=torch.float64), [0.2, 0.25][1:]).tolist()
    [2]
    """
    cdf = p.cumsum(-1)  # [R, V]
    t = _column(u, torch.float64, p.shape[0], p.device) * cdf[:, -1]
    tok = torch.searchsorted(cdf, t[:, None], right=True)[:, 0]  # the first token whose cdf passes t
    last = p.shape[-1] - 1 - (p > 0).flip(-1).to(torch.int8).argmax(-1)  # the last token with p > 0
    return torch.minimum(tok, last)


def verify(p: torch.Tensor, drafts: Sequence[Sequence[int]], u: Sequence[Sequence[float]]) -> list[list[int]]:
    """Rejection sampling of greedy drafts: per request, the emitted tokens (accepted drafts, then one more).

    p [R, 1 + d, V]: each request's target distribution after its last token and after each draft;
    drafts [R][d]; u [R][1 + d]: the draws of those output positions. Position j draws x_j =
    F_j^-1(u_j); draft j is accepted iff x_j == drafts[j] (probability p_j(draft)), else x_j -- a
    draw from p_j with the draft removed and renormalised -- is emitted and verification stops;
    after d accepted drafts x_d is the bonus token. (The runner does the same on the tokens of
    :func:`choose`: the greedy acceptance rule applied to the sampled tokens.)

    >>> p = torch.tensor([[[0.5, 0.5], [0.1, 0.9]]] * 2, dtype=torch.float64)
    >>> verify(p, [[1], [1]], [[0.7, 0.05], [0.2, 0.05]])
    [[1, 0], [0]]
    """
    r, q, v = p.shape
    x = sample(p.reshape(r * q, v), [w for row in u for w in row]).view(r, q).tolist()
    out = []
    for xs, ds in zip(x, drafts):
        a = 0
        while a < len(ds) and xs[a] == ds[a]:
            a += 1
        out.append(xs[:a + 1])
    return out


def choose(logits: torch.Tensor, chosen: list[int], rows: Sequence[tuple[int, SamplingParams, int]]) -> list[int]:
    """The runner's tokens: ``chosen`` (the greedy token of every position of ``logits`` [T, V]) with
    each ``(position, params, output index)`` of ``rows`` replaced by its sampled token (in place;
    returned). The runner lists the positions of every row whose request samples (temperature > 0):
    the row's last position and its drafts' positions, with the output index each would have."""
    if not rows:
        return chosen
    pos = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=logits.device)
    p = probs(logits[pos], [r[1].temperature for r in rows], [r[1].top_k for r in rows],
              [r[1].top_p for r in rows])
    tok = sample(p, [draw(r[1].seed, r[2]) for r in rows]).tolist()
    for (i, _, _), t in zip(rows, tok):
        chosen[i] = t
    return chosen


def sampled_positions(out, last_only: bool = False) -> list[tuple]:
    """``(position, params, output index)`` of every position of the step ``out`` (a
    :class:`~cpattn.engine.scheduler.SchedulerOutput`) whose token a non-greedy request samples (rows in step order, positions in the packed [T] order): a sampled row's last position and, before
    it, its drafts' (``1 + d`` positions ending at the row's end, output indices ``num_output[b] ..
    num_output[b] + d``). ``last_only``: one position per row, its index ``b`` (a step whose logits are
    one row per request, the PCP prefill's)."""
    rows, end = [], 0
    for b, p in enumerate(out.sampling):
        end += out.query_lens[b]
        if p is None or p.greedy or not out.samples[b]:
            continue
        if last_only:
            rows.append((b, p, out.num_output[b]))
            continue
        d = len(out.draft_tokens[b])
        rows += [(end - 1 - d + j, p, out.num_output[b] + j) for j in range(d + 1)]
    return rows


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], n: int) -> list[dict[int, float]]:
    """Per row of ``logits`` [R, V] (the raw logits each token came from): ``{token: logprob}`` of
    ``tokens[r]`` and of the ``n`` most likely tokens (ties: lower id first), float64 log-softmax.

    >>> lp = token_logprobs(torch.tensor([[0.0, 0.0, -1.0]]), [2], 1)
    >>> {t: round(v, 4) for t, v in lp[0].items()}
    {2: -1.862, 0: -0.862}
    """
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    out = []
    for r, t in enumerate(tokens):
        d = {int(t): float(lp[r, t])}
        if n:
            order = lp[r].sort(descending=True, stable=True).indices[:n].tolist()
            d.update({i: float(lp[r, i]) for i in order})
        out.append(d)
    return out


# -- float64 references (the tests' oracle): plain loops over one row, no tensor tricks -------------
def reference_probs(logits: Sequence[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """:func:`probs` of one row, written out: scale, keep logits >= the k-th largest, softmax, keep
    probabilities >= the nucleus' smallest, renormalise (python floats, float64)."""
    x = [float(v) / temperature for v in logits]
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    m = max(x)
    e = [math.exp(v - m) for v in x]
    total = sum(e)
    p = [v / total for v in e]
    if top_p < 1:
        mass, floor = 0.0, None
        for v in sorted(p, reverse=True):
            if mass >= top_p:
                break
            floor, mass = v, mass + v
        p = [v if v >= floor else 0.0 for v in p]
        total = sum(p)
        p = [v / total for v in p]
    return p


def reference_sample(p: Sequence[float], u: float) -> int:
    """The first token whose cumulative probability exceeds ``u`` times the total (one row)."""
    target, acc, last = u * sum(p), 0.0, max(i for i, v in enumerate(p) if v > 0)
    for i, v in enumerate(p):
        acc += v
        if acc > target and v > 0:
            return i
    return last


def reference_verify(p: Sequence[Sequence[float]], drafts: Sequence[int], u_accept: Sequence[float],
                     u_resample: Sequence[float]) -> list[int]:
    """The textbook rule with two uniforms per position: accept draft t if ``u_accept < p(t)``; on
    rejection sample p with t removed and renormalised (``u_resample``); the bonus token from the
    last row once every draft is accepted."""
    out = []
    for j, t in enumerate(drafts):
        if u_accept[j] < p[j][t]:
            out.append(t)
            continue
        rest = [0.0 if i == t else v for i, v in enumerate(p[j])]
        out.append(reference_sample(rest, u_resample[j]))
        return out
    out.append(reference_sample(p[len(drafts)], u_resample[len(drafts)]))
    return out


def engine_seed(seed: int | None, world: Group | None) -> int:
    """The engine generator's seed (``LLMEngine(seed=...)``): ``seed``, or a random one (under torchrun rank 0's,
    all-reduced so every rank draws the same request seeds)."""
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed: saw {seed!r}; expected an int or None")
        return seed & ((1 << 63) - 1)
    drawn = secrets.randbits(62)
    if world is None or world.size == 1:
        return drawn
    return int(world.all_reduce(torch.tensor([drawn if world.rank == 0 else 0], dtype=torch.int64))[0])


__all__ = ["SamplingParams", "choose", "draw", "sampled_positions", "probs", "reference_probs", "reference_sample", "reference_verify",
           "sample", "token_logprobs", "verify"]
