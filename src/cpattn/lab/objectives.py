"""Self-distillation objectives: each method's loss on a batch of the target's greedy continuations.

The labels are the target's own argmax at every position (``GreedyData.greedy``):
a draft is accepted exactly when it equals that token, so this is the
quantity to fit. Every position of a sequence is an example at once
(:mod:`cpattn.lab.sequence`):

- MTP / Eagle3 (chain drafters): depths 0 .. D-1 as EAGLE-3's training-time
  test -- depth j feeds the draft's own depth j-1 output as the feature
  and sees what draft j + 1 sees at inference; depth j's loss weighs
  ``0.8**j``. Tokens are teacher-forced: only drafts whose predecessors
  were accepted matter, and then those predecessors are the target's tokens.
- DSpark: a block at random anchors; slot i's cross entropy weighs
  ``exp(-i / 4)`` (DeepSpec's decay); the Markov head sees the teacher's
  previous token; the confidence head fits (binary cross entropy) whether
  the slot's greedy draft equals the label -- the survival of that draft
  given its predecessors, under greedy verification.

Example
-------
>>> weights(3)
[1.0, 0.8, 0.64]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.drafters import eagle3 as e3
from cpattn.drafters import mtp as mt
from cpattn.lab import sequence as sq
from cpattn.lab.target import GreedyData

DECAY = 0.8  # chain depth j weighs DECAY**j
GAMMA = 4.0  # DSpark slot i weighs exp(-i / GAMMA)


def weights(depth: int) -> list[float]:
    """Loss weight of each chain depth."""
    return [round(DECAY**j, 12) for j in range(depth)]


def frozen(method: str) -> tuple[str, ...]:
    """Name suffixes a method does not train: the target's embedding and head it shares or copies, and
    buffers (router bias, ``d2t``).

    >>> "lm_head.weight" in frozen("dspark"), "lm_head.weight" in frozen("eagle3")
    (True, False)
    """
    common = ("embed_tokens.weight", "e_score_correction_bias", "d2t")
    return common + {"mtp": ("shared_head.head.weight",), "dspark": ("lm_head.weight",)}.get(method, ())


def chain_loss(logits: list[torch.Tensor], greedy: torch.Tensor, valid_from: int = 0,
               ignore: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross entropy of depths' logits [B, T, V'] against labels ``greedy[:, q + 1]`` (the token the
    target emits after position q + 1), rows ``q >= j``; ``ignore`` [B, T] marks labels not in the draft
    vocabulary (Eagle3). Returns (loss, per-depth accuracy).

    >>> greedy = torch.tensor([[1, 2, 3, 0]])
    >>> perfect = 50 * torch.nn.functional.one_hot(torch.tensor([[2, 3, 0, 0]]), 4).float()
    >>> loss, acc = chain_loss([perfect], greedy)
    >>> round(float(loss), 4), acc
    (0.0, [1.0])
    """
    b, t = greedy.shape
    label = torch.cat([greedy[:, 1:], greedy[:, -1:]], 1)  # [B, T]: row q's label
    ok = torch.zeros(b, t, dtype=torch.bool)
    ok[:, : t - 1] = True  # the last row has no label (no position after it)
    if ignore is not None:
        ok &= ~torch.cat([ignore[:, 1:], ignore[:, -1:]], 1)
    total, acc, w = 0.0, [], weights(len(logits))
    for j, lg in enumerate(logits):
        m = ok.clone()
        m[:, : max(j, valid_from)] = False
        ce = F.cross_entropy(lg[m].float(), label[m])
        total = total + w[j] * ce
        acc.append(float((lg[m].argmax(-1) == label[m]).float().mean()))
    return total / sum(w), acc


def mtp_loss(drafter: mt.MTPDrafter, data: GreedyData, idx: torch.Tensor, depth: int):
    """MTP: chain depths over the target's final-normed states; ``idx`` [b] the sequences of the batch.

    >>> from cpattn.lab import target as tg
    >>> cfg = tg.tiny_config("deepseek_v3", vocab_size=32, hidden_size=32, num_layers=2)
    >>> p = tg.init("deepseek_v3", cfg, seed=0)
    >>> data = tg.greedy_data("deepseek_v3", p, cfg, torch.ones(2, 2, dtype=torch.int64), 5, ())
    >>> loss, acc = mtp_loss(mt.MTPDrafter.random("deepseek_v3", cfg, target_params=p), data, torch.arange(2), 2)
    >>> loss.ndim, len(acc)
    (0, 2)
    """
    cfg = mt.block_config(drafter.cfg)

    def layer(p, c, *a):
        return mt.mtp_logits_features(p, c, drafter.layer, *a)

    logits = sq.chain_forward(layer, drafter.params, cfg, data.tokens[idx], data.hidden["norm"][idx], depth,
                              rope_offset=1, mla_value_dim=drafter.cfg.kv_lora_rank)
    return chain_loss(logits, data.greedy[idx])


