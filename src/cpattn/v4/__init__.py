"""DeepSeek-V4 attention: explicit state, one-device steps and the context-parallel primitives.

- :mod:`cpattn.v4.cache` -- rings, compressed-entry caches and indexer keys
  as tensors (:class:`V4Cache`), rewindable for speculative decoding;
- :mod:`cpattn.v4.attention` -- the layer as LSE-merged partials and the
  sink rule (the sink rides with the window partial);
- :mod:`cpattn.v4.ring` -- the paged ring buffers (window, compressor state);
- :mod:`cpattn.v4.step` -- one step on one device or one DCP rank (:class:`V4Step`);
- :mod:`cpattn.v4.halo`, :mod:`cpattn.v4.pcp` -- prefill context parallel with halos;
- :mod:`cpattn.v4.decode` -- the capturable decode step, its host plan in static per-token buffers;
- :mod:`cpattn.v4.prefill`, :mod:`cpattn.v4.handoff`, :mod:`cpattn.v4.engine` -- the model on the
  engine: the prefill stage, the hand-off that seeds a decode cache, the family's stages;
- :mod:`cpattn.bench.v4_kv_bytes` (a benchmark helper, moved out of v4; old path still imports)
  -- exact KV bytes per token, V4 vs V3.2 vs dense MLA;
- the model's non-attention blocks (mHC, MoE) and its checkpoint names moved beside the model:
  :mod:`cpattn.models.deepseek_v4_blocks`, :mod:`cpattn.models.deepseek_v4_checkpoint` (old paths warn).

The model is :mod:`cpattn.models.deepseek_v4`; the design and the measured
tables are in docs/deepseek_v4.md.

The ops live in the one registry: :mod:`cpattn.ops.compressor`,
:mod:`cpattn.ops.window_attention`, :mod:`cpattn.ops.rows`
(the tests' float64 references are in ``tests/ref/v4.py``).
"""
