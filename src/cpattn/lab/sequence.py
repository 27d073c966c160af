"""The drafters over whole sequences, without a cache: the training forwards, and plain references.

The inference steps (:mod:`~cpattn.drafters.chain`, :mod:`~cpattn.drafters.dspark`)
keep a draft cache, roll it back and pad uniform batches; here the same
layer functions run over every position of whole sequences with explicit
attention masks -- what training needs (every position is a training
example, as EAGLE-3's training-time test and DeepSpec's block sampling
do), and an independent reference for the cached inference.

Chain drafters (MTP, Eagle3), depth j = 0 .. D-1: the row of depth j at
position q is ``f(feature, t_{q+1})`` with the target's hidden state as
feature at depth 0 and the depth j-1 row at q - 1's output above; it
predicts the token after q + 1 and sees the depth-0 rows at positions
``<= q - j`` and the chain that led to it (depth i at ``q - j + i``)::

    depth 0:  r0(0) r0(1) r0(2) r0(3)          r1(2) sees r0(0), r0(1), r1(2)
    depth 1:        r1(1) r1(2) r1(3)          r2(3) sees r0(0), r0(1), r1(2), r2(3)
    depth 2:              r2(2) r2(3)

which is exactly what draft d + 1 of a verification round sees (the held
rows, then its chain). DSpark: a block at every anchor a, slots a .. a + B - 1,
seeing the context rows < a and its own block.

Example
-------
>>> m = chain_mask(4, 1)     # depth-1 queries, keys of depths 0 and 1 (4 positions each)
>>> m.int().tolist()[2]
[1, 1, 0, 0, 0, 0, 1, 0]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.drafters import dspark as ds
from cpattn.ops.ref import acc_dtype


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Softmax attention under an explicit mask: q [..., N, Hq, D], k [..., M, Hkv, D], v [..., M, Hkv, Dv],
    mask [..., N, M] (True: visible; leading dims broadcast) -> [..., N, Hq, Dv]; a row that sees nothing
    gives 0. GQA by repeating KV heads.

    >>> q, k = torch.ones(2, 2, 4), torch.ones(3, 1, 4)
    >>> mask = torch.tensor([[1, 1, 0], [0, 0, 0]]).bool()
    >>> masked_attention(q, k, torch.arange(3.0).view(3, 1, 1), mask, 1.0)[:, 0, 0]
    tensor([0.5000, 0.0000])
    """
    g = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(g, dim=-2), v.repeat_interleave(g, dim=-2)
    s = torch.einsum("...nhd,...mhd->...hnm", q, k) * scale  # [..., Hq, N, M]
    s = s.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    # float32 softmax (float64 in a float64 run: a float32 one would round the reference drafts' weights)
    w = torch.softmax(s.to(acc_dtype(s)), -1).nan_to_num(0.0).to(v.dtype)  # rows without keys: 0
    return torch.einsum("...hnm,...mhd->...nhd", w, v)


def chain_mask(length: int, depth: int) -> torch.Tensor:
    """Visibility of the keys of depths 0..``depth`` (``length`` rows each, one per position) from the
    depth-``depth`` queries of one sequence: [length, (depth + 1) * length] bool."""
    pos = torch.arange(length)
    parts = [pos[None, :] <= pos[:, None] - depth]
    for i in range(1, depth + 1):
        parts.append(pos[None, :] == pos[:, None] - depth + i)
    return torch.cat(parts, 1)


