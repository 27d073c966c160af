"""``SchedulerConfig``: what the step loop schedules each step (vLLM's ``SchedulerConfig`` names).

- ``max_num_batched_tokens``: query tokens per step (decode tokens, drafts
  and prefill chunks together), vLLM's ``--max-num-batched-tokens``;
- ``max_num_seqs``: running requests at most, ``--max-num-seqs``;
- ``enable_chunked_prefill``: split a prompt longer than the step's
  remaining budget over steps, ``--enable-chunked-prefill``;
- ``enable_prefix_caching``: find the full KV blocks of an earlier request's
  prefix again, ``--enable-prefix-caching``;
- ``max_model_len``: the longest sequence (prompt + outputs) a request may
  reach, ``--max-model-len`` (None: the engine derives it from the KV blocks).

Example
-------
>>> SchedulerConfig(max_num_batched_tokens=256).max_num_seqs
16
>>> SchedulerConfig(max_num_seqs=0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
cpattn.config.problems.ConfigError: invalid SchedulerConfig (1 problem):
  - max_num_seqs: saw 0; rule: a positive int; fix: pass an int >= 1 as max_num_seqs
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, positive_ints, problem


@dataclass(frozen=True)
class SchedulerConfig(Checked):
    """The step loop's scheduling limits (module docstring)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None

    def field_problems(self) -> list[str]:
        out = positive_ints(self, ("max_num_batched_tokens", "max_num_seqs", "max_model_len"))
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                out.append(problem(name, repr(getattr(self, name)), "a bool", f"pass {name}=True or False"))
        return out

    def rule_problems(self) -> list[str]:
        n, m = self.max_num_batched_tokens, self.max_model_len
        if not self.enable_chunked_prefill and m is not None and n < m:
            return [problem("max_num_batched_tokens", f"max_num_batched_tokens={n}, max_model_len={m} without "
                            "chunked prefill", "a whole prompt (up to max_model_len) fits one step",
                            f"pass max_num_batched_tokens >= {m} or enable_chunked_prefill=True")]
        return []
