"""The linear layers' state slots of a hybrid model: :class:`SlotStates` runs the linear step of one batch
over per-request slots (chunks continue a slot, decodes take the recurrent op, a verify row keeps the
state after each of its positions), and :func:`pending_states` / :func:`commit_positions` hold those
per-position states until the accepted one is committed (speculative decoding).
"""

from __future__ import annotations

import torch

from cpattn.linear.state import RecurrentCache
from cpattn.ops import gated_delta as gd


class SlotStates:
    """The linear layers' step over state slots: the step loop's batch (chunks and decodes) or a decode
    program's rows.

    states: the slots' :class:`~cpattn.linear.state.RecurrentCache` (batch = ``max_num_seqs``), updated in
    place; slots [B]: each row's slot (-1: a padding row, computed from zeros and never stored); start [B]:
    True where the row starts its request (context 0: zero states, whatever the slot holds); cu [B+1]: the
    rows' query lengths (None with ``decode``); decode: every row brings one token (the recurrent op; else
    the chunked op).

    Verifying drafts (``verify`` and ``pending``): ``verify = (rows [Bv], width P)`` names the rows that carry
    drafts (a decode row of ``1 + d <= P`` tokens) and ``pending`` the per-position buffers (conv [S, P, K-1, C]
    and recurrent [S, P, Hv, Dk, Dv] per linear layer, S = slots). Those rows run the recurrent op token by
    token, exactly as ``1 + d`` plain decodes (the state rounded to its storage dtype after each token), and
    leave the state after *each* position in ``pending[slot, j]``, their slot untouched: the runner commits
    ``pending[slot, a]`` once acceptance is known (a accepted drafts, :func:`commit_positions`). ``only``:
    every row is a verify row of exactly P tokens (a captured 1 + k program, whose padding rows own no
    tokens): the plain ops do not run."""

    def __init__(self, states: RecurrentCache, slots: torch.Tensor, start: torch.Tensor, cu: torch.Tensor,
                 decode: bool, verify: tuple[torch.Tensor, int] | None = None, pending=None, only: bool = False):
        self.states, self.decode, self.pending, self.only = states, decode, pending, only
        # decode: one token per row, padding rows too (a replay's cu_seqlens_q stops at the real tokens)
        self.cu = torch.arange(slots.shape[0] + 1, dtype=torch.int32, device=slots.device) if decode else cu
        self.live = slots >= 0
        self.keep = self.live & ~start
        self.idx = slots.clamp(min=0)
        self.verify = None
        if verify is not None and verify[1] > 0:
            rows, width = verify
            self.put_mask = self.live.clone()
            self.put_mask[rows] = False  # verify rows: their states go to ``pending``, not the slot
            cu64 = cu.to(torch.int64)
            lens = (cu64[1:] - cu64[:-1])[rows]  # [Bv]
            j = torch.arange(width, device=slots.device)
            last = (lens - 1).clamp(min=0)[:, None]
            self.vtok = cu64[:-1][rows][:, None] + torch.minimum(j[None, :], last)  # [Bv, P] token of position j
            self.vvalid = j[None, :] < lens[:, None]  # [Bv, P]
            self.vlive, self.vkeep, self.vslot = self.live[rows], self.keep[rows], self.idx[rows]
            self.verify = (rows, width)
        else:
            self.put_mask = self.live

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        x = t[self.idx]
        return torch.where(self.keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype))

    def _put(self, t: torch.Tensor, new: torch.Tensor) -> None:
        m = self.put_mask
        t[self.idx[m]] = new[m].to(t.dtype)

    def _take_v(self, t: torch.Tensor) -> torch.Tensor:
        x = t[self.vslot]
        return torch.where(self.vkeep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype))

    def _scatter_v(self, y: torch.Tensor, yv: torch.Tensor) -> torch.Tensor:
        """y [T, ...] with the verify rows' valid positions replaced by yv [Bv, P, ...]."""
        t = y.shape[0]
        target = torch.where(self.vvalid, self.vtok, torch.full_like(self.vtok, t)).flatten()
        ext = torch.cat([y, y.new_zeros(1, *y.shape[1:])])
        ext[target] = yv.flatten(0, 1).to(y.dtype)
        return ext[:t]

    def _pend(self, buf: torch.Tensor, per_pos: torch.Tensor) -> None:
        m = self.vlive
        buf[self.vslot[m], :per_pos.shape[1]] = per_pos[m].to(buf.dtype)  # an eager step's P may be < 1 + k

    def conv(self, layer, x, weight, bias=None):
        if self.only:
            y = x.new_zeros(x.shape)
        else:
            y, new = gd.causal_conv1d(x, weight, bias, self.cu, self._take(self.states.conv[layer]), silu=True)
            self._put(self.states.conv[layer], new)
        if self.verify is None:
            return y
        (rows, width), store = self.verify, self.states.conv[layer]
        init = self._take_v(store)  # [Bv, W, C]
        xs = x[self.vtok].to(store.dtype)  # [Bv, P, C]; positions past a row's end repeat its last token
        nv, w = init.shape[0], init.shape[1]
        cu_v = torch.arange(nv + 1, dtype=torch.int32, device=x.device) * width
        yv, _ = gd.causal_conv1d(xs.reshape(nv * width, -1).to(x.dtype), weight, bias, cu_v, init, silu=True)
        window = torch.cat([init, xs], 1)  # [Bv, W + P, C]: the state after position j is rows j+1 .. j+W
        at = torch.arange(width, device=x.device)[:, None] + 1 + torch.arange(w, device=x.device)[None, :]
        self._pend(self.pending[0][layer], window[:, at])  # [Bv, P, W, C]
        return self._scatter_v(y, yv.view(nv, width, -1))

    def delta(self, layer, q, k, v, g, beta, scale):
        if self.only:
            o = q.new_zeros(v.shape)
        else:
            s = self._take(self.states.state[layer])
            if self.decode:
                o, new = gd.gated_delta_step(q, k, v, g, beta, s, scale=scale)
            else:
                o, new = gd.gated_delta_chunk(q, k, v, g, beta, self.cu, s, scale=scale)
            self._put(self.states.state[layer], new)
        if self.verify is None:
            return o
        (rows, width), store = self.verify, self.states.state[layer]
        s = self._take_v(store)
        outs, per_pos = [], []
        for j in range(width):  # position by position, as plain decodes: the state after each one kept
            t = self.vtok[:, j]
            oj, s = gd.gated_delta_step(q[t], k[t], v[t], g[t], beta[t], s, scale=scale)
            s = s.to(store.dtype)  # what a plain decode stores between tokens
            outs.append(oj)
            per_pos.append(s)
        self._pend(self.pending[1][layer], torch.stack(per_pos, 1))  # [Bv, P, Hv, Dk, Dv]
        return self._scatter_v(o, torch.stack(outs, 1))


