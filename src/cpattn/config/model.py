"""``ModelConfig``: what the CP rules need to know about a model (vLLM's ``ModelConfig``, reduced).

``attention``: "gqa" (GQA/MQA/MHA), "mla" (one latent KV head), "dsa"
(MLA with DeepSeek sparse attention) or "v4" (DeepSeek-V4: one K = V head,
a sliding window and compressed entries, CSA's sparse top-k among them; the
guide counts it among the DSA models). ``num_attention_heads`` and
``num_kv_heads`` feed the TP and GQA-DCP rules. ``tp_splits_kv_heads``
says how TP lays the KV heads out: True as in vLLM (each TP rank holds a
slice of the KV heads, so ranks of one DCP group must share a slice: the
guide's GQA rule); False when every rank holds all KV heads (cpattn's
engine), where every DCP group holds the same KV heads by construction.

Example
-------
>>> ModelConfig(attention="GQA", num_kv_heads=8).attention
'gqa'
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, normalize, one_of, positive_ints, problem

ATTENTION_KINDS = ("gqa", "mla", "dsa", "v4")


@dataclass(frozen=True)
class ModelConfig(Checked):
    """attention, num_attention_heads, num_kv_heads, tp_splits_kv_heads (see module doc)."""

    attention: str = "gqa"
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    tp_splits_kv_heads: bool = True

    def _normalize(self) -> None:
        normalize(self, {"attention": str.lower})

    def field_problems(self) -> list[str]:
        out = one_of(self, {"attention": ATTENTION_KINDS})
        for p in positive_ints(self, ("num_attention_heads", "num_kv_heads")):
            name = p.split(":")[0]
            what = "key/value" if name == "num_kv_heads" else "attention"
            out.append(problem(name, repr(getattr(self, name)), "None or a positive int",
                               f"pass the model's number of {what} heads"))
        return out