def chain_forward(layer, params, cfg, tokens: torch.Tensor, features: torch.Tensor, depth: int, *,
                  rope_offset: int, mla_value_dim: int | None = None) -> list[torch.Tensor]:
    """A chain drafter's logits at depths 0..depth-1 over whole sequences (teacher-forced tokens).

    layer: :func:`~cpattn.drafters.mtp.mtp_logits_features`-like ``layer(params, cfg, tokens [N], feats [N, F],
    positions [N], attend) -> (logits [N, V'], feature [N, F])`` (MTP: bind ``cfg`` and the layer index;
    ``mla_value_dim``: its attend takes the latent row as key and value). tokens: [B, T];
    features: [B, T, F] the target's (depth-0 features). Returns depth x [B, T, V']: row q of depth j
    predicts the token after position q + 1 (valid for ``j <= q <= T - 2``).

    >>> def layer(p, c, tok, feats, pos, attend):                      # a toy one-head "drafter"
    ...     x = feats + p["emb"][tok]
    ...     y = attend(x.view(-1, 1, 4), x.view(-1, 1, 4), x.view(-1, 1, 4), 1.0).view(-1, 4)
    ...     return y @ p["emb"].T, y
    >>> out = chain_forward(layer, {"emb": torch.eye(8, 4)}, None, torch.randint(0, 8, (2, 5)), torch.zeros(2, 5, 4),
    ...                     3, rope_offset=0)
    >>> [o.shape for o in out]
    [torch.Size([2, 5, 8]), torch.Size([2, 5, 8]), torch.Size([2, 5, 8])]
    """
    b, t = tokens.shape
    pos = torch.arange(t).repeat(b)
    nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).reshape(-1)  # t_{q+1} (the last row: unused)
    feats = features.reshape(b * t, -1)
    keys: list[tuple] = []
    out = []
    for j in range(depth):
        mask = chain_mask(t, j)

        def attend(q, k, v=None, scale=None, _mask=mask):
            if mla_value_dim is not None:  # MTP: attend(q, latent, scale)
                k, scale = k, v
                v = k[..., :mla_value_dim]
            keys.append((k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:])))
            kk, vv = torch.cat([x[0] for x in keys], 1), torch.cat([x[1] for x in keys], 1)  # [B, (j+1)T, ...]
            return masked_attention(q.view(b, t, *q.shape[1:]), kk, vv, _mask, scale).reshape(b * t, q.shape[1], -1)

        logits, y = layer(params, cfg, nxt, feats, pos + rope_offset, attend)
        out.append(logits.view(b, t, -1))
        y = y.view(b, t, -1)
        feats = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], 1).reshape(b * t, -1)  # row q: row q-1's output
    return out


def chain_reference(layer, params, cfg, history: list[int], features: torch.Tensor, k: int, *, rope_offset: int,
                    mla_value_dim: int | None = None, to_target=None) -> list[int]:
    """The k drafts a chain drafter proposes after ``history`` (t_0..t_{L-1}), recomputed from scratch.

    features: [L - 1, F] the target's depth-0 features of positions 0..L-2.
    to_target: draft ids -> target ids (Eagle3's ``d2t``), default identity.

    >>> def layer(p, c, tok, feats, pos, attend):                      # predicts "previous token + 1"
    ...     x = p["emb"][tok] + 0 * attend(feats.view(-1, 1, 8), feats.view(-1, 1, 8), feats.view(-1, 1, 8),
    ...                                    1.0).view(-1, 8)
    ...     return x @ p["emb"].roll(1, 0).T, x
    >>> chain_reference(layer, {"emb": torch.eye(8)}, None, [1, 2, 3], torch.zeros(2, 8), 3, rope_offset=0)
    [4, 5, 6]
    """
    L = len(history)
    toks = torch.tensor(history[1:])  # t_{p+1} for rows p = 0..L-2
    keys: list[tuple] = []

    def run(tok, feat, positions, mask):
        def attend(q, kk, v=None, scale=None):
            if mla_value_dim is not None:
                kk, scale = kk, v
                v = kk[..., :mla_value_dim]
            keys.append((kk, v))
            return masked_attention(q, torch.cat([x[0] for x in keys]), torch.cat([x[1] for x in keys]), mask, scale)

        return layer(params, cfg, tok, feat, positions + rope_offset, attend)

    p = torch.arange(L - 1)
    logits, y = run(toks, features, p, p[None, :] <= p[:, None])
    tok = logits[-1:].argmax(-1)
    tok = to_target(tok) if to_target else tok
    drafts, feat = [int(tok)], y[-1:]
    for d in range(1, k):
        n = L - 1 + d  # keys so far: the L - 1 held rows and d - 1 chain rows; this row sees them and itself
        logits, y = run(tok, feat, torch.tensor([L - 2 + d]), torch.ones(1, n, dtype=torch.bool))
        tok = logits.argmax(-1)
        tok = to_target(tok) if to_target else tok
        drafts.append(int(tok))
        feat = y
    return drafts


