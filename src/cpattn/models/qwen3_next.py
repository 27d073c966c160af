"""Qwen3-Next and Qwen3.5 text (hybrid: Gated DeltaNet linear layers + gated full attention) as a pure function.

One file for both: Qwen3.5's text model is Qwen3-Next's with the linear
layers' input projections stored apart (``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``, ``split_projections``), dense MLPs, and
multimodal RoPE, which for text (the three position streams equal) is plain
RoPE. Its Hub form (``model_type`` ``qwen3_5``: ``text_config`` nested,
weights under ``model.language_model.``, a vision tower) loads through
:meth:`Qwen3NextConfig.from_hf` and :func:`load_params`.

``forward(params, cfg, tokens, attn, lin)`` runs the text decoder on one
step's packed tokens. Layer i's token mixer is ``cfg.layer_types[i]``:

- ``"full_attention"``: GQA with per-head q/k RMSNorm (``1 + weight``),
  partial RoPE (the first ``head_dim * partial_rotary_factor`` dims,
  half-split), and an output gate: q_proj yields ``[q | gate]`` per head and
  the attention output is multiplied by ``sigmoid(gate)`` before o_proj.
  It calls ``attn(j, q, k, v, head_dim ** -0.5)`` with j counting the full
  attention layers only (:func:`kv_layouts` has one entry per such layer).
- ``"linear_attention"``: Gated DeltaNet. in_proj_qkvz / in_proj_ba give,
  per key head, ``q, k`` [Dk] and ``v, z`` [r * Dv] and ``b, a`` [r]
  (``r = Hv / Hk``); the causal conv (kernel 4, SiLU) runs over ``q | k | v``;
  ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``; the
  gated delta rule with q/k L2-normalised and ``scale = Dk ** -0.5``; then
  the gated RMSNorm ``rms(o) * weight * silu(z)`` per value head and
  out_proj. It calls ``lin.conv(j, ...)`` / ``lin.delta(j, ...)`` with j
  counting the linear layers only (:class:`cpattn.linear.state.RecurrentStep`
  on one device).

The MLP of layer i is a sparse MoE block (softmax top-k router, optionally
renormalised, plus a shared expert scaled by ``sigmoid(shared_expert_gate)``)
when the model has experts, ``i not in mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; a dense SwiGLU otherwise. RMSNorms are
Qwen3-Next's ``x_hat * (1 + weight)`` (weights stored centred at 0).

Numerics follow transformers 5.24's torch paths: norms and the delta rule in
float32 (float64 for float64 params), gates in float32.

``FAMILY`` declares the ``"hybrid"`` cache kind
(:mod:`cpattn.engine.backends.hybrid`: paged KV for the full-attention layers,
a per-request recurrent state for the linear ones), so
:func:`cpattn.engine.generate` runs it with PCP prefill and DCP decode.

The checkpoint's MTP module (``mtp.*``) is not part of the target's params
(:func:`param_name` drops it): :class:`cpattn.drafters.qwen3_next_mtp.Qwen3NextMTPDrafter`
loads it as a drafter, fed by ``forward(..., hidden_layers=())``'s
``hidden["norm"]``. Not supported: padding masks (the step carries each
request's own tokens), prefix caching and the KV pool (they need state
snapshots: :mod:`cpattn.engine.runner_hybrid`); image / video inputs. Qwen3.5-MoE (``qwen3_5_moe``: split
projections, MoE in every layer) is this forward too; :mod:`cpattn.models.qwen3_5`
and :mod:`cpattn.models.qwen3_5_moe` declare the Qwen3.5 families.

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> from cpattn.models import qwen3_next
>>> cfg = qwen3_next.Qwen3NextConfig.tiny()
>>> params = qwen3_next.init_params(cfg, seed=0)
>>> attn = DenseKVCache.empty(qwen3_next.kv_layouts(cfg), batch=1, max_len=8).step([3])
>>> lin = qwen3_next.recurrent_cache(cfg, batch=1).step([3])
>>> qwen3_next.forward(params, cfg, torch.tensor([1, 2, 3]), attn, lin).shape
torch.Size([3, 64])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.linear.state import RecurrentCache
from cpattn.models.common import Attention, lm_head, mlp_dense, rope_cos_sin, rope_inv_freq
from cpattn.models.draft_target import DraftTarget, dense_target
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.moe import moe_experts, softmax_route
from cpattn.models.qwen3_next_config import CONFIG_RULES, LAYER_TYPES, MODEL_TYPES, Qwen3NextConfig
from cpattn.ops.norm_rope import rope_half

__all__ = ["Qwen3NextConfig", "CONFIG_RULES", "LAYER_TYPES", "MODEL_TYPES", "forward", "kv_layouts",
           "recurrent_cache", "load_params", "init_params", "rms_norm_1p", "gated_rms_norm", "rope_tables",
           "attention_block", "linear_block", "mlp_block", "param_name", "load_dtype", "FAMILY"]


# -- blocks ----------------------------------------------------------------------------------


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: ``x_hat * (1 + weight)`` in float32 (float64 for float64 x), cast back to x's dtype.

    >>> rms_norm_1p(torch.ones(2, 4), torch.zeros(4), 1e-6).tolist()[0]
    [0.9999995231628418, 0.9999995231628418, 0.9999995231628418, 0.9999995231628418]
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return (xa * (1.0 + weight.to(acc))).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The linear layers' output norm: ``weight * rms(x) * silu(gate)`` over the last dim (weight centred at 1).

    >>> gated_rms_norm(torch.ones(1, 2), torch.zeros(1, 2), torch.ones(2), 1e-6).tolist()
    [[0.0, 0.0]]
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xa.to(x.dtype)
    return (y.to(acc) * F.silu(gate.to(acc))).to(x.dtype)


def _linear(x: torch.Tensor, p: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def rope_tables(cfg: Qwen3NextConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [T, rotary_dim / 2] for positions [T]."""
    inv_freq, factor = rope_inv_freq(cfg.rotary_dim, cfg.rope, cfg.max_position_embeddings)
    return rope_cos_sin(positions, inv_freq, factor, dtype)


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    return torch.cat([rope_half(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def attention_block(p, cfg: Qwen3NextConfig, layer: int, slot: int, x, cos, sin, attn: Attention) -> torch.Tensor:
    """Gated full attention of layer ``layer`` (KV slot ``slot``): x [T, H] after input_layernorm -> [T, H]."""
    t, hd, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    pre = f"model.layers.{layer}.self_attn."
    qg = _linear(x, p, pre + "q_proj").view(t, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, hq * hd)
    k = _linear(x, p, pre + "k_proj").view(t, hkv, hd)
    v = _linear(x, p, pre + "v_proj").view(t, hkv, hd)
    q = _rope_partial(rms_norm_1p(q, p[pre + "q_norm.weight"], eps), cos, sin, cfg.rotary_dim)
    k = _rope_partial(rms_norm_1p(k, p[pre + "k_norm.weight"], eps), cos, sin, cfg.rotary_dim)
    o = attn(slot, q, k, v, hd**-0.5).reshape(t, hq * hd)  # [T, Hq * hd]
    return _linear(o * torch.sigmoid(gate), p, pre + "o_proj")


def linear_block(p, cfg: Qwen3NextConfig, layer: int, slot: int, x, lin) -> torch.Tensor:
    """Gated DeltaNet of layer ``layer`` (state slot ``slot``): x [T, H] after input_layernorm -> [T, H]."""
    t = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    pre = f"model.layers.{layer}.linear_attn."
    if cfg.split_projections:  # Qwen3.5: q | k | v already in conv order
        mixed = F.linear(x, p[pre + "in_proj_qkv.weight"])  # [T, C]
        z = F.linear(x, p[pre + "in_proj_z.weight"])
        b, a = F.linear(x, p[pre + "in_proj_b.weight"]), F.linear(x, p[pre + "in_proj_a.weight"])  # [T, Hv]
    else:  # Qwen3-Next: grouped per key head
        qkvz = F.linear(x, p[pre + "in_proj_qkvz.weight"]).view(t, hk, 2 * dk + 2 * r * dv)
        ba = F.linear(x, p[pre + "in_proj_ba.weight"]).view(t, hk, 2 * r)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv)
        mixed = torch.cat([q.reshape(t, hk * dk), k.reshape(t, hk * dk), v.reshape(t, hv * dv)], dim=-1)  # [T, C]
    mixed = lin.conv(slot, mixed, p[pre + "conv1d.weight"].squeeze(1), p.get(pre + "conv1d.bias"))
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    acc = torch.promote_types(x.dtype, torch.float32)
    beta = torch.sigmoid(b)
    g = -p[pre + "A_log"].to(acc).exp() * F.softplus(a.to(acc) + p[pre + "dt_bias"])
    o = lin.delta(slot, q, k, v, g, beta, dk**-0.5)  # [T, Hv, Dv]
    o = gated_rms_norm(o, z.reshape(t, hv, dv), p[pre + "norm.weight"], cfg.rms_norm_eps)
    return F.linear(o.reshape(t, hv * dv), p[pre + "out_proj.weight"])


def mlp_block(p, cfg: Qwen3NextConfig, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s dense SwiGLU, or its MoE block with the gated shared expert. x: [T, H] -> [T, H]."""
    pre = f"model.layers.{layer}.mlp."
    if cfg.mlp_layer_types[layer] == "dense":
        return mlp_dense(p, pre, x)
    weights, experts = softmax_route(x, p[pre + "gate.weight"], top_k=cfg.num_experts_per_tok,
                                     norm_topk_prob=cfg.norm_topk_prob, logits_dtype=x.dtype)
    out = moe_experts(x, weights.to(x.dtype), experts, p[pre + "experts.gate_up_proj"],
                      p[pre + "experts.down_proj"], impl=cfg.moe_impl)
    if pre + "shared_expert.gate_proj.weight" in p:
        shared = mlp_dense(p, pre + "shared_expert.", x)
        out = out + torch.sigmoid(F.linear(x, p[pre + "shared_expert_gate.weight"])) * shared
    return out


def forward(
    params: dict[str, torch.Tensor],
    cfg: Qwen3NextConfig,
    tokens: torch.Tensor,
    attn: Attention,
    lin,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens.

    Arguments
    ---------
    params: Hugging Face names -> tensors (``model.layers.0.linear_attn.A_log`` ...; experts stacked).
    tokens: [T] int64, this step's tokens of every request, packed.
    attn: the step of a KV cache over the full-attention layers (slot j = the
        j-th such layer); ``attn.positions`` [T] are the RoPE positions.
    lin: the step of the linear layers' states (slot j = the j-th linear
        layer): ``conv`` and ``delta`` (:class:`cpattn.linear.state.RecurrentStep`).
    logits_index: optional [T'] rows to project to the vocabulary.
    hidden_layers: optional layer indices (a tuple, possibly empty); then ``(logits, hidden)`` is returned
        with ``hidden[i]`` [T, H] the residual stream after layer i and ``hidden["norm"]`` [T, H] the
        final-normed state (what an MTP drafter reads: :mod:`cpattn.drafters.qwen3_next_mtp`).

    Returns
    -------
    logits: [T or T', vocab_size] in the params' dtype (and ``hidden``).
    """
    p, eps = params, cfg.rms_norm_eps
    keep = () if hidden_layers is None else tuple(hidden_layers)
    bad = [i for i in keep if not (isinstance(i, int) and 0 <= i < cfg.num_hidden_layers)]
    if bad:
        raise ValueError(f"hidden_layers {bad} are not layer indices of this {cfg.num_hidden_layers}-layer model; "
                         f"use 0..{cfg.num_hidden_layers - 1}")
    hidden: dict = {}
    cos, sin = rope_tables(cfg, attn.positions, p["model.embed_tokens.weight"].dtype)
    h = F.embedding(tokens, p["model.embed_tokens.weight"])  # [T, H]
    slots = {"full_attention": 0, "linear_attention": 0}
    for i, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        x = rms_norm_1p(h, p[pre + "input_layernorm.weight"], eps)
        j = slots[kind]
        slots[kind] += 1
        if kind == "full_attention":
            h = h + attention_block(p, cfg, i, j, x, cos, sin, attn)
        else:
            h = h + linear_block(p, cfg, i, j, x, lin)
        h = h + mlp_block(p, cfg, i, rms_norm_1p(h, p[pre + "post_attention_layernorm.weight"], eps))
        if i in keep:
            hidden[i] = h
    h = rms_norm_1p(h, p["model.norm.weight"], eps)
    logits = F.linear(h if logits_index is None else h[logits_index], lm_head(p, cfg))
    if hidden_layers is None:
        return logits
    hidden["norm"] = h
    return logits, hidden


def kv_layouts(cfg: Qwen3NextConfig) -> tuple[KVLayout, ...]:
    """One GQA cache row per *full-attention* layer (the linear layers keep no KV)."""
    n = len(cfg.layer_slots("full_attention"))
    return (KVLayout(cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim),) * n


def recurrent_cache(cfg: Qwen3NextConfig, *, batch: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> RecurrentCache:
    """Zero conv and recurrent states for every linear layer of ``batch`` requests."""
    return RecurrentCache.empty(len(cfg.layer_slots("linear_attention")), batch=batch,
                                conv_channels=cfg.conv_channels, kernel=cfg.linear_conv_kernel_dim,
                                heads=cfg.linear_num_value_heads, k_dim=cfg.linear_key_head_dim,
                                v_dim=cfg.linear_value_head_dim, dtype=dtype, device=device)


def load_params(state: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Params from a Hugging Face state dict (``model.*``, ``lm_head.weight``; ``mtp.*`` dropped).

    The composite Qwen3.5 form (``model.language_model.*``, a vision tower ``model.visual.*`` that text
    generation ignores) is read as the text model's names. ``A_log`` and ``dt_bias`` stay as stored (the
    reference reads them in float32).

    >>> sorted(load_params({"model.language_model.norm.weight": torch.zeros(2), "model.visual.w": torch.zeros(1)}))
    ['model.norm.weight']
    """
    from cpattn.models.common import normalize_params

    keep = {param_name(n): t for n, t in state.items() if param_name(n) is not None}
    return normalize_params(keep, dtype=dtype, load_dtype=load_dtype)


def param_name(name: str) -> str | None:
    """The params name of a checkpoint tensor: the composite Qwen3.5 form's ``model.language_model.*`` read as
    ``model.*``; None (not loaded) for MTP layers and the vision tower.

    >>> param_name("model.language_model.layers.0.mlp.gate.weight"), param_name("mtp.fc.weight")
    ('model.layers.0.mlp.gate.weight', None)
    """
    if name.startswith(("mtp.", "model.visual.")):
        return None
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def load_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """``A_log``, ``dt_bias`` and the routers stay as stored (the reference reads them in float32)."""
    return None if name.endswith(("A_log", "dt_bias", "mlp.gate.weight")) else dtype


def init_params(cfg: Qwen3NextConfig, *, seed: int = 0, std: float = 0.02, dtype=torch.float32) -> dict:
    """Random parameters with the Hugging Face names (norms at their identity). For demos and tests.

    >>> init_params(Qwen3NextConfig.tiny())["model.layers.0.linear_attn.conv1d.weight"].shape
    torch.Size([52, 1, 4])
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    hs, hd = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    zeros = lambda n: torch.zeros(n, dtype=dtype)  # noqa: E731 (1 + weight norms)
    p = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hs), "model.norm.weight": zeros(hs)}
    if not cfg.tie_word_embeddings:
        p["lm_head.weight"] = rnd(cfg.vocab_size, hs)
    for i, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        p[pre + "input_layernorm.weight"], p[pre + "post_attention_layernorm.weight"] = zeros(hs), zeros(hs)
        if kind == "full_attention":
            a = pre + "self_attn."
            p.update({a + "q_proj.weight": rnd(2 * hq * hd, hs), a + "k_proj.weight": rnd(hkv * hd, hs),
                      a + "v_proj.weight": rnd(hkv * hd, hs), a + "o_proj.weight": rnd(hs, hq * hd),
                      a + "q_norm.weight": zeros(hd), a + "k_norm.weight": zeros(hd)})
        else:
            a = pre + "linear_attn."
            if cfg.split_projections:
                p.update({a + "in_proj_qkv.weight": rnd(cfg.conv_channels, hs),
                          a + "in_proj_z.weight": rnd(hv * dv, hs),
                          a + "in_proj_b.weight": rnd(hv, hs), a + "in_proj_a.weight": rnd(hv, hs)})
            else:
                p.update({a + "in_proj_qkvz.weight": rnd(2 * hk * dk + 2 * hv * dv, hs),
                          a + "in_proj_ba.weight": rnd(2 * hv, hs)})
            p.update({a + "conv1d.weight": (torch.randn(cfg.conv_channels, 1, cfg.linear_conv_kernel_dim,
                                                        generator=gen) * 0.5).to(dtype),
                      a + "dt_bias": torch.ones(hv), a + "A_log": torch.linspace(0.01, 16, hv).log(),
                      a + "norm.weight": torch.ones(dv, dtype=dtype), a + "out_proj.weight": rnd(hs, hv * dv)})
        m = pre + "mlp."
        if cfg.mlp_layer_types[i] == "dense":
            im = cfg.intermediate_size
            p.update({m + "gate_proj.weight": rnd(im, hs), m + "up_proj.weight": rnd(im, hs),
                      m + "down_proj.weight": rnd(hs, im)})
        else:
            e, im, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            p.update({m + "gate.weight": rnd(e, hs), m + "experts.gate_up_proj": rnd(e, 2 * im, hs),
                      m + "experts.down_proj": rnd(e, hs, im)})
            if si:
                p.update({m + "shared_expert.gate_proj.weight": rnd(si, hs),
                          m + "shared_expert.up_proj.weight": rnd(si, hs),
                          m + "shared_expert.down_proj.weight": rnd(hs, si),
                          m + "shared_expert_gate.weight": rnd(1, hs)})
    return p


def draft_target(cfg: Qwen3NextConfig) -> DraftTarget:
    """The target's own GQA shape; its ``mtp.*`` module runs as layer N with full attention and an MLP that
    is MoE when the target has experts.

    >>> draft_target(Qwen3NextConfig.tiny()).mtp_layer
    {'layer_types': 'full_attention', 'mlp_layer_types': 'sparse'}
    """
    return dense_target(cfg, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
                        {"layer_types": "full_attention", "mlp_layer_types": "sparse" if cfg.num_experts else "dense"})


FAMILY = ModelFamily(name="qwen3_next", config_class=Qwen3NextConfig, attention="gqa", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=False, rename=param_name,
                     load_dtype=load_dtype, cache="hybrid", recurrent_cache=recurrent_cache,
                     draft_target=draft_target)
