"""The capturable DSpark draft step (:func:`dspark_step`) and its declared inputs (:func:`step_fields`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.drafters import cache as kv
from cpattn.drafters.dspark.config import DSparkConfig
from cpattn.drafters.dspark.head import block_hidden, context, draft_block
from cpattn.graphs.runner import Field


def step_fields(num_requests: int, max_len: int, feature_dim: int, dtype: torch.dtype) -> dict[str, Field]:
    """Inputs of a DSpark step: context rows (token rows: ``features`` [F] the concatenated target layers,
    F = :attr:`DSparkConfig.feature_size`; ``req`` / ``pos`` where their KV goes, pad: scratch) and per
    request the block's ``anchor`` token x, its position ``start`` S, its cache ``row`` (pad: scratch) and
    ``lo`` (first cached position).

    >>> sorted(step_fields(2, 8, 48, torch.float32))
    ['anchor', 'features', 'lo', 'pos', 'req', 'row', 'start']
    """
    return {"features": Field("token", (feature_dim,), dtype, pad=0),
            "req": Field("token", (), torch.int64, pad=num_requests),
            "pos": Field("token", (), torch.int64, pad=max_len),
            "anchor": Field("request", (), torch.int64, pad=0),
            "start": Field("request", (), torch.int64, pad=0),
            "row": Field("request", (), torch.int64, pad=num_requests),
            "lo": Field("request", (), torch.int64, pad=0)}


def dspark_step(state: dict, batch: dict, *, cfg: DSparkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One capturable draft step: store the context rows, draft a block per request.

    state: ``{"params": ..., "cache": [L, 2, R + 1, Lmax + 1, Hkv, hd]}``.
    Returns (drafts [A, B] int64, confidence [A, B]).

    >>> from cpattn.drafters.dspark import DSparkDrafter
    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = DSparkDrafter.random(qwen3.init_params(tcfg), tcfg, block_size=3, mask_token_id=31)
    >>> one = torch.tensor([0])
    >>> batch = {"features": torch.randn(1, 48), "req": one, "pos": one, "anchor": torch.tensor([7]),
    ...          "start": one + 1, "row": one, "lo": one}
    >>> [t.shape for t in dspark_step(d.start(1, 8).state, batch, cfg=d.cfg)]
    [torch.Size([1, 3]), torch.Size([1, 3])]
    """
    p, cache, b = state["params"], state["cache"], cfg.block_size
    a = batch["anchor"].shape[0]
    slots = torch.arange(b, device=batch["anchor"].device)
    masks = torch.full((a, b - 1), cfg.mask_token_id, dtype=torch.int64, device=slots.device)
    tokens = torch.cat([batch["anchor"][:, None], masks], 1)  # [A, B]: x, then placeholders
    pos = (batch["start"][:, None] + slots).reshape(-1)  # [A * B]
    row = batch["row"].repeat_interleave(b)  # [A * B]
    lo = batch["lo"].repeat_interleave(b)
    hi = (batch["start"] + b).repeat_interleave(b)  # every slot sees the whole block and the context before it
    ctx = context(p, cfg, batch["features"])  # [T, H]

    def attend(i, q, k_c, v_c, k_b, v_b, scale):
        kv.write(cache[i, 0], batch["req"], batch["pos"], k_c)
        kv.write(cache[i, 1], batch["req"], batch["pos"], v_c)
        kv.write(cache[i, 0], row, pos, k_b)
        kv.write(cache[i, 1], row, pos, v_b)
        return kv.attend(q, cache[i, 0], cache[i, 1], row, lo, hi, scale)

    x = F.embedding(tokens.reshape(-1), p["embed_tokens.weight"])  # [A * B, H]
    hn = block_hidden(p, cfg, x, pos, ctx, batch["pos"], attend).view(a, b, -1)
    return draft_block(p, hn, batch["anchor"])

