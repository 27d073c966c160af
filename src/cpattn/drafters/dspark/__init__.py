"""DSpark: DeepSeek's semi-autoregressive block drafter (DeepSpec), for Qwen3, DeepSeek-V3 and DeepSeek-V4 targets.

One forward drafts a whole block. The context is the target's hidden
states of the final positions, fused from a few target layers
(``ctx_p = hidden_norm(fc([h_l1 ; h_l2 ; ...]_p))``); it enters every draft
layer only as keys and values (``k_proj`` / ``v_proj`` of ``ctx``, RoPE at
p). The block is the last known token x (position S) followed by B - 1
placeholder tokens (``mask_token_id``) at positions S .. S + B - 1; it runs
through the draft layers attending non-causally over ``[context < S | the
whole block]``, and slot i predicts the token at S + i + 1::

    hn      = norm(layers([x, M, .., M]; ctx))                           # [B, H]
    d_i     = argmax(lm_head(hn_i) + markov_w2(markov_w1[d_{i-1}]))       # d_0 = x: the Markov head,
                                                                          # a low-rank bigram inside the block
    c_i     = sigmoid(confidence([hn_i ; markov_w1[d_{i-1}]]))            # estimated survival of d_i

The confidence head estimates whether d_i survives verification given
that d_1 .. d_{i-1} did; DeepSpec uses it to choose the verification
length. Under PCP the guide validates a fixed length only, so cpattn
always verifies the first k (``k <= block_size``) and reports the head's
calibration instead (:attr:`DSparkState.calibration`).

The draft cache holds context rows only (the block's rows are written past
the held length, never read again). One draft step per verification step:
its context part is the 1 + k verified rows (uniform, a
:class:`~cpattn.graphs.DecodeRunner` program with sizes multiples of
1 + k), the block B rows per request. Weight and config names follow
DeepSpec's DSpark heads (vanilla Markov head, confidence head with Markov
features).

A fused layer's row is what the target's residual stream holds after that
layer, flattened: ``[H]`` for Qwen3 / DeepSeek-V3, and for DeepSeek-V4 its
``hc_mult`` hyper-connection streams ``[n_hc, H]`` as ``n_hc * H`` features
(lossless; DeepSpec has no V4 head, this is cpattn's choice), so ``fc``
maps ``len(target_layer_ids) * target_hidden_size`` features to H
(:attr:`DSparkConfig.feature_size`).

Example
-------
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> d = DSparkDrafter.random(qwen3.init_params(cfg), cfg, block_size=4, mask_token_id=31)
>>> d.hidden_layers, d.cfg.block_size
((0, 1, 2), 4)
"""

from cpattn.drafters.dspark.config import DSparkConfig, check_features, target_sizes
from cpattn.drafters.dspark.drafter import DSparkDrafter
from cpattn.drafters.dspark.head import block_hidden, context, draft_block, heads
from cpattn.drafters.dspark.init import random_params
from cpattn.drafters.dspark.state import DSparkState
from cpattn.drafters.dspark.step import dspark_step, step_fields

__all__ = ["DSparkConfig", "DSparkDrafter", "DSparkState", "block_hidden", "check_features", "context",
           "draft_block", "dspark_step", "heads", "random_params", "step_fields",
           "target_sizes"]
