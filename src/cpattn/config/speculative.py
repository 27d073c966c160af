"""``SpeculativeConfig``: draft-and-verify decoding (vLLM's ``SpeculativeConfig``).

``speculative_method`` names the drafter ("mtp", "eagle3", "dspark",
"ngram", "draft_model", ...) and ``num_speculative_tokens`` the k drafts
verified per step. The guide's PCP constraints (greedy drafts, no SFA draft
attention, no adaptive verification, dynamic draft length not validated,
one method per attention kind) are checked by
:class:`cpattn.config.EngineConfig`, which knows the PCP size.

Example
-------
>>> SpeculativeConfig(speculative_method="MTP", num_speculative_tokens=3).query_len
4
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, is_int, normalize, problem


@dataclass(frozen=True)
class SpeculativeConfig(Checked):
    """speculative_method, num_speculative_tokens (k), draft_sampling, draft_attention,
    adaptive_verification, dynamic_draft_length."""

    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    draft_sampling: str = "greedy"
    draft_attention: str | None = None
    adaptive_verification: bool = False
    dynamic_draft_length: bool = False

    def _normalize(self) -> None:
        normalize(self, {"speculative_method": str.lower, "draft_sampling": str.lower, "draft_attention": str.lower})

    @property
    def query_len(self) -> int:
        """Query tokens a request brings to one verification step: 1 + k."""
        return 1 + self.num_speculative_tokens

    def field_problems(self) -> list[str]:
        out = []
        k = self.num_speculative_tokens
        if not is_int(k) or k < 0:
            out.append(problem("num_speculative_tokens", repr(k), "an int >= 0",
                               "pass the number of draft tokens per step (0 without speculation)"))
        for name in ("speculative_method", "draft_attention"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                out.append(problem(name, repr(value), "None or a non-empty string", f"pass a name or None as {name}"))
        if not isinstance(self.draft_sampling, str) or not self.draft_sampling:
            out.append(problem("draft_sampling", repr(self.draft_sampling), "a non-empty string",
                               'pass draft_sampling="greedy"'))
        return out

    def rule_problems(self) -> list[str]:
        out = []
        k, method = self.num_speculative_tokens, self.speculative_method
        if method is None and k > 0:
            out.append(problem("num_speculative_tokens", f"{k} with speculative_method=None",
                               "draft tokens need a speculative method",
                               "set speculative_method or num_speculative_tokens=0"))
        if method is not None and k == 0:
            out.append(problem("num_speculative_tokens", f"0 with speculative_method={method!r}",
                               "speculative decoding drafts at least one token per step",
                               "set num_speculative_tokens >= 1 (e.g. 3) or speculative_method=None"))
        return out
