"""DeepSeek-V4 as a pure function (sliding-window + CSA / HCA compressed attention, mHC, hash MoE).

``forward(params, cfg, tokens, attn)`` runs the decoder on one step's packed
tokens; ``attn`` is an attention step offering ``attn.positions`` [T] and
``attn.attend(layer, LayerInput) -> [T, H, D]`` (:class:`cpattn.v4.step.V4Step`
on one device or a DCP rank; on the engine the PCP prefill step
:class:`cpattn.v4.prefill.V4PrefillStep` and the planned, capturable decode
step :class:`cpattn.v4.decode.V4DecodeStep` -- ``FAMILY.stages``,
:mod:`cpattn.v4.engine`). Per layer::

    streams [T, n_hc, H] --hyper-connection--> x = rms_norm(sum_j pre_j streams_j)
    q_res = rms_norm(q_a_proj x);  q = rope(rms_norm_unweighted(q_b_proj q_res))   # [T, H, 512]
    kv = rope(rms_norm(kv_proj x))                                                 # [T, 512], K = V
    o = attend(q, kv, sinks, compressor inputs, indexer inputs)                    # [T, H, 512]
    o = rope^-1(o);  out = o_b_proj(grouped o_a_proj(o))                           # g groups of H/g heads
    streams = post * out + comb^T streams;  then the same around the MoE

RoPE is interleaved on the last ``qk_rope_head_dim`` (64) channels: the
"main" table (``rope_theta``) for sliding-only layers, the "compress" table
(``compress_rope_theta``, YaRN) for CSA / HCA layers, their compressed
entries (at position ``e * m``) and the indexer. The MoE routes by
``sqrtsoftplus`` scores (top-k on score + bias), or in the first
``hash_moe`` layers by a fixed ``tid2eid[token]`` table.

Supported: every layer type of the Hugging Face port, RoPE default / YaRN,
float32 / float64 / bfloat16 parameters (the reference's float32 tensors
stay float32); the engine's layouts (PCP, DCP, both, P/D), speculative
decoding and graph capture. Not supported: FP8 checkpoints, the MTP layers
(skipped on load), a cached prefix.

Example
-------
>>> import torch
>>> from cpattn.models import deepseek_v4 as v4
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg, seed=0)
>>> from cpattn.v4.step import V4Step
>>> step = V4Step(v4.empty_cache(cfg, batch=1, max_len=32), [6])
>>> v4.forward(params, cfg, torch.arange(6), step).shape
torch.Size([6, 64])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cpattn.models.draft_target import DraftTarget, paired_heads
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.common import load_checkpoint, normalize_params, rope_cos_sin, rope_inv_freq
from cpattn.models.deepseek_v4_config import CONFIG_RULES, HF_KINDS, DeepseekV4Config, check_config  # noqa: F401
from cpattn.models import deepseek_v4_blocks as blocks
from cpattn.v4.attention import Compression, LayerInput
from cpattn.v4.cache import V4Cache
from cpattn.models.deepseek_v4_checkpoint import param_name
from cpattn.v4.engine import V4Stages

# the config's names (DeepseekV4Config, check_config, CONFIG_RULES, HF_KINDS) live in deepseek_v4_config and are
# importable from here too

# parameters the reference keeps in float32 whatever the model dtype (its strict keep-in-float32 modules:
# hyper-connections, sinks, position biases, the router's correction bias, every RMSNorm)
FP32_PARAMS = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.weight",
               "layernorm.weight")


def empty_cache(cfg: DeepseekV4Config, *, batch: int, max_len: int, max_rewind: int = 0, block_size: int = 16,
                dtype=torch.float32, device="cpu", **dcp) -> V4Cache:
    """An empty :class:`~cpattn.v4.cache.V4Cache` (``dcp``: dcp_rank, dcp_size, interleave, seed)."""
    return V4Cache.empty(cfg.layout(max_rewind=max_rewind, block_size=block_size), batch=batch, max_len=max_len,
                         dtype=dtype, device=device, **dcp)


def _rope(cfg: DeepseekV4Config, table: str, positions: torch.Tensor, dtype: torch.dtype):
    rope = cfg.rope_main if table == "main" else cfg.rope_compress
    inv, factor = rope_inv_freq(cfg.qk_rope_head_dim, rope, cfg.max_position_embeddings)
    return rope_cos_sin(positions, inv, factor, dtype)  # [T, r/2] each


def _compression(p: dict, cfg: DeepseekV4Config, pre: str, x: torch.Tensor) -> Compression:
    """A compressor's projections of x [T, H] and its finish (RMSNorm, compress RoPE at ``e * m``)."""
    norm = p[pre + "kv_norm.weight"]

    def finish(pooled: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = _rope(cfg, "compress", positions, pooled.dtype)
        return blocks.rope_tail(blocks.rms_norm(pooled, norm, cfg.rms_norm_eps)[:, None], cos, sin)[:, 0]

    return Compression(F.linear(x, p[pre + "kv_proj.weight"]), F.linear(x, p[pre + "gate_proj.weight"]),
                       p[pre + "position_bias"], finish)


def attention(p: dict, cfg: DeepseekV4Config, layer: int, x: torch.Tensor, attn: Any, ropes: dict) -> torch.Tensor:
    """One layer's attention block: x [T, H] (after input_layernorm) -> [T, H]."""
    pre, eps = f"model.layers.{layer}.self_attn.", cfg.rms_norm_eps
    t, nh, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    kind = cfg.layer_types[layer]
    cos, sin = ropes["main" if kind == "sliding" else "compress"]
    q_res = blocks.rms_norm(F.linear(x, p[pre + "q_a_proj.weight"]), p[pre + "q_a_norm.weight"], eps)  # [T, q_lora]
    q = blocks.rms_norm_unweighted(F.linear(q_res, p[pre + "q_b_proj.weight"]).view(t, nh, d), eps)
    q = blocks.rope_tail(q, cos, sin)  # [T, H, D]
    kv = blocks.rms_norm(F.linear(x, p[pre + "kv_proj.weight"]), p[pre + "kv_norm.weight"], eps)
    kv = blocks.rope_tail(kv[:, None], cos, sin)[:, 0]  # [T, D]
    inp = LayerInput(q, kv, p[pre + "sinks"], d**-0.5)
    if kind != "sliding":
        inp = LayerInput(q, kv, p[pre + "sinks"], d**-0.5, compression=_compression(p, cfg, pre + "compressor.", x))
    if kind == "csa":
        ip, hi, di = pre + "compressor.indexer.", cfg.index_n_heads, cfg.index_head_dim
        cq, sq = ropes["compress"]
        iq = blocks.rope_tail(F.linear(q_res, p[ip + "q_b_proj.weight"]).view(t, hi, di), cq, sq)  # [T, H_I, D_I]
        w = F.linear(x, p[ip + "scorer.weights_proj.weight"]).to(torch.promote_types(x.dtype, torch.float32))
        inp = LayerInput(q, kv, p[pre + "sinks"], d**-0.5, compression=inp.compression, index_q=iq,
                         index_weights=w * (hi**-0.5 * di**-0.5), index_compression=_compression(p, cfg, ip, x),
                         topk=cfg.index_topk)
    o = blocks.rope_tail(attn.attend(layer, inp), cos, -sin)  # [T, H, D]: undo the values' rotation
    g = cfg.o_groups
    wa = p[pre + "o_a_proj.weight"].view(g, cfg.o_lora_rank, nh * d // g)  # [G, R, H D / G]
    grouped = torch.einsum("tgi,gri->tgr", o.reshape(t, g, nh * d // g), wa).reshape(t, g * cfg.o_lora_rank)  # [T, G R]
    return F.linear(grouped, p[pre + "o_b_proj.weight"])


def moe(p: dict, cfg: DeepseekV4Config, layer: int, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One layer's MoE block (routed experts + the shared expert): x [T, H] -> [T, H]."""
    pre = f"model.layers.{layer}.mlp."
    hashed = cfg.mlp_layer_types[layer] == "hash_moe"
    w, chosen = blocks.route(x, p[pre + "gate.weight"], None if hashed else p[pre + "gate.e_score_correction_bias"],
                             p[pre + "gate.tid2eid"] if hashed else None, tokens, top_k=cfg.num_experts_per_tok,
                             scoring=cfg.scoring_func, scaling=cfg.routed_scaling_factor)
    y = blocks.experts(x, w, chosen, p[pre + "experts.gate_up_proj"], p[pre + "experts.down_proj"], cfg.swiglu_limit)
    s = pre + "shared_experts."
    return y + blocks.mlp(x, p[s + "gate_proj.weight"], p[s + "up_proj.weight"], p[s + "down_proj.weight"],
                          cfg.swiglu_limit)


def forward(params: dict[str, torch.Tensor], cfg: DeepseekV4Config, tokens: torch.Tensor, attn: Any, *,
            logits_index: torch.Tensor | None = None, hidden_layers: tuple[int, ...] | None = None):
    """Logits [T or T', V] of one step's packed tokens [T] (see the module doc).

    With ``hidden_layers`` also a dict: ``"norm"`` the final-normed hidden
    state [T, H], and layer i's residual streams [T, n_hc, H].
    """
    p, eps = params, cfg.rms_norm_eps
    hc = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_eps=eps)
    h = F.embedding(tokens, p["model.embed_tokens.weight"])  # [T, H]
    streams = h[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # [T, n_hc, H]
    ropes = {t: _rope(cfg, t, attn.positions, h.dtype) for t in ("main", "compress")}
    keep, hidden = set(hidden_layers or ()), {}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        post, comb, x = blocks.hyper_weights(streams, p[pre + "attn_hc.fn"], p[pre + "attn_hc.base"],
                                             p[pre + "attn_hc.scale"], **hc)
        a = attention(p, cfg, i, blocks.rms_norm(x, p[pre + "input_layernorm.weight"], eps), attn, ropes)
        streams = blocks.hyper_mix(streams, a, post, comb)
        post, comb, x = blocks.hyper_weights(streams, p[pre + "ffn_hc.fn"], p[pre + "ffn_hc.base"],
                                             p[pre + "ffn_hc.scale"], **hc)
        m = moe(p, cfg, i, blocks.rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps), tokens)
        streams = blocks.hyper_mix(streams, m, post, comb)
        if i in keep:
            hidden[i] = streams
    h = blocks.hyper_head(streams, p["model.hc_head.hc_fn"], p["model.hc_head.hc_base"], p["model.hc_head.hc_scale"],
                          hc_eps=cfg.hc_eps, rms_eps=eps)
    h = blocks.rms_norm(h, p["model.norm.weight"], eps)  # [T, H]
    head = p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    logits = F.linear(h if logits_index is None else h[logits_index], head)
    if hidden_layers is None:
        return logits
    hidden["norm"] = h
    return logits, hidden


def load_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype params tensor ``name`` takes in a load in ``dtype``: float32 for the reference's float32
    tensors (:data:`FP32_PARAMS`), else ``dtype`` (the family's ``load_dtype``)."""
    return torch.float32 if any(s in name for s in FP32_PARAMS) else dtype


def params_from_state(state: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Params from a state dict in Hugging Face or DeepSeek naming (:mod:`cpattn.models.deepseek_v4_checkpoint`):
    MTP weights dropped, per-expert weights stacked, the reference's float32 tensors kept float32."""
    named = {param_name(k): v for k, v in state.items() if param_name(k) is not None}
    return normalize_params(named, dtype=dtype, load_dtype=load_dtype)


def load(path: str, *, dtype: torch.dtype | None = None) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """(config, params) from a local checkpoint directory (``config.json`` + ``*.safetensors``), as
    :func:`cpattn.models.load_checkpoint` reads it (names of either spelling, checked before loading)."""
    config, params = load_checkpoint(path, dtype=dtype)
    return DeepseekV4Config.from_hf(config), params


def init_params(
    cfg: DeepseekV4Config, *, seed: int = 0, std: float = 0.02, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (norms near 1, biases and sinks random). For demos and tests."""
    g = torch.Generator().manual_seed(seed)
    hs, nh, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    e, im, hi, di = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.index_n_heads, cfg.index_head_dim

    def rnd(*shape, s=std, mean=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * s + mean).to(dt)

    p = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hs), "model.norm.weight": rnd(hs, s=0.1, mean=1.0),
         "model.hc_head.hc_fn": rnd(n, n * hs, dt=torch.float32), "model.hc_head.hc_base": rnd(n, s=0.1),
         "model.hc_head.hc_scale": rnd(1, s=0.1, mean=1.0)}
    if not cfg.tie_word_embeddings:
        p["lm_head.weight"] = rnd(cfg.vocab_size, hs)
    for i, kind in enumerate(cfg.layer_types):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        p.update({a + "sinks": rnd(nh, s=1.0), a + "q_a_proj.weight": rnd(cfg.q_lora_rank, hs),
                  a + "q_a_norm.weight": rnd(cfg.q_lora_rank, s=0.1, mean=1.0),
                  a + "q_b_proj.weight": rnd(nh * d, cfg.q_lora_rank),
                  a + "kv_proj.weight": rnd(d, hs), a + "kv_norm.weight": rnd(d, s=0.1, mean=1.0),
                  a + "o_a_proj.weight": rnd(cfg.o_groups * cfg.o_lora_rank, nh * d // cfg.o_groups),
                  a + "o_b_proj.weight": rnd(hs, cfg.o_groups * cfg.o_lora_rank)})
        comps = {"csa": [(a + "compressor.", 2 * d, cfg.csa_ratio), (a + "compressor.indexer.", 2 * di, cfg.csa_ratio)],
                 "hca": [(a + "compressor.", d, cfg.hca_ratio)], "sliding": []}[kind]
        for c, width, ratio in comps:
            out = width // 2 if kind == "csa" else width  # CSA pools two series into one
            p.update({c + "kv_proj.weight": rnd(width, hs), c + "gate_proj.weight": rnd(width, hs),
                      c + "position_bias": rnd(ratio, width, s=0.5), c + "kv_norm.weight": rnd(out, s=0.1, mean=1.0)})
        if kind == "csa":
            p[a + "compressor.indexer.q_b_proj.weight"] = rnd(hi * di, cfg.q_lora_rank)
            p[a + "compressor.indexer.scorer.weights_proj.weight"] = rnd(hi, hs)
        p.update({m + "gate.weight": rnd(e, hs), m + "experts.gate_up_proj": rnd(e, 2 * im, hs),
                  m + "experts.down_proj": rnd(e, hs, im), m + "shared_experts.gate_proj.weight": rnd(im, hs),
                  m + "shared_experts.up_proj.weight": rnd(im, hs), m + "shared_experts.down_proj.weight": rnd(hs, im)})
        if cfg.mlp_layer_types[i] == "hash_moe":
            p[m + "gate.tid2eid"] = torch.randint(0, e, (cfg.vocab_size, cfg.num_experts_per_tok), generator=g)
        else:
            p[m + "gate.e_score_correction_bias"] = rnd(e, s=0.1, dt=torch.float32)
        for hc in ("attn_hc.", "ffn_hc."):
            pre = f"model.layers.{i}.{hc}"
            p.update({pre + "fn": rnd((2 + n) * n, n * hs, dt=torch.float32), pre + "base": rnd((2 + n) * n, s=0.1),
                      pre + "scale": rnd(3, s=0.1, mean=1.0)})
        p[f"model.layers.{i}.input_layernorm.weight"] = rnd(hs, s=0.1, mean=1.0)
        p[f"model.layers.{i}.post_attention_layernorm.weight"] = rnd(hs, s=0.1, mean=1.0)
    return p


def kv_layouts(cfg: DeepseekV4Config) -> tuple[KVLayout, ...]:
    """The per-token row of every layer: the K = V window row (D). Compressed entries (one per m
    tokens) and the rings are V4's own state (:class:`~cpattn.v4.cache.V4Cache`), not per-token rows."""
    return (KVLayout(1, cfg.head_dim, cfg.head_dim, values_in_keys=True),) * cfg.num_hidden_layers


def draft_target(cfg: DeepseekV4Config) -> DraftTarget:
    """What drafters read of V4: a layer's row is its ``hc_mult`` streams flattened (``n_hc * H``); no dense
    MLP, so a draft layer takes the experts' size; the sliding layers' RoPE (``rope_main``, without the
    compressed layers' YaRN); :func:`~cpattn.models.draft_target.paired_heads`; no MTP layer declared.

    >>> t = draft_target(DeepseekV4Config.tiny())
    >>> t.row_width, t.intermediate_size, t.rope["rope_theta"], t.mtp_layer
    (64, 16, 10000.0, None)
    """
    heads, kv_heads, head_dim = paired_heads(cfg)
    return DraftTarget(hidden_size=cfg.hidden_size, row_width=cfg.hc_mult * cfg.hidden_size,
                       intermediate_size=cfg.moe_intermediate_size, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, rope=dict(cfg.rope_main),
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps)


FAMILY = ModelFamily(name="deepseek_v4", config_class=DeepseekV4Config, attention="v4", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True, cache="v4",
                     stages=V4Stages(forward),
                     rename=param_name, load_dtype=load_dtype, draft_target=draft_target)