def dspark_mask(length: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """DSpark's training mask per sequence: block rows (anchor a, slot) see the context rows before a and
    every row of their own block. anchors: [B, N]. Returns [B, N * S, length + N * S] bool.

    >>> dspark_mask(3, torch.tensor([[2]]), 2).int().tolist()     # context 0, 1 and the block's two slots
    [[[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]]
    """
    b, n = anchors.shape
    s = block_size
    anchor_b = anchors.repeat_interleave(s, dim=1)  # [B, N * S]
    ctx = torch.arange(length)[None, None, :] < anchor_b[..., None]  # [B, N * S, T]
    blk = torch.arange(n).repeat_interleave(s)
    return torch.cat([ctx, (blk[:, None] == blk[None, :]).expand(b, -1, -1)], 2)


def dspark_forward(params, cfg, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                   prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark blocks at ``anchors`` over whole sequences: (logits [B, N, S, V], confidence logits [B, N, S]).

    tokens: [B, T]; features: [B, T, F] the concatenated target layers;
    anchors: [B, N] positions a (each block: t_a then placeholders, slots
    a .. a + S - 1 with S = block size); prev: [B, N, S] the token before
    each slot's prediction (``t_a``, then the teacher's next tokens) for the
    Markov and confidence heads.

    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = ds.DSparkDrafter.random(qwen3.init_params(tcfg), tcfg, block_size=2, mask_token_id=31)
    >>> tok = torch.randint(0, 31, (1, 6))
    >>> logits, conf = dspark_forward(d.params, d.cfg, tok, torch.randn(1, 6, 48), torch.tensor([[1, 3]]),
    ...                               torch.zeros(1, 2, 2, dtype=torch.int64))
    >>> logits.shape, conf.shape
    (torch.Size([1, 2, 2, 32]), torch.Size([1, 2, 2]))
    """
    b, t = tokens.shape
    n, s = anchors.shape[1], cfg.block_size
    ctx = ds.context(params, cfg, features.reshape(b * t, -1))  # [B * T, H]
    pos_c = torch.arange(t).repeat(b)
    first = tokens.gather(1, anchors)  # [B, N]
    blk_tok = torch.cat([first[..., None], torch.full((b, n, s - 1), cfg.mask_token_id)], -1).reshape(-1)
    pos_b = (anchors[..., None] + torch.arange(s)).reshape(-1)  # [B * N * S]
    mask = dspark_mask(t, anchors, s)

    def attend(i, q, k_c, v_c, k_b, v_b, scale):
        def per_seq(x, rows):
            return x.view(b, rows, *x.shape[1:])

        kk = torch.cat([per_seq(k_c, t), per_seq(k_b, n * s)], 1)
        vv = torch.cat([per_seq(v_c, t), per_seq(v_b, n * s)], 1)
        return masked_attention(per_seq(q, n * s), kk, vv, mask, scale).reshape(b * n * s, q.shape[1], -1)

    x = F.embedding(blk_tok, params["embed_tokens.weight"])
    hn = ds.block_hidden(params, cfg, x, pos_b, ctx, pos_c, attend).view(b, n, s, -1)
    return ds.heads(params, hn, prev)


def dspark_reference(params, cfg, history: list[int], features: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k drafts (and confidences) DSpark proposes after ``history``, recomputed from scratch.

    features: [L - 1, F] the concatenated target layers at positions 0..L-2.

    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = ds.DSparkDrafter.random(qwen3.init_params(tcfg), tcfg, block_size=3, mask_token_id=31)
    >>> drafts, conf = dspark_reference(d.params, d.cfg, [1, 2, 3], torch.randn(2, 48), 2)
    >>> len(drafts), len(conf)
    (2, 2)
    """
    L, s = len(history), cfg.block_size
    ctx = ds.context(params, cfg, features)  # [L - 1, H]
    tok = torch.tensor([history[-1]] + [cfg.mask_token_id] * (s - 1))
    mask = torch.ones(s, L - 1 + s, dtype=torch.bool)

    def attend(i, q, k_c, v_c, k_b, v_b, scale):
        return masked_attention(q, torch.cat([k_c, k_b]), torch.cat([v_c, v_b]), mask, scale)

    x = F.embedding(tok, params["embed_tokens.weight"])
    hn = ds.block_hidden(params, cfg, x, torch.arange(L - 1, L - 1 + s), ctx, torch.arange(L - 1), attend)
    drafts, conf = ds.draft_block(params, hn[None], torch.tensor([history[-1]]))
    return drafts[0, :k].tolist(), conf[0, :k].tolist()