def pending_states(states: RecurrentCache, width: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """NaN-filled per-position buffers for :class:`SlotStates`' verify rows: (conv [S, P, K-1, C] per linear
    layer, recurrent [S, P, Hv, Dk, Dv] per linear layer), P = ``width`` (1 + the drafts).

    >>> st = RecurrentCache((torch.zeros(2, 3, 4),), (torch.zeros(2, 1, 2, 2),))
    >>> conv, rec = pending_states(st, 3)
    >>> tuple(conv[0].shape), tuple(rec[0].shape)
    ((2, 3, 3, 4), (2, 3, 1, 2, 2))
    """
    def like(t):
        return torch.full((t.shape[0], width, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)

    return tuple(map(like, states.conv)), tuple(map(like, states.state))


def commit_positions(states: RecurrentCache, pending, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Commit, for each verify row, the states after its accepted position: ``states[slot] = pending[slot,
    position]`` (slots [n], positions [n]: the number of accepted drafts, 0 .. d), every linear layer.

    >>> st = RecurrentCache((torch.zeros(2, 3, 4),), (torch.zeros(2, 1, 2, 2),))
    >>> pend = pending_states(st, 3)
    >>> pend[1][0][1] = torch.arange(3.0).view(3, 1, 1, 1)  # slot 1: the state after positions 0, 1, 2
    >>> commit_positions(st, pend, torch.tensor([1]), torch.tensor([1]))  # one draft accepted
    >>> st.state[0][1].flatten().tolist(), bool(st.state[0][0].eq(0).all())
    ([1.0, 1.0, 1.0, 1.0], True)
    """
    for dst, src in zip((*states.conv, *states.state), (*pending[0], *pending[1])):
        dst[slots] = src[slots, positions]