def eagle3_loss(drafter: e3.Eagle3Drafter, data: GreedyData, idx: torch.Tensor, depth: int):
    """Eagle3: chain depths over fc-fused low/mid/high states; labels in draft-vocabulary ids.

    >>> from cpattn.lab import target as tg
    >>> cfg = tg.tiny_config("qwen3", vocab_size=32, hidden_size=16, num_layers=4)
    >>> p = tg.init("qwen3", cfg, seed=0)
    >>> data = tg.greedy_data("qwen3", p, cfg, torch.ones(2, 2, dtype=torch.int64), 5, (0, 1, 2))
    >>> loss, acc = eagle3_loss(e3.Eagle3Drafter.random(p, cfg, draft_vocab=20), data, torch.arange(2), 2)
    >>> loss.ndim, len(acc)
    (0, 2)
    """
    p, cfg = drafter.params, drafter.cfg
    feats = e3.fuse(p, cfg, {i: data.hidden[i][idx] for i in cfg.target_layer_ids})
    logits = sq.chain_forward(e3.eagle3_layer, p, cfg, data.tokens[idx], feats, depth, rope_offset=0)
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
    ids = torch.arange(cfg.draft_vocab_size) + p["d2t"]
    t2d[ids] = torch.arange(cfg.draft_vocab_size)
    g = t2d[data.greedy[idx]]  # [B, T] draft ids, -1 outside the draft vocabulary
    return chain_loss(logits, g.clamp_min(0), ignore=g < 0)


def dspark_loss(drafter, data: GreedyData, idx: torch.Tensor, anchors_per_seq: int, generator: torch.Generator):
    """DSpark: blocks at random anchors; returns (loss, per-slot accuracy).

    >>> from cpattn.lab import target as tg
    >>> from cpattn.drafters.dspark import DSparkDrafter
    >>> cfg = tg.tiny_config("qwen3", vocab_size=32, hidden_size=16, num_layers=4)
    >>> p = tg.init("qwen3", cfg, seed=0)
    >>> data = tg.greedy_data("qwen3", p, cfg, torch.ones(2, 2, dtype=torch.int64), 6, (0, 1, 2))
    >>> d = DSparkDrafter.random(p, cfg, block_size=2, mask_token_id=31)
    >>> loss, acc = dspark_loss(d, data, torch.arange(2), 3, torch.Generator().manual_seed(0))
    >>> loss.ndim, len(acc)
    (0, 2)
    """
    p, cfg = drafter.params, drafter.cfg
    tokens, greedy = data.tokens[idx], data.greedy[idx]
    b, t = tokens.shape
    s = cfg.block_size
    n = min(anchors_per_seq, t - 2)
    anchors = torch.stack([torch.randperm(t - 2, generator=generator)[:n] + 1 for _ in range(b)]).sort(1).values
    slot = torch.arange(s)
    at = anchors[..., None] + slot  # [B, N, S] position whose argmax slot i predicts
    valid = at <= t - 1  # the label greedy[a + i] exists for positions of the data
    atc = at.clamp_max(t - 1)
    label = greedy.gather(1, atc.view(b, -1)).view(b, n, s)
    prev = torch.cat([tokens.gather(1, anchors)[..., None], label[..., :-1]], -1)  # [B, N, S]
    feats = torch.cat([data.hidden[i][idx] for i in cfg.target_layer_ids], -1)
    logits, conf = sq.dspark_forward(p, cfg, tokens, feats, anchors, prev)
    w = torch.exp(-slot.float() / GAMMA)[None, None].expand(b, n, s)[valid]
    ce = F.cross_entropy(logits[valid].float(), label[valid], reduction="none")
    hit = (logits[valid].argmax(-1) == label[valid]).float()
    bce = F.binary_cross_entropy_with_logits(conf[valid].float(), hit.detach(), reduction="none")
    loss = (w * ce).sum() / w.sum() + (w * bce).sum() / w.sum()
    acc = [float(((logits.argmax(-1) == label) & valid)[..., i].sum() / valid[..., i].sum().clamp_min(1))
           for i in range(s)]
    return loss, acc
